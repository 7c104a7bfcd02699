#pragma once
// The per-rank program, written once over the Transport concept: each rank
// plans, dispatches its queries and key-values forward and back, and checks
// what it got. per_rank_sim.cpp runs it on the in-process sim transport (N
// threads); an MPI build needs only a main that makes an MpiTransport and
// calls run_rank (one process per rank, e.g. `mpiexec -n 4`):
//
//   MPI_Init(&argc, &argv);
//   cpdispatch_example::Options opt;
//   if (!cpdispatch_example::parse_options(argc, argv, opt)) ...;
//   std::int64_t bad;
//   { cpdispatch::MpiTransport t(MPI_COMM_WORLD); bad = cpdispatch_example::run_rank(t, opt); }
//   MPI_Finalize();
//   return bad == 0 ? 0 : 1;
//
//   1. plan: every rank computes the same plan from the same seed
//      (create_qkv_dispatch + plan_qkv: no communication needed), and builds
//      a Dispatcher for Q (q_fwd + q_rev) and one for KV (kv_fwd + kv_rev);
//   2. Q forward: each query token in the attention layout must be the token
//      its source holds at the position the reverse metadata names;
//      Q reverse: the round trip must give back the MLP layout exactly;
//   3. KV forward: every copy of every KV shard must arrive intact;
//   4. KV backward: an attention gradient of 1 everywhere, reverse_combine'd,
//      must give each shard's number of copies;
//   5. the ranks sum their mismatch counts (all_reduce), so every rank
//      returns the same verdict.

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cpdispatch/cpdispatch.hpp"
#include "cpdispatch/execute/dispatcher.hpp"

namespace cpdispatch_example {

struct Options {
  int world_size = 4;          // sim only: MPI takes it from mpiexec
  std::int64_t tokens = 2048;  // per rank
  std::int64_t docs = 6;       // per rank
  std::int64_t max_cp = 0;     // 0: min(4, the largest power of two <= world size)
  std::int64_t hidden = 32;    // 4-byte elements per token
  std::uint64_t seed = 7;
};

constexpr const char* usage =
    "options: [--world-size N (sim)] [--tokens N per rank] [--docs N per rank] [--max-cp N] [--hidden N] [--seed N]";

/// Parses `--name value` pairs; returns false (after printing why) on bad input.
inline bool parse_options(int argc, char** argv, Options& opt) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view name = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s needs a value\n%s\n", argv[i], usage);
      return false;
    }
    const std::string_view text = argv[++i];
    std::int64_t v = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc() || end != text.data() + text.size() || v < 0) {
      std::fprintf(stderr, "%s: '%s' is not a non-negative integer\n", argv[i - 1], argv[i]);
      return false;
    }
    if (name == "--world-size") opt.world_size = static_cast<int>(v);
    else if (name == "--tokens") opt.tokens = v;
    else if (name == "--docs") opt.docs = v;
    else if (name == "--max-cp") opt.max_cp = v;
    else if (name == "--hidden") opt.hidden = v;
    else if (name == "--seed") opt.seed = static_cast<std::uint64_t>(v);
    else {
      std::fprintf(stderr, "unknown option %s\n%s\n", argv[i - 1], usage);
      return false;
    }
  }
  return true;
}

/// Element e of token t of rank s: distinct enough to catch any misplaced token.
inline std::uint32_t payload(std::int64_t s, std::int64_t t, std::int64_t e) {
  std::uint64_t x = (static_cast<std::uint64_t>(s) << 40) ^ (static_cast<std::uint64_t>(t) << 12) ^ static_cast<std::uint64_t>(e);
  x *= 0x9E3779B97F4A7C15ull;
  return static_cast<std::uint32_t>(x >> 32);
}

/// Checks `buf` (attention layout) against the reverse slice `rev`: entry m
/// came from rank rev.dst_rank[m], from position rev.dst_offset[m] mod T_s of
/// its MLP layout. Returns the number of wrong tokens.
inline std::size_t check_arrivals(const cpdispatch::RankMetadata& rev, const cpdispatch::Metadata& fwd,
                                  std::span<const std::uint32_t> buf, std::int64_t hidden) {
  std::size_t bad = 0;
  std::int64_t at = 0;
  for (std::size_t m = 0; m < rev.seq_len.size(); ++m) {
    const std::int64_t s = rev.dst_rank[m];
    const std::int64_t source_tokens = fwd.send_tokens(s);
    const std::int64_t from = source_tokens ? rev.dst_offset[m] % source_tokens : 0;
    for (std::int64_t i = 0; i < rev.seq_len[m]; ++i, ++at) {
      for (std::int64_t e = 0; e < hidden; ++e) {
        if (buf[static_cast<std::size_t>(at * hidden + e)] != payload(s, from + i, e)) {
          ++bad;
          break;
        }
      }
    }
  }
  return bad;
}

