#pragma once
// DeviceChecksummedTransport<Inner>: the check of ChecksummedTransport
// (adapters/checksummed.hpp) for device transports (NcclTransport,
// DeviceSimTransport). Every all-to-all segment another rank sends is
// checked on the device against its sender's CRC32C, so a corrupted or
// short delivery is an error naming the source rank and the segment instead
// of wrong numbers downstream.
//
//   cpdispatch::NcclTransport nccl(comm, stream);
//   cpdispatch::DeviceChecksummedTransport checked(nccl);
//   cpdispatch::ContextParallelAttention<decltype(checked), bf16> op(checked, share, shape);   // or a Dispatcher, ...
//   op.forward(...); op.backward(...);
//   checked.check();   // once a step: throws corruption_error on every rank if any segment was bad
//
// How, without a host synchronisation in the step: before each exchange a
// kernel on the transport's stream computes the CRC32C of each segment the
// rank sends (cuda/crc32c.hpp: one pass over the bytes), or, where the
// exchange engine packs the send buffer (the dispatchers and the op, unless
// a side is sent in place), the pack computes them as it writes the bytes
// (pack_sums: no pass of its own); one more exchange
// of 16 bytes per peer, of the same kind (blocking or posted) and through
// the inner transport, carries those (checksum, byte count) pairs; once the
// exchange is complete on the stream (after the blocking call, or in the
// posted exchange's wait()), a kernel checksums what the rank received and
// compares. A bad segment is recorded on the device (the first one since
// the last check) and the stream goes on: nothing waits for the verdict.
//
// check() is where the host learns it: it waits for the stream, reads the
// record and throws corruption_error when a segment was bad; with
// ChecksumOptions::agree (the default) the ranks first all-gather their
// records (64 bytes a rank, on the stream), so every rank throws, the
// receiving rank naming the segment and the others naming it. check() is a
// collective with agreement: every rank calls it at the same point (e.g.
// after each step's backward, before the optimizer uses the gradients). It
// covers every exchange completed before it (a posted exchange once its
// wait() was called). Until check() returns, outputs of the exchanges since
// the last check are unverified.
//
// Checked: all_to_all_v and post_all_to_all_v (every exchange of the
// dispatchers and of the attention op on device transports). Forwarded
// unchecked: point-to-point messages and the collectives.
//
// Costs: two CRC passes (what a rank sends, in its pack where it is
// packed, and what it receives), one
// exchange of 16 bytes per peer per exchange, an upload of the segments'
// ranges and sums' start (80 bytes per peer) per exchange; per check() one
// all-gather of 64 bytes a rank and one host synchronisation. Device
// memory: the tables (200 KiB) and, per exchange in flight, 96 bytes per
// peer (recycled once the exchange is checked).
//
// Requires nvcc (kernels), or the project's CUDA runtime double.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpdispatch/adapters/checksummed.hpp"
#include "cpdispatch/cuda/crc32c.hpp"
#include "cpdispatch/cuda_runtime/error.hpp"
#include "cpdispatch/cuda_runtime/launch.hpp"
#include "cpdispatch/cuda_runtime/memory.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch {

namespace detail::checksum {

/// A rank's record of bad segments on the device: the first bad one since
/// the last check(), and how many segments were checked.
struct DeviceVerdict {
  std::uint32_t bad = 0;
  std::int32_t source = -1;
  std::uint32_t sent_crc = 0, got_crc = 0;  // CRC32C values
  std::uint64_t sent_bytes = 0, got_bytes = 0;
  std::uint64_t exchange = 0;
  std::uint64_t offset = 0;  // the segment's byte in the receive buffer
  std::uint64_t checked = 0;
  std::uint64_t reserved = 0;
};
static_assert(std::is_trivially_copyable_v<DeviceVerdict> && sizeof(DeviceVerdict) == 64);

/// One thread compares each received segment's sum with its sender's (the
/// rank's own segment is skipped). A template: a header's kernel, defined
/// once however many translation units include it.
template <class = void>
__global__ void compare_segments_kernel(const cuda::SegmentCrc* got, const cuda::SegmentCrc* sent, const cuda::CrcRange* received,
                                               std::uint32_t W, std::uint32_t self, std::uint64_t exchange, DeviceVerdict* verdict) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  for (std::uint32_t p = 0; p < W; ++p) {
    if (p == self) continue;
    if (got[p].crc == sent[p].crc && got[p].bytes == sent[p].bytes) {
      ++verdict->checked;
      continue;
    }
    if (verdict->bad) return;  // the first bad segment is the one reported
    verdict->bad = 1;
    verdict->source = static_cast<std::int32_t>(p);
    verdict->sent_crc = ~sent[p].crc;
    verdict->got_crc = ~got[p].crc;
    verdict->sent_bytes = sent[p].bytes;
    verdict->got_bytes = got[p].bytes;
    verdict->exchange = exchange;
    verdict->offset = received[p].offset;
    return;
  }
}

