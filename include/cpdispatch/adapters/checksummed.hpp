#pragma once
// ChecksummedTransport<Inner>: every all-to-all segment another rank sends is
// checked on receipt against its sender's CRC32C (cpdispatch/crc32c.hpp), so
// a corrupted or short delivery is an error naming the source rank and the
// segment instead of wrong numbers downstream.
//
//   cpdispatch::MpiTransport mpi(comm);
//   cpdispatch::ChecksummedTransport checked(mpi);
//   cpdispatch::Dispatcher d(checked, fwd, rev, token_bytes);   // or KvWireDispatcher, the attention op, ...
//   d.forward(mlp, attn);   // throws corruption_error on the rank whose received segment does not match
//
// An adapter rather than a switch inside the dispatchers: every consumer of
// all_to_all_v, all_to_all_pieces and post_all_to_all_v is covered without a
// change to it, and a job that does not ask pays nothing.
//
// How: before the exchange each rank computes the CRC32C of what it sends
// each other rank (the bytes of all_to_all_v's segment, or the concatenation
// of all_to_all_pieces' pieces for that peer); after it, one small
// all_to_all_v carries those (checksum, byte count) pairs, 16 bytes per peer,
// and each rank checks every segment it received from another rank. A
// receiver whose byte count differs from the sender's, or whose bytes give a
// different checksum, throws corruption_error. A rank's segment to itself
// never leaves the process and is not checked. A posted exchange
// (post_all_to_all_v) posts its checksums right behind it and is checked in
// its wait().
//
// Costs: one pass of CRC32C over what a rank sends and one over what it
// receives (the crc32 instruction, about 10 GB/s a core where SSE4.2 is
// there), plus one all-to-all of 16 bytes per peer. Host memory only (a
// device transport would need the checksum as a kernel on its stream).
//
// Point-to-point messages (isend/irecv, e.g. the comm-GEMM overlap's ring)
// are checked too: each isend is followed, on the same tag, by a 16-byte
// message with its (checksum, byte count), and the wait() of an irecv checks
// the bytes it received against it (only the receiving rank throws; both
// ends must use a ChecksummedTransport). all_gather and broadcast are
// checked like an all-to-all (each block, or the root's bytes, against its
// sender's CRC32C, sent by one more small collective of the same kind);
// all_reduce and reduce_scatter are forwarded unchecked: a reduction's
// result is no sender's bytes, so a checksum of what was sent cannot vouch
// for it.
//
// Every rank agrees on the outcome (ChecksumOptions::agree, on by default):
// after checking, the blocking exchanges (all_to_all_v, all_to_all_pieces)
// run one more all-to-all of 16 bytes per peer carrying each rank's verdict,
// so a bad segment raises corruption_error on EVERY rank, naming the rank
// that received it and the rank that sent it. That collective is safe
// because the exchange itself completed everywhere. Without it, and always
// for posted exchanges (whose waits may come in any order, so a collective
// inside wait() could pair up wrongly), only the receiving rank throws and
// the others complete (their own data is right).

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cpdispatch/crc32c.hpp"
#include "cpdispatch/element_type.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch {

/// A received segment did not match what its sender sent: its checksum or
/// its byte count differ. Names the receiving and the source rank, the
/// exchange and the segment.
class corruption_error : public error {
 public:
  corruption_error(const std::string& what, int source_rank, int receiving_rank)
      : error(what), source_rank_(source_rank), receiving_rank_(receiving_rank) {}
  /// The rank that sent the bad segment.
  int source_rank() const noexcept { return source_rank_; }
  /// The rank that received it (and found it bad).
  int receiving_rank() const noexcept { return receiving_rank_; }

 private:
  int source_rank_, receiving_rank_;
};

struct ChecksumOptions {
  /// After a blocking exchange, every rank learns every other rank's verdict
  /// (one all-to-all of 16 bytes per peer), so a bad segment is an error on
  /// every rank; off: only on the rank that received it.
  bool agree = true;
};

