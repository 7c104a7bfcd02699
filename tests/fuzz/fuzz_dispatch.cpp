// Structured fuzz target: metadata built from the input bytes, either from
// scratch (random shapes and values) or planned from random documents and
// then perturbed, is fed to simulate() and, rank by rank, to the
// Dispatcher's constructor and calls (forward, reverse, reverse_combine)
// over a transport that reads and writes every byte range it is handed.
// A bad slice must become invalid_input; out-of-bounds access, overflow or
// any other exception is a finding (AddressSanitizer and UBSan watch). The
// planned layout must pass verify_coverage, and the perturbed one must pass
// it or be invalid_input.

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <vector>

#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/execute/simulate.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "fuzz_coverage.hpp"
#include "fuzz_target.hpp"

namespace {

using cpdispatch::Metadata;
using cpdispatch::Tensor;

/// Reads the input as a stream of choices; zeros once it runs out.
class Choices {
 public:
  Choices(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}

  std::uint8_t byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  /// In [0, n).
  std::size_t below(std::size_t n) { return n ? byte() % n : 0; }
  /// Mostly small counts, sometimes the edges that break arithmetic.
  std::int64_t value() {
    static constexpr std::array<std::int64_t, 10> edges = {-1, -2, 1 << 20, std::numeric_limits<std::int32_t>::max(),
                                                           std::int64_t{1} << 40, std::numeric_limits<std::int64_t>::max(),
                                                           std::numeric_limits<std::int64_t>::max() / 2 + 1,
                                                           std::numeric_limits<std::int64_t>::min(), 64, 255};
    const std::uint8_t b = byte();
    return b < 240 ? static_cast<std::int64_t>(b % 12) : edges[b % edges.size()];
  }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

/// A one-rank view of a world that touches every byte it is asked to move:
/// reads each send range, writes each receive range. Nothing is exchanged.
struct TouchingTransport {
  static constexpr cpdispatch::MemorySpace memory_space = cpdispatch::MemorySpace::host;
  int rank_ = 0, world_ = 1;
  int rank() const { return rank_; }
  int world_size() const { return world_; }
  void all_to_all_v(const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
                    void* recv, std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    volatile unsigned sink = 0;
    for (std::size_t p = 0; p < send_counts.size(); ++p)
      for (std::size_t i = 0; i < send_counts[p]; ++i) sink = sink + static_cast<const unsigned char*>(send)[send_displs[p] + i];
    for (std::size_t p = 0; p < recv_counts.size(); ++p)
      if (recv_counts[p]) std::memset(static_cast<unsigned char*>(recv) + recv_displs[p], 7, recv_counts[p]);
  }
  // The dispatcher makes one all_to_all_v per call; the rest of the concept is unused here.
  cpdispatch::Request isend(const void*, std::size_t, int, int) { return {}; }
  cpdispatch::Request irecv(void*, std::size_t, int, int) { return {}; }
  void wait(cpdispatch::Request) {}
  void barrier() {}
  void broadcast(void*, std::size_t, int) {}
  void all_reduce(void*, std::size_t, cpdispatch::ElementType, cpdispatch::ReduceOp) {}
  void all_gather(const void*, void*, std::size_t, cpdispatch::ElementType) {}
  void reduce_scatter(const void*, void*, std::size_t, cpdispatch::ElementType, cpdispatch::ReduceOp) {}
};

constexpr std::size_t max_buffer_bytes = 1 << 16;  // larger asks are skipped: one input stays fast

Tensor<std::int64_t> random_tensor(Choices& in, const std::vector<std::size_t>& shape) {
  Tensor<std::int64_t> t(shape);
  for (std::int64_t& v : t.flat()) v = in.value();
  return t;
}

/// Metadata of random shape and values (shapes consistent, values anything).
Metadata random_metadata(Choices& in) {
  Metadata m;
  const std::size_t W = 1 + in.below(4), S = in.below(4), C = 1 + in.below(3);
  const bool copies = in.below(2);
  m.world_size = static_cast<std::int64_t>(W);
  const std::vector<std::size_t> shape = copies ? std::vector<std::size_t>{W, S, C} : std::vector<std::size_t>{W, S};
  m.dst_rank = random_tensor(in, shape);
  m.dst_offset = random_tensor(in, shape);
  m.seq_len = random_tensor(in, {W, S});
  m.num_recv_tokens = random_tensor(in, {W, W + 1});
  m.num_seqs = Tensor<std::int64_t>({W});
  for (std::size_t r = 0; r < W; ++r) m.num_seqs(r) = static_cast<std::int64_t>(in.below(S + 1));
  if (in.below(2)) {
    const std::size_t S2 = in.below(4), C2 = in.below(4);
    m.seq_recv_mask = random_tensor(in, {W, S2, C2});
    m.recv_seq_lens = random_tensor(in, {W, S2});
  }
  for (std::size_t r = 0; r < W; ++r) m.num_total_recv_tokens.push_back(m.num_recv_tokens(r, W));
  return m;
}

/// A random small QKV plan, planned, with a few values of one tensor pair overwritten.
std::optional<std::pair<Metadata, Metadata>> perturbed_plan(Choices& in) {
  cpdispatch::QkvPlan plan;
  plan.world_size = static_cast<std::int64_t>(1 + in.below(4));
  plan.ranks.resize(static_cast<std::size_t>(plan.world_size));
  for (auto& rank : plan.ranks) {
    rank.docs.resize(in.below(4));
    for (auto& doc : rank.docs) {
      const std::size_t shards = 1 + in.below(3);
      for (std::size_t s = 0; s < shards; ++s) {
        doc.shard_len.push_back(static_cast<std::int64_t>(1 + in.below(6)));
        doc.dst.push_back(static_cast<std::int64_t>(in.below(static_cast<std::size_t>(plan.world_size))));
      }
    }
  }
  cpdispatch::QkvMetadata qkv = cpdispatch::plan_qkv(plan);
  cpdispatch_fuzz::expect_coverage(plan, qkv);
  const bool kv = in.below(2) != 0;
  std::pair<Metadata, Metadata> pair = kv ? std::pair{qkv.kv_fwd, qkv.kv_rev} : std::pair{qkv.q_fwd, qkv.q_rev};
  for (std::size_t k = in.below(4); k > 0; --k) {
    Metadata& m = in.below(2) ? pair.first : pair.second;
    std::array<Tensor<std::int64_t>*, 6> fields = {&m.dst_rank, &m.dst_offset, &m.seq_len, &m.num_recv_tokens, &m.num_seqs,
                                                   m.recv_seq_lens ? &*m.recv_seq_lens : &m.seq_len};
    Tensor<std::int64_t>& t = *fields[in.below(fields.size())];
    if (t.numel()) t.flat()[in.below(t.numel())] = in.value();
    for (std::size_t r = 0; r < m.num_total_recv_tokens.size(); ++r) {
      m.num_total_recv_tokens[r] = m.num_recv_tokens(r, static_cast<std::size_t>(m.world_size));
    }
  }
  (kv ? qkv.kv_fwd : qkv.q_fwd) = pair.first;  // the verifier reads only the forward metadata and the layout
  cpdispatch_fuzz::expect_valid_or_invalid_input([&] { cpdispatch::verify_coverage(plan, qkv, cpdispatch_fuzz::limits); });
  return pair;
}

void run_simulate(const Metadata& m, std::size_t token_bytes) {
  std::vector<std::vector<std::byte>> in, out;
  for (std::int64_t r = 0; r < m.world_size; ++r) {
    const std::int64_t send = m.send_tokens(r), recv = m.output_tokens(r);
    const auto limit = static_cast<std::int64_t>(max_buffer_bytes / token_bytes);
    if (send < 0 || recv < 0 || send > limit || recv > limit) return;
    in.emplace_back(static_cast<std::size_t>(send) * token_bytes, std::byte{1});
    out.emplace_back(static_cast<std::size_t>(recv) * token_bytes);
  }
  const std::vector<cpdispatch::ConstBytes> ins(in.begin(), in.end());
  const std::vector<cpdispatch::MutableBytes> outs(out.begin(), out.end());
  cpdispatch::simulate(m, ins, outs, token_bytes);
}

/// A caller might edit a slice by hand: sometimes make it inconsistent.
void perturb_slice(Choices& in, cpdispatch::RankMetadata& s) {
  switch (in.below(8)) {
    case 0: s.num_copies = in.below(4); break;
    case 1: s.mask_copies = in.below(4); break;
    case 2: if (!s.dst_offset.empty()) s.dst_offset.pop_back(); break;
    case 3: s.num_recv_tokens.resize(in.below(6)); break;
    case 4: s.num_seqs = in.value(); break;
    case 5: if (s.seq_recv_mask) s.seq_recv_mask->push_back(1); break;
    default: break;
  }
}

void run_dispatcher(Choices& in, const Metadata& fwd, const Metadata& rev, std::size_t token_bytes) {
  for (std::int64_t r = 0; r < fwd.world_size; ++r) {
    cpdispatch_fuzz::expect_valid_or_invalid_input([&] {
      TouchingTransport t{static_cast<int>(r), static_cast<int>(fwd.world_size)};
      cpdispatch::RankMetadata f = fwd.get_slice(r), b = rev.get_slice(r);
      perturb_slice(in, f);
      perturb_slice(in, b);
      cpdispatch::Dispatcher d(t, std::move(f), std::move(b), token_bytes);
      const cpdispatch::BufferSizes& need = d.required_bytes();
      for (std::size_t n : {need.mlp_bytes, need.attention_bytes, need.replica_bytes, need.staging_bytes})
        if (n > max_buffer_bytes) return;
      std::vector<std::byte> mlp(need.mlp_bytes, std::byte{2}), attn(need.attention_bytes), replica(need.replica_bytes);
      d.forward(mlp, attn);
      d.reverse(attn, replica);
      std::vector<std::byte> grad(need.mlp_bytes);
      d.reverse_combine(attn, replica, grad, token_bytes % 4 == 0 ? cpdispatch::ElementType::float32 : cpdispatch::ElementType::int8);
    });
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Choices in(data, size);
  const std::size_t token_bytes = 1 + in.below(8);
  std::optional<std::pair<Metadata, Metadata>> pair;
  if (in.below(2)) {
    pair = perturbed_plan(in);
  } else {
    Metadata fwd = random_metadata(in);
    Metadata rev = random_metadata(in);
    pair.emplace(std::move(fwd), std::move(rev));
  }
  for (const Metadata* m : {&pair->first, &pair->second}) {
    cpdispatch_fuzz::expect_valid_or_invalid_input([&] { run_simulate(*m, token_bytes); });
  }
  if (pair->first.world_size == pair->second.world_size) run_dispatcher(in, pair->first, pair->second, token_bytes);
  return 0;
}