/// One exchange's checksums on their way: the ranges and sums on the host
/// (the upload's source) and on the device. Claimed by an exchange (`claim`)
/// until its received bytes are checked on the stream (`release`); free again
/// once that check has run (`done`).
class DeviceExchangeSums {
 public:
  explicit DeviceExchangeSums(std::size_t W) : W_(W), host_(words(W)), device_(words(W)), sums_in_(W) {}

  /// Lays out the ranges and the sums' start for these counts and uploads them on `stream`.
  void prepare(std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs, std::span<const std::size_t> recv_counts,
               std::span<const std::size_t> recv_displs, std::size_t self, cudaStream_t stream) {
    send_chunks_ = lay_out(send_counts, send_displs, self, host_ranges(0), host_sums(2));
    recv_chunks_ = lay_out(recv_counts, recv_displs, self, host_ranges(1), host_sums(3));
    device_.upload(std::span<const std::uint64_t>(host_), stream);
  }
  /// The sums of what this rank sends, on `stream`.
  void sum_sent(const void* send, const std::uint32_t* tables, cudaStream_t stream) {
    cuda::launch_segment_crc(static_cast<const std::byte*>(send), ranges(0), static_cast<std::uint32_t>(W_), send_chunks_, tables, sums(2), stream);
  }
  /// The sums of what it received, compared with its senders' into `verdict`, on `stream`.
  void check_received(const void* recv, const std::uint32_t* tables, std::size_t self, std::uint64_t exchange, DeviceVerdict* verdict,
                      cudaStream_t stream) {
    cuda::launch_segment_crc(static_cast<const std::byte*>(recv), ranges(1), static_cast<std::uint32_t>(W_), recv_chunks_, tables, sums(3), stream);
    cuda::launch_kernel("compare_segments_kernel", &compare_segments_kernel<>, 1, 1, stream, static_cast<const cuda::SegmentCrc*>(sums(3)),
                        static_cast<const cuda::SegmentCrc*>(sums_in_.data()), static_cast<const cuda::CrcRange*>(ranges(1)),
                        static_cast<std::uint32_t>(W_), static_cast<std::uint32_t>(self), exchange, verdict);
  }
  /// Where a pack fused with the checksum XORs the sums of what it writes (in place of sum_sent).
  cuda::CrcTarget sent_target(const std::uint32_t* tables) const noexcept { return {ranges(0), static_cast<std::uint32_t>(W_), tables, sums(2)}; }
  const cuda::SegmentCrc* sums_out() const noexcept { return sums(2); }
  cuda::SegmentCrc* sums_in() noexcept { return sums_in_.data(); }

  /// Whether another exchange may claim these: not claimed, and the last check has run on the device.
  bool free() const {
    if (claimed_) return false;
    const cudaError_t state = cudaEventQuery(done_.get());
    if (state == cudaErrorNotReady) return false;
    cuda_check(state, "cudaEventQuery", __FILE__, __LINE__);
    return true;
  }
  void claim() noexcept { claimed_ = true; }
  /// The check is queued on `stream`: free once it has run.
  void release(cudaStream_t stream) {
    done_.record(stream);
    claimed_ = false;
  }

 private:
  // Layout in words: the send ranges, the receive ranges (3 words a peer each), the sent sums, the received sums (2 a peer each).
  static std::size_t words(std::size_t W) { return 10 * W; }
  std::size_t at(int part) const { return part < 2 ? 3 * W_ * static_cast<std::size_t>(part) : 6 * W_ + 2 * W_ * static_cast<std::size_t>(part - 2); }
  cuda::CrcRange* host_ranges(int part) { return reinterpret_cast<cuda::CrcRange*>(host_.data() + at(part)); }
  cuda::SegmentCrc* host_sums(int part) { return reinterpret_cast<cuda::SegmentCrc*>(host_.data() + at(part)); }
  cuda::CrcRange* ranges(int part) const { return reinterpret_cast<cuda::CrcRange*>(device_.data() + at(part)); }
  cuda::SegmentCrc* sums(int part) const { return reinterpret_cast<cuda::SegmentCrc*>(device_.data() + at(part)); }