namespace detail::checksum {

/// One rank's verdict on an exchange, as it tells every other rank.
struct Verdict {
  std::int32_t bad = 0;     // 1: a segment this rank received was bad
  std::int32_t source = -1;  // from which rank
  std::uint64_t exchange = 0;
};
static_assert(sizeof(Verdict) == 16);

/// What a sender tells each receiver about its segment.
struct SegmentSum {
  std::uint32_t crc = 0;
  std::uint32_t reserved = 0;
  std::uint64_t bytes = 0;
};
static_assert(sizeof(SegmentSum) == 16);

/// CRC32C of the pieces [begin, end) of `base`, in order, and their bytes.
inline SegmentSum pieces_sum(const void* base, std::span<const BytePiece> pieces, std::size_t begin, std::size_t end) {
  SegmentSum s;
  for (std::size_t i = begin; i < end; ++i) {
    s.crc = crc32c(static_cast<const std::byte*>(base) + pieces[i].offset, pieces[i].bytes, s.crc);
    s.bytes += pieces[i].bytes;
  }
  return s;
}

/// "0x1f2e0c55".
inline std::string hex(std::uint32_t v) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string s = "0x00000000";
  for (int i = 0; i < 8; ++i) s[static_cast<std::size_t>(9 - i)] = digits[(v >> (4 * i)) & 0xFu];
  return s;
}

/// The error of a received segment (`where`: "rank 0 of 4: the segment
/// from rank 3 in exchange #1 (...)") whose byte count or CRC32C differ
/// from what its sender sent.
inline corruption_error mismatch(const std::string& where, int source, int receiving, std::uint32_t got_crc, std::uint64_t got_bytes,
                                 std::uint32_t sent_crc, std::uint64_t sent_bytes) {
  if (got_bytes != sent_bytes) {
    return corruption_error(detail::concat(where, " was expected to hold ", got_bytes, " bytes, but rank ", source, " sent ", sent_bytes,
                                           " (short or long delivery)"),
                            source, receiving);
  }
  return corruption_error(
      detail::concat(where, " fails its CRC32C check: rank ", source, " sent ", hex(sent_crc), ", received ", hex(got_crc), " (corrupted or short delivery)"),
      source, receiving);
}

/// The error on `rank` when rank `reporter` found the segment from `source` bad.
inline corruption_error reported(int rank, int world_size, std::uint64_t exchange, int reporter, int source) {
  return corruption_error(detail::concat("rank ", rank, " of ", world_size, ": exchange #", exchange, " failed on rank ", reporter,
                                         ": the segment it received from rank ", source, " is corrupted or short (reported by rank ", reporter, ")"),
                          source, reporter);
}

}  // namespace detail::checksum

template <class Inner>
  requires(Inner::memory_space == MemorySpace::host)
class ChecksummedTransport {
 public:
  static constexpr MemorySpace memory_space = Inner::memory_space;

  explicit ChecksummedTransport(Inner& inner, ChecksumOptions options = {}) : inner_(inner), options_(options) {}
  ChecksummedTransport(const ChecksummedTransport&) = delete;
  ChecksummedTransport& operator=(const ChecksummedTransport&) = delete;

  Inner& inner() noexcept { return inner_; }
  int rank() const { return inner_.rank(); }
  int world_size() const { return inner_.world_size(); }
  /// Segments from other ranks checked so far (all of them matched, or this
  /// transport would have thrown).
  std::uint64_t checked_segments() const noexcept { return checked_; }