/// The per-rank program. Returns the number of mismatches over ALL ranks
/// (0: every check passed), the same on every rank.
template <class AnyTransport>
std::int64_t run_rank(AnyTransport& transport, const Options& opt, std::FILE* log = stdout) {
  CPDISPATCH_CHECK_TRANSPORT(AnyTransport);
  using namespace cpdispatch;
  const int W = transport.world_size();
  const int r = transport.rank();
  std::int64_t cp = opt.max_cp;
  if (cp == 0) {
    cp = 1;
    while (cp * 2 <= W && cp < 4) cp *= 2;
  }
  // 1. The plan: the same on every rank.
  const QkvMetadata qkv = plan_qkv(create_qkv_dispatch(W, opt.tokens, opt.docs, cp, opt.seed));
  const std::int64_t H = opt.hidden;
  const std::size_t token_bytes = static_cast<std::size_t>(H) * sizeof(std::uint32_t);
  Dispatcher q(transport, qkv.q_fwd, qkv.q_rev, token_bytes);
  Dispatcher kv(transport, qkv.kv_fwd, qkv.kv_rev, token_bytes);
  const RankMetadata q_rev = qkv.q_rev.get_slice(r), kv_rev = qkv.kv_rev.get_slice(r), kv_fwd = qkv.kv_fwd.get_slice(r);

  // This rank's MLP layout (queries and key-values alike, for the check).
  const std::int64_t T = qkv.q_fwd.send_tokens(r);
  std::vector<std::uint32_t> mlp(static_cast<std::size_t>(T * H));
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t e = 0; e < H; ++e) mlp[static_cast<std::size_t>(t * H + e)] = payload(r, t, e);
  auto words = [](std::size_t bytes) { return std::vector<std::uint32_t>(bytes / sizeof(std::uint32_t)); };
  std::int64_t bad = 0;

  // 2. Queries: forward, check, back, check.
  std::vector<std::uint32_t> q_attn = words(q.required_bytes().attention_bytes), q_back = words(q.required_bytes().replica_bytes);
  q.forward(std::as_bytes(std::span(mlp)), std::as_writable_bytes(std::span(q_attn)));
  bad += static_cast<std::int64_t>(check_arrivals(q_rev, qkv.q_fwd, q_attn, H));
  q.reverse(std::as_bytes(std::span(q_attn)), std::as_writable_bytes(std::span(q_back)));
  if (q_back != mlp) ++bad;

  // 3. Key-values: every copy.
  std::vector<std::uint32_t> kv_attn = words(kv.required_bytes().attention_bytes);
  kv.forward(std::as_bytes(std::span(mlp)), std::as_writable_bytes(std::span(kv_attn)));
  bad += static_cast<std::int64_t>(check_arrivals(kv_rev, qkv.kv_fwd, kv_attn, H));

  // 4. KV backward: gradient 1 on every copy -> each shard gets its copy count.
  std::vector<float> dkv_attn(kv_attn.size(), 1.0f), dkv_replica(kv.required_bytes().replica_bytes / sizeof(float)),
      dkv(kv.required_bytes().mlp_bytes / sizeof(float));
  kv.reverse_combine(std::as_bytes(std::span(dkv_attn)), std::as_writable_bytes(std::span(dkv_replica)),
                     std::as_writable_bytes(std::span(dkv)), ElementType::float32);
  std::size_t at = 0;
  for (std::size_t g = 0; g < kv_fwd.seq_len.size(); ++g) {
    float copies = 0;
    for (std::size_t c = 0; c < kv_fwd.num_copies; ++c) copies += kv_fwd.dst_rank[g * kv_fwd.num_copies + c] >= 0 ? 1.0f : 0.0f;
    for (std::int64_t i = 0; i < kv_fwd.seq_len[g] * H; ++i, ++at)
      if (dkv[at] != copies) { ++bad; break; }
  }

  // 5. One verdict for all.
  const std::int64_t mine = bad;
  transport.all_reduce(&bad, 1, ElementType::int64, ReduceOp::sum);
  if (log) {
    std::fprintf(log, "rank %d/%d: %lld MLP tokens, %lld query and %lld KV tokens in attention, staging %zu + %zu bytes: %s\n", r, W,
                 static_cast<long long>(T), static_cast<long long>(q_attn.size() / static_cast<std::size_t>(H)),
                 static_cast<long long>(kv_attn.size() / static_cast<std::size_t>(H)), q.required_bytes().staging_bytes,
                 kv.required_bytes().staging_bytes, mine == 0 ? "ok" : "MISMATCH");
  }
  return bad;
}

}  // namespace cpdispatch_example