  /// The ranges of one side (the rank's own segment empty: it never travels) and its sums' start; returns the chunks.
  std::uint64_t lay_out(std::span<const std::size_t> counts, std::span<const std::size_t> displs, std::size_t self, cuda::CrcRange* ranges,
                        cuda::SegmentCrc* sums) const {
    std::uint64_t chunks = 0;
    for (std::size_t p = 0; p < W_; ++p) {
      const std::uint64_t bytes = p == self ? 0 : counts[p];
      if (bytes >> cuda::crc_shift_levels) {
        detail::fail("DeviceChecksummedTransport: segment ", p, " has ", bytes, " bytes, more than the checksum's 2^", cuda::crc_shift_levels);
      }
      ranges[p] = {displs[p], bytes, chunks};
      sums[p] = {cuda::crc_start(bytes), 0, bytes};
      chunks += cuda::crc_chunks(bytes);
    }
    return chunks;
  }

  std::size_t W_;
  std::vector<std::uint64_t> host_;     // kept until the upload has run (done)
  cuda::DeviceBuffer<std::uint64_t> device_;
  cuda::DeviceBuffer<cuda::SegmentCrc> sums_in_;  // the senders' sums, written by the exchange
  std::uint64_t send_chunks_ = 0, recv_chunks_ = 0;
  cuda::Event done_;
  bool claimed_ = false;  // between the exchange's claim and its release
};

}  // namespace detail::checksum

template <class Inner>
  requires(Inner::memory_space == MemorySpace::device)
class DeviceChecksummedTransport {
 public:
  static constexpr MemorySpace memory_space = MemorySpace::device;
  using data_path = typename Inner::data_path;  ///< the inner transport's (the dispatchers use it)

  /// Uploads the CRC tables on the inner transport's stream.
  explicit DeviceChecksummedTransport(Inner& inner, ChecksumOptions options = {})
      : inner_(inner), options_(options), tables_(cuda::crc_table_words), verdicts_(static_cast<std::size_t>(inner.world_size()) + 1) {
    tables_.upload(std::span<const std::uint32_t>(cuda::crc_tables()), stream());
    CPDISPATCH_CUDA_CHECK(cudaMemsetAsync(verdicts_.data(), 0, verdicts_.size_bytes(), stream()));
  }
  DeviceChecksummedTransport(const DeviceChecksummedTransport&) = delete;
  DeviceChecksummedTransport& operator=(const DeviceChecksummedTransport&) = delete;

  Inner& inner() noexcept { return inner_; }
  int rank() const { return inner_.rank(); }
  int world_size() const { return inner_.world_size(); }
  cudaStream_t stream() const { return inner_.stream(); }
  cudaStream_t comm_stream() const
    requires requires(const Inner& t) { t.comm_stream(); }
  {
    return inner_.comm_stream();
  }