  void all_to_all_v(const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
                    void* recv, std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs)
    requires detail::transport_has_all_to_all_v<Inner>
  {
    ++exchanges_;
    sums_out_.assign(send_counts.size(), {});
    for (std::size_t p = 0; p < send_counts.size(); ++p) {
      if (p != self()) sums_out_[p] = {crc32c(at(send, send_displs[p]), send_counts[p]), 0, send_counts[p]};
    }
    inner_.all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs);
    exchange_sums(sums_out_, sums_in_);
    std::optional<corruption_error> bad;
    for (std::size_t p = 0; p < recv_counts.size() && !bad; ++p) {
      if (p == self()) continue;
      const detail::checksum::SegmentSum got{crc32c(at(recv, recv_displs[p]), recv_counts[p]), 0, recv_counts[p]};
      bad = verify(p, got, sums_in_[p], [&] {
        return segment_name(p, exchanges_, detail::concat(recv_counts[p], " bytes at byte ", recv_displs[p], " of the receive buffer"));
      });
    }
    settle(bad);
  }

  void all_to_all_pieces(const void* send, std::span<const BytePiece> send_pieces, std::span<const std::size_t> send_splits,
                         void* recv, std::span<const BytePiece> recv_pieces, std::span<const std::size_t> recv_splits)
    requires detail::transport_has_all_to_all_pieces<Inner> && detail::transport_has_all_to_all_v<Inner>
  {
    ++exchanges_;
    const std::size_t W = send_splits.empty() ? 0 : send_splits.size() - 1;
    sums_out_.assign(W, {});
    for (std::size_t p = 0; p < W; ++p) {
      if (p != self()) sums_out_[p] = detail::checksum::pieces_sum(send, send_pieces, send_splits[p], send_splits[p + 1]);
    }
    inner_.all_to_all_pieces(send, send_pieces, send_splits, recv, recv_pieces, recv_splits);
    exchange_sums(sums_out_, sums_in_);
    std::optional<corruption_error> bad;
    for (std::size_t p = 0; p + 1 < recv_splits.size() && !bad; ++p) {
      if (p == self()) continue;
      const auto got = detail::checksum::pieces_sum(recv, recv_pieces, recv_splits[p], recv_splits[p + 1]);
      bad = verify(p, got, sums_in_[p], [&] {
        return segment_name(p, exchanges_, detail::concat(got.bytes, " bytes in ", recv_splits[p + 1] - recv_splits[p], " pieces"));
      });
    }
    settle(bad);
  }

  /// Posts the exchange and, right behind it, its checksums; wait() checks.
  Request post_all_to_all_v(const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
                            void* recv, std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs)
    requires detail::transport_has_posted_all_to_all<Inner>
  {
    Posted posted;
    posted.exchange = ++exchanges_;
    posted.recv = recv;
    posted.recv_counts.assign(recv_counts.begin(), recv_counts.end());
    posted.recv_displs.assign(recv_displs.begin(), recv_displs.end());
    posted.sums_out.assign(send_counts.size(), {});
    for (std::size_t p = 0; p < send_counts.size(); ++p) {
      if (p != self()) posted.sums_out[p] = {crc32c(at(send, send_displs[p]), send_counts[p]), 0, send_counts[p]};
    }
    posted.sums_in.assign(send_counts.size(), {});
    const Request data = inner_.post_all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs);
    const std::vector<std::size_t> counts(send_counts.size(), sizeof(detail::checksum::SegmentSum)), displs = sum_displs(send_counts.size());
    posted.sums = inner_.post_all_to_all_v(posted.sums_out.data(), counts, displs, posted.sums_in.data(), counts, displs);
    posted_.emplace(data.id, std::move(posted));
    return data;
  }

  /// A posted exchange's wait checks its segments, an irecv's its message.
  void wait(Request request)
    requires detail::transport_has_wait<Inner>
  {
    if (const auto m = messages_.find(request.id); m != messages_.end()) {
      Message message = std::move(m->second);
      messages_.erase(m);
      return finish_message(request, std::move(message));
    }
    const auto it = posted_.find(request.id);
    if (it == posted_.end()) return inner_.wait(request);
    Posted posted = std::move(it->second);
    posted_.erase(it);
    inner_.wait(request);
    inner_.wait(posted.sums);
    for (std::size_t p = 0; p < posted.recv_counts.size(); ++p) {
      if (p == self()) continue;
      const std::size_t n = posted.recv_counts[p], off = posted.recv_displs[p];
      auto bad = verify(p, {crc32c(at(posted.recv, off), n), 0, n}, posted.sums_in[p],
                        [&] { return segment_name(p, posted.exchange, detail::concat(n, " bytes at byte ", off, " of the receive buffer")); });
      if (bad) throw *bad;
    }
  }

  /// Sends the message, then its (checksum, byte count) on the same tag.
  Request isend(const void* buf, std::size_t bytes, int peer, int tag)
    requires detail::transport_has_isend_irecv<Inner>
  {
    Message m{.receive = false, .buf = const_cast<void*>(buf), .bytes = bytes, .peer = peer, .tag = tag,
              .sum = std::make_unique<SegmentSum>(SegmentSum{crc32c(buf, bytes), 0, bytes}), .sum_request = {}};
    const Request data = inner_.isend(buf, bytes, peer, tag);
    m.sum_request = inner_.isend(m.sum.get(), sizeof(SegmentSum), peer, tag);
    messages_.emplace(data.id, std::move(m));
    return data;
  }
  /// Receives the message and its sender's (checksum, byte count); wait() checks them.
  Request irecv(void* buf, std::size_t bytes, int peer, int tag)
    requires detail::transport_has_isend_irecv<Inner>
  {
    Message m{.receive = true, .buf = buf, .bytes = bytes, .peer = peer, .tag = tag, .sum = std::make_unique<SegmentSum>(), .sum_request = {}};
    const Request data = inner_.irecv(buf, bytes, peer, tag);
    m.sum_request = inner_.irecv(m.sum.get(), sizeof(SegmentSum), peer, tag);
    messages_.emplace(data.id, std::move(m));
    return data;
  }
  void barrier()
    requires detail::transport_has_barrier<Inner>
  {
    inner_.barrier();
  }
  /// The root's bytes are checked on every other rank against the CRC32C
  /// the root computed (one more broadcast of 16 bytes).
  void broadcast(void* buf, std::size_t bytes, int root)
    requires detail::transport_has_broadcast<Inner>
  {
    ++exchanges_;
    SegmentSum sent{};
    if (rank() == root) sent = {crc32c(buf, bytes), 0, bytes};
    inner_.broadcast(buf, bytes, root);
    inner_.broadcast(&sent, sizeof(SegmentSum), root);
    std::optional<corruption_error> bad;
    if (rank() != root) {
      bad = verify(static_cast<std::size_t>(root), {crc32c(buf, bytes), 0, bytes}, sent,
                   [&] { return detail::concat("the broadcast from rank ", root, " in exchange #", exchanges_, " (", bytes, " bytes)"); });
    }
    settle(bad);
  }
  /// Forwarded unchecked: a reduction's result is no sender's bytes.
  void all_reduce(void* buf, std::size_t count, ElementType type, ReduceOp op)
    requires detail::transport_has_all_reduce<Inner>
  {
    inner_.all_reduce(buf, count, type, op);
  }
  /// Each rank's block is checked against the CRC32C its sender computed
  /// (one more all-gather of 16 bytes a rank).
  void all_gather(const void* send, void* recv, std::size_t count_per_rank, ElementType type)
    requires detail::transport_has_all_gather<Inner>
  {
    ++exchanges_;
    const std::size_t block = count_per_rank * element_size(type);
    const SegmentSum mine{crc32c(send, block), 0, block};
    inner_.all_gather(send, recv, count_per_rank, type);
    sums_in_.assign(static_cast<std::size_t>(world_size()), {});
    inner_.all_gather(&mine, sums_in_.data(), sizeof(SegmentSum), ElementType::uint8);
    std::optional<corruption_error> bad;
    for (std::size_t p = 0; p < sums_in_.size() && !bad; ++p) {
      if (p == self()) continue;
      bad = verify(p, {crc32c(at(recv, p * block), block), 0, block}, sums_in_[p], [&] {
        return segment_name(p, exchanges_, detail::concat("block ", p, " of the all-gather, ", block, " bytes at byte ", p * block));
      });
    }
    settle(bad);
  }
  /// Forwarded unchecked, as all_reduce.
  void reduce_scatter(const void* send, void* recv, std::size_t count_per_rank, ElementType type, ReduceOp op)
    requires detail::transport_has_reduce_scatter<Inner>
  {
    inner_.reduce_scatter(send, recv, count_per_rank, type, op);
  }

 private:
  using SegmentSum = detail::checksum::SegmentSum;

  /// An isend or irecv until its wait: its buffer, and its checksum message (heap: it may outlive a failed wait).
  struct Message {
    bool receive = false;
    void* buf = nullptr;
    std::size_t bytes = 0;
    int peer = 0;
    int tag = 0;
    std::unique_ptr<SegmentSum> sum;
    Request sum_request;
  };

  /// Completes a message and its checksum message; an irecv's bytes are checked.
  void finish_message(Request data, Message m) {
    try {
      inner_.wait(data);
      inner_.wait(m.sum_request);
    } catch (...) {
      keep_until_exit(std::move(m.sum));  // the checksum message may still be pending in the inner transport
      throw;
    }
    if (!m.receive) return;
    const auto source = static_cast<std::size_t>(m.peer);
    auto bad = verify(source, {crc32c(m.buf, m.bytes), 0, m.bytes}, *m.sum, [&] {
      return detail::concat("the message from rank ", m.peer, " (tag ", m.tag, ", ", m.bytes, " bytes)");
    });
    if (bad) throw *bad;
  }

  /// Storage a failed wait leaves to the inner transport, freed at exit
  /// (reachable until then), so that a late delivery lands in live memory.
  static void keep_until_exit(std::unique_ptr<SegmentSum> sum) {
    static std::mutex guard;
    static std::vector<std::unique_ptr<SegmentSum>> kept;
    const std::lock_guard lock(guard);
    kept.push_back(std::move(sum));
  }

  /// "the segment from rank 2 in exchange #1 (<where in the buffer>)".
  static std::string segment_name(std::size_t source, std::uint64_t exchange, const std::string& where) {
    return detail::concat("the segment from rank ", source, " in exchange #", exchange, " (", where, ")");
  }

  /// A posted exchange until its wait: where its segments land and the checksums in flight.
  struct Posted {
    std::uint64_t exchange = 0;
    void* recv = nullptr;
    std::vector<std::size_t> recv_counts, recv_displs;
    std::vector<SegmentSum> sums_out, sums_in;
    Request sums;
  };

  std::size_t self() const { return static_cast<std::size_t>(inner_.rank()); }

  static const std::byte* at(const void* base, std::size_t offset) { return static_cast<const std::byte*>(base) + offset; }

  static std::vector<std::size_t> sum_displs(std::size_t W) {
    std::vector<std::size_t> displs(W);
    for (std::size_t p = 0; p < W; ++p) displs[p] = p * sizeof(SegmentSum);
    return displs;
  }

  /// The (checksum, bytes) pairs: this rank's to each peer out, each peer's to this rank in.
  void exchange_sums(const std::vector<SegmentSum>& out, std::vector<SegmentSum>& in) {
    const std::size_t W = static_cast<std::size_t>(inner_.world_size());
    sum_counts_.assign(W, sizeof(SegmentSum));
    sum_displs_ = sum_displs(W);
    in.assign(W, {});
    inner_.all_to_all_v(out.data(), sum_counts_, sum_displs_, in.data(), sum_counts_, sum_displs_);
  }

  /// The error when what came from `source` (`unit()`: "the segment from
  /// rank 2 in exchange #1 (...)") differs from what it sent.
  template <class Describe>
  std::optional<corruption_error> verify(std::size_t source, const SegmentSum& got, const SegmentSum& sent, Describe&& unit) {
    if (got.bytes == sent.bytes && got.crc == sent.crc) {
      ++checked_;
      return std::nullopt;
    }
    const std::string where = detail::concat("rank ", rank(), " of ", world_size(), ": ", unit());
    return detail::checksum::mismatch(where, static_cast<int>(source), rank(), got.crc, got.bytes, sent.crc, sent.bytes);
  }

  /// Throws this rank's error, or with agreement the first bad verdict of
  /// any rank, so that every rank raises the same fault.
  void settle(const std::optional<corruption_error>& bad) {
    if (!options_.agree || world_size() == 1) {
      if (bad) throw *bad;
      return;
    }
    const auto W = static_cast<std::size_t>(world_size());
    const detail::checksum::Verdict mine{bad ? 1 : 0, bad ? bad->source_rank() : -1, exchanges_};
    share_verdicts(mine);
    if (bad) throw *bad;
    for (std::size_t d = 0; d < W; ++d) {
      const detail::checksum::Verdict& v = verdicts_in_[d];
      if (d == self() || !v.bad) continue;
      throw detail::checksum::reported(rank(), world_size(), exchanges_, static_cast<int>(d), v.source);
    }
  }

  /// Every rank's verdict into verdicts_in_: one all-to-all of 16 bytes per
  /// peer, or an all-gather where the inner transport has only collectives.
  void share_verdicts(const detail::checksum::Verdict& mine) {
    const auto W = static_cast<std::size_t>(world_size());
    verdicts_in_.assign(W, {});
    if constexpr (detail::transport_has_all_to_all_v<Inner>) {
      verdicts_out_.assign(W, mine);
      sum_counts_.assign(W, sizeof(detail::checksum::Verdict));
      sum_displs_ = sum_displs(W);
      inner_.all_to_all_v(verdicts_out_.data(), sum_counts_, sum_displs_, verdicts_in_.data(), sum_counts_, sum_displs_);
    } else {
      inner_.all_gather(&mine, verdicts_in_.data(), sizeof(detail::checksum::Verdict), ElementType::uint8);
    }
  }

  Inner& inner_;
  ChecksumOptions options_;
  std::uint64_t exchanges_ = 0, checked_ = 0;
  std::vector<detail::checksum::Verdict> verdicts_out_, verdicts_in_;
  std::vector<SegmentSum> sums_out_, sums_in_;
  std::vector<std::size_t> sum_counts_, sum_displs_;
  std::map<std::uint64_t, Posted> posted_;
  std::map<std::uint64_t, Message> messages_;  // isend/irecv by their data request's id
};

}  // namespace cpdispatch