  /// Waits for the stream and throws corruption_error when a segment
  /// received since the last check was bad (with agreement: on any rank);
  /// returns the segments from other ranks this rank checked since then.
  std::uint64_t check() {
    const auto W = static_cast<std::size_t>(world_size());
    const bool agree = options_.agree && W > 1;
    if constexpr (detail::transport_has_all_gather<Inner>) {
      if (agree) inner_.all_gather(mine(), verdicts_.data(), sizeof(Verdict), ElementType::uint8);
    }
    std::vector<Verdict> host(W + 1);
    CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(host.data(), verdicts_.data(), verdicts_.size_bytes(), cudaMemcpyDeviceToHost, stream()));
    CPDISPATCH_CUDA_CHECK(cudaMemsetAsync(mine(), 0, sizeof(Verdict), stream()));
    CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(stream()));
    const Verdict& own = host[W];
    if (own.bad) {
      const std::string where = detail::concat("rank ", rank(), " of ", W, ": the segment from rank ", own.source, " in exchange #", own.exchange, " (",
                                               own.got_bytes, " bytes at byte ", own.offset, " of the receive buffer)");
      throw detail::checksum::mismatch(where, own.source, rank(), own.got_crc, own.got_bytes, own.sent_crc, own.sent_bytes);
    }
    if (agree && detail::transport_has_all_gather<Inner>) {
      for (std::size_t d = 0; d < W; ++d) {
        if (host[d].bad && d != self()) throw detail::checksum::reported(rank(), world_size(), host[d].exchange, static_cast<int>(d), host[d].source);
      }
    }
    return own.checked;
  }

  /// The exchanges so far whose sent bytes were checksummed by their pack (pack_sums), not by a pass of their own.
  std::uint64_t summed_by_packs() const noexcept { return summed_by_packs_; }

  void all_to_all_v(const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs, void* recv,
                    std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs)
    requires detail::transport_has_all_to_all_v<Inner>
  {
    if (world_size() == 1) return inner_.all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs);
    Sums& sums = sent_sums(send, send_counts, send_displs, recv_counts, recv_displs);
    const std::uint64_t exchange = ++exchanges_;
    inner_.all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs);
    inner_.all_to_all_v(sums.sums_out(), sum_counts_, sum_displs_, sums.sums_in(), sum_counts_, sum_displs_);
    finish(sums, recv, exchange);
  }

  /// Posts the exchange and, right behind it, its checksums; wait() checks on the stream.
  Request post_all_to_all_v(const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
                            void* recv, std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs)
    requires detail::transport_has_posted_all_to_all<Inner>
  {
    if (world_size() == 1) return inner_.post_all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs);
    Sums& sums = sent_sums(send, send_counts, send_displs, recv_counts, recv_displs);
    const Request data = inner_.post_all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs);
    const Request carried = inner_.post_all_to_all_v(sums.sums_out(), sum_counts_, sum_displs_, sums.sums_in(), sum_counts_, sum_displs_);
    posted_.push_back({data.id, carried, recv, ++exchanges_, &sums});
    return data;
  }

  /// The sums of an exchange whose send buffer a pack is about to write
  /// (the exchange engine's, detail::pack_sums): the pack XORs the checksums
  /// of what it writes into them on the way (cuda::launch_copy_crc), and the
  /// next all_to_all_v or post_all_to_all_v of the same buffer and counts
  /// takes them instead of reading what it sends once more. nullptr where
  /// the pack cannot serve (one rank; segments out of offset order).
  const cuda::CrcTarget* pack_sums(const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
                                   std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    drop_packed();
    if (world_size() == 1 || !in_order(send_counts, send_displs)) return nullptr;
    packed_.sums = &take(send_counts, send_displs, recv_counts, recv_displs);
    packed_.send = send;
    for (auto [to, from] : {std::pair{&packed_.send_counts, send_counts}, std::pair{&packed_.send_displs, send_displs},
                            std::pair{&packed_.recv_counts, recv_counts}, std::pair{&packed_.recv_displs, recv_displs}}) {
      to->assign(from.begin(), from.end());
    }
    packed_.target = packed_.sums->sent_target(tables_.data());
    return &packed_.target;
  }

  /// A posted exchange's wait also waits for its checksums and checks, on the stream.
  void wait(Request request)
    requires detail::transport_has_wait<Inner>
  {
    for (auto it = posted_.begin(); it != posted_.end(); ++it) {
      if (it->id != request.id) continue;
      const Posted p = *it;
      posted_.erase(it);
      inner_.wait(request);
      inner_.wait(p.sums_request);
      return finish(*p.sums, p.recv, p.exchange);
    }
    inner_.wait(request);
  }

  Request isend(const void* buf, std::size_t bytes, int peer, int tag)
    requires detail::transport_has_isend_irecv<Inner>
  {
    return inner_.isend(buf, bytes, peer, tag);
  }
  Request irecv(void* buf, std::size_t bytes, int peer, int tag)
    requires detail::transport_has_isend_irecv<Inner>
  {
    return inner_.irecv(buf, bytes, peer, tag);
  }
  void barrier()
    requires detail::transport_has_barrier<Inner>
  {
    inner_.barrier();
  }
  void broadcast(void* buf, std::size_t bytes, int root)
    requires detail::transport_has_broadcast<Inner>
  {
    inner_.broadcast(buf, bytes, root);
  }
  void all_reduce(void* buf, std::size_t count, ElementType type, ReduceOp op)
    requires detail::transport_has_all_reduce<Inner>
  {
    inner_.all_reduce(buf, count, type, op);
  }
  void all_gather(const void* send, void* recv, std::size_t count_per_rank, ElementType type)
    requires detail::transport_has_all_gather<Inner>
  {
    inner_.all_gather(send, recv, count_per_rank, type);
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count_per_rank, ElementType type, ReduceOp op)
    requires detail::transport_has_reduce_scatter<Inner>
  {
    inner_.reduce_scatter(send, recv, count_per_rank, type, op);
  }

 private:
  using Verdict = detail::checksum::DeviceVerdict;
  using Sums = detail::checksum::DeviceExchangeSums;

  struct Posted {
    std::uint64_t id;
    Request sums_request;
    void* recv;
    std::uint64_t exchange;
    Sums* sums;
  };

  std::size_t self() const { return static_cast<std::size_t>(rank()); }
  /// This rank's record: after the all-gather's W slots.
  Verdict* mine() const { return verdicts_.data() + world_size(); }

  /// A free set of sums (one whose last exchange is checked and whose upload ran), prepared for this exchange and claimed.
  Sums& take(std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs, std::span<const std::size_t> recv_counts,
             std::span<const std::size_t> recv_displs) {
    const auto W = static_cast<std::size_t>(world_size());
    if (send_counts.size() != W || send_displs.size() != W || recv_counts.size() != W || recv_displs.size() != W) {
      detail::fail("DeviceChecksummedTransport: rank ", rank(), " of ", W, ": the counts and displacements must have world_size entries each");
    }
    if (sum_counts_.size() != W) {
      sum_counts_.assign(W, sizeof(cuda::SegmentCrc));
      sum_displs_.resize(W);
      for (std::size_t p = 0; p < W; ++p) sum_displs_[p] = p * sizeof(cuda::SegmentCrc);
    }
    Sums* sums = nullptr;
    for (std::size_t i = 0; i < pool_.size() && !sums; ++i)
      if (pool_[i]->free()) sums = pool_[i].get();
    if (!sums) sums = pool_.emplace_back(std::make_unique<Sums>(W)).get();
    sums->prepare(send_counts, send_displs, recv_counts, recv_displs, self(), stream());
    sums->claim();
    return *sums;
  }

  /// The sums of what this exchange sends: the pack's (pack_sums) where it
  /// wrote this buffer with these counts, else computed here on the stream.
  Sums& sent_sums(const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
                  std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    const auto same = [](const std::vector<std::size_t>& a, std::span<const std::size_t> b) { return std::ranges::equal(a, b); };
    if (packed_.sums && packed_.send == send && same(packed_.send_counts, send_counts) && same(packed_.send_displs, send_displs) &&
        same(packed_.recv_counts, recv_counts) && same(packed_.recv_displs, recv_displs)) {
      ++summed_by_packs_;
      return *std::exchange(packed_.sums, nullptr);
    }
    drop_packed();
    Sums& sums = take(send_counts, send_displs, recv_counts, recv_displs);
    sums.sum_sent(send, tables_.data(), stream());
    return sums;
  }

  /// Sums a pack prepared for an exchange that did not follow: free again.
  void drop_packed() {
    if (Sums* sums = std::exchange(packed_.sums, nullptr)) sums->release(stream());
  }

  /// Whether the segments sent lie by offset, none overlapping the next (the pack's sums look them up so).
  bool in_order(std::span<const std::size_t> counts, std::span<const std::size_t> displs) const {
    for (std::size_t p = 1; p < displs.size(); ++p) {
      const std::size_t end = displs[p - 1] + (p - 1 == self() ? 0 : counts[p - 1]);
      if (displs[p] < displs[p - 1] || displs[p] < end) return false;
    }
    return true;
  }

  /// The received segments checked on the stream; the sums free again once that has run.
  void finish(Sums& sums, const void* recv, std::uint64_t exchange) {
    sums.check_received(recv, tables_.data(), self(), exchange, mine(), stream());
    sums.release(stream());
  }

  Inner& inner_;
  ChecksumOptions options_;
  cuda::DeviceBuffer<std::uint32_t> tables_;
  cuda::DeviceBuffer<Verdict> verdicts_;  // [W]: the all-gathered records; [W]: this rank's
  std::vector<std::unique_ptr<Sums>> pool_;
  std::vector<Posted> posted_;
  struct Packed {  // the sums a pack computed for the next exchange (pack_sums)
    Sums* sums = nullptr;
    const void* send = nullptr;
    std::vector<std::size_t> send_counts, send_displs, recv_counts, recv_displs;
    cuda::CrcTarget target;
  } packed_;
  std::vector<std::size_t> sum_counts_, sum_displs_;
  std::uint64_t exchanges_ = 0, summed_by_packs_ = 0;
};

}  // namespace cpdispatch
