// cpdispatch-demo: the whole context-parallel QKV dispatch on the memcpy
// simulation, every byte checked.
//
//   1. plan a batch: each rank holds variable-length documents, each document
//      is cut into 1, 2 or 4 shards (its CP degree) that attend on distinct
//      ranks (create_qkv_dispatch), and plan_qkv computes the metadata;
//   2. forward: queries and key-values from the MLP layout to the attention
//      layout (KV shards replicated to every later query shard of their
//      document, for causal attention);
//   3. reverse: queries back (the round trip must be the identity), and the
//      KV gradients back into [C][T] replica buffers that combine_copies sums;
//   4. checks: every query lands where the attention layout says, every KV
//      group at its attention rank is exactly its document's causal prefix,
//      each KV copy equals its source, the query round trip is the identity,
//      and the combined KV gradient equals source x number of copies;
//   5. prints the per-rank table and the bytes moved per second.
//
// The KV gradient sent back is the forwarded KV itself, so the expected
// combined gradient is the source times its number of copies. KV values are
// small integers, so that sum is exact in bfloat16.
//
// Exit status: 0 when every check passes, 1 when one fails, 2 on bad options.

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "cpdispatch/cpdispatch.hpp"

namespace {

using cpdispatch::bfloat16;
using cpdispatch::Metadata;
using Buffers = std::vector<std::vector<bfloat16>>;  // one per rank: [tokens][hidden]

struct Options {
  std::int64_t world_size = 8;
  std::int64_t tokens = 4096;  // per rank
  std::int64_t docs = 8;       // per rank
  std::int64_t max_cp = 0;     // 0: min(4, the largest power of two <= world size)
  std::int64_t hidden = 256;   // bfloat16 elements per token
  std::uint64_t seed = 42;
  bool help = false;
};

constexpr const char* kUsage = R"(usage: cpdispatch-demo [options]

Plans a batch of variable-length documents over the ranks, runs the forward
and reverse query and key-value exchanges and the KV-gradient combine on the
memcpy simulation, checks every byte and prints a per-rank table.

options (--name value or --name=value):
  -w, --world-size N   ranks (default 8)
  -t, --tokens N       tokens per rank, a multiple of the CP degree (default 4096)
  -d, --docs N         documents per rank (default 8)
  -c, --max-cp N       largest CP degree, a power of two <= world size
                       (default 4, or less when the world is smaller)
  -H, --hidden N       bfloat16 elements per token (default 256: 512-byte tokens)
  -s, --seed N         seed of the plan and the data (default 42)
  -h, --help           this text

exit status: 0 all checks passed, 1 a check failed, 2 bad options
)";

struct UsageError {
  std::string message;
};

template <class Int>
Int parse_int(std::string_view name, std::string_view text) {
  Int value{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc{} || end != text.data() + text.size()) {
    throw UsageError{std::string(name) + " expects an integer, got '" + std::string(text) + "'"};
  }
  return value;
}

Options parse_options(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i], value;
    bool inline_value = false;
    if (const auto eq = arg.find('='); arg.starts_with("--") && eq != std::string_view::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      inline_value = true;
    }
    if (arg == "-h" || arg == "--help") {
      o.help = true;
      continue;
    }
    auto next = [&]() -> std::string_view {
      if (inline_value) return value;
      if (i + 1 >= argc) throw UsageError{std::string(arg) + " needs a value"};
      return argv[++i];
    };
    if (arg == "-w" || arg == "--world-size") o.world_size = parse_int<std::int64_t>("--world-size", next());
    else if (arg == "-t" || arg == "--tokens") o.tokens = parse_int<std::int64_t>("--tokens", next());
    else if (arg == "-d" || arg == "--docs") o.docs = parse_int<std::int64_t>("--docs", next());
    else if (arg == "-c" || arg == "--max-cp") o.max_cp = parse_int<std::int64_t>("--max-cp", next());
    else if (arg == "-H" || arg == "--hidden") o.hidden = parse_int<std::int64_t>("--hidden", next());
    else if (arg == "-s" || arg == "--seed") o.seed = parse_int<std::uint64_t>("--seed", next());
    else throw UsageError{"unknown option '" + std::string(argv[i]) + "' (see --help)"};
  }
  if (o.help) return o;
  auto at_least_one = [](std::string_view name, std::int64_t v) {
    if (v < 1) throw UsageError{std::string(name) + " = " + std::to_string(v) + " must be at least 1"};
  };
  at_least_one("--world-size", o.world_size);
  at_least_one("--tokens", o.tokens);
  at_least_one("--docs", o.docs);
  at_least_one("--hidden", o.hidden);
  if (o.max_cp == 0) {
    o.max_cp = 1;
    while (o.max_cp < 4 && o.max_cp * 2 <= o.world_size) o.max_cp *= 2;
  }
  if (o.max_cp < 1 || (o.max_cp & (o.max_cp - 1)) != 0 || o.max_cp > o.world_size) {
    throw UsageError{"--max-cp = " + std::to_string(o.max_cp) + " must be a power of two in [1, world size = " +
                     std::to_string(o.world_size) + "]"};
  }
  if (o.max_cp > 256) throw UsageError{"--max-cp = " + std::to_string(o.max_cp) + " is above 256 (the checks need exact bfloat16 sums)"};
  if (o.tokens % o.max_cp != 0 || o.tokens / o.max_cp < o.docs) {
    throw UsageError{"--tokens = " + std::to_string(o.tokens) + " must be a multiple of --max-cp = " + std::to_string(o.max_cp) +
                     " and at least --docs x --max-cp = " + std::to_string(o.docs * o.max_cp)};
  }
  return o;
}

// ---- data -------------------------------------------------------------------

std::uint64_t mix(std::uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Query values: anything finite; KV values: integers in [-amplitude, amplitude].
Buffers make_data(const Metadata& fwd, std::size_t hidden, std::uint64_t seed, std::int64_t kv_amplitude) {
  Buffers out(static_cast<std::size_t>(fwd.world_size));
  for (std::size_t r = 0; r < out.size(); ++r) {
    out[r].resize(static_cast<std::size_t>(fwd.send_tokens(static_cast<std::int64_t>(r))) * hidden);
    for (std::size_t i = 0; i < out[r].size(); ++i) {
      const std::uint64_t h = mix(seed ^ mix(r) ^ (i * 0x100000001b3ull));
      const float v = kv_amplitude > 0
                          ? static_cast<float>(static_cast<std::int64_t>(h % static_cast<std::uint64_t>(2 * kv_amplitude + 1)) - kv_amplitude)
                          : static_cast<float>(static_cast<std::int64_t>(h % 2000001) - 1000000) / 4096.0f;
      out[r][i] = bfloat16(v);
    }
  }
  return out;
}

// Per-rank buffers of `tokens(r)` tokens, filled with a NaN pattern so that a
// byte the simulation never wrote cannot pass a check by accident.
template <class Tokens>
Buffers make_outputs(std::size_t world, std::size_t hidden, Tokens tokens) {
  Buffers out(world);
  bfloat16 poison;
  poison.bits = 0x7fc1;
  for (std::size_t r = 0; r < world; ++r) out[r].assign(static_cast<std::size_t>(tokens(r)) * hidden, poison);
  return out;
}

// ---- the simulated exchange, timed --------------------------------------------

struct Exchange {
  const char* name;
  double bytes = 0;
  double seconds = 0;
};

Exchange run(const char* name, const Metadata& meta, const Buffers& in, Buffers& out, std::size_t hidden) {
  std::vector<cpdispatch::ConstBytes> ins;
  std::vector<cpdispatch::MutableBytes> outs;
  for (const auto& b : in) ins.push_back(std::as_bytes(std::span(b)));
  for (auto& b : out) outs.push_back(std::as_writable_bytes(std::span(b)));
  const std::size_t token_bytes = hidden * sizeof(bfloat16);
  const auto t0 = std::chrono::steady_clock::now();
  cpdispatch::simulate(meta, std::span<const cpdispatch::ConstBytes>(ins), std::span<const cpdispatch::MutableBytes>(outs), token_bytes);
  const auto t1 = std::chrono::steady_clock::now();
  std::int64_t tokens = 0;
  for (std::size_t d = 0; d < out.size(); ++d) tokens += meta.num_recv_tokens(d, out.size());
  return {name, static_cast<double>(tokens) * static_cast<double>(token_bytes), std::chrono::duration<double>(t1 - t0).count()};
}

// ---- checks -------------------------------------------------------------------

class Checker {
 public:
  explicit Checker(std::size_t hidden) : hidden_(hidden) {}

  // `tokens` tokens of a at token `a_at` equal those of b at `b_at`, byte for byte.
  void same(const std::vector<bfloat16>& a, std::int64_t a_at, const std::vector<bfloat16>& b, std::int64_t b_at,
            std::int64_t tokens, const std::string& what) {
    ++checks_;
    const std::size_t n = static_cast<std::size_t>(tokens) * hidden_;
    const std::size_t ai = static_cast<std::size_t>(a_at) * hidden_, bi = static_cast<std::size_t>(b_at) * hidden_;
    if (a_at < 0 || b_at < 0 || ai + n > a.size() || bi + n > b.size()) return fail(what + ": region out of range");
    if (std::memcmp(a.data() + ai, b.data() + bi, n * sizeof(bfloat16)) == 0) return;
    std::size_t e = 0;
    while (a[ai + e] == b[bi + e]) ++e;
    fail(what + ": token " + std::to_string(e / hidden_) + " element " + std::to_string(e % hidden_) + " differs");
  }

  void expect(bool ok, const std::string& what) {
    ++checks_;
    if (!ok) fail(what);
  }

  void fail(const std::string& what) {
    if (failures_ < 10) std::printf("  MISMATCH %s\n", what.c_str());
    ++failures_;
  }

  std::int64_t checks() const { return checks_; }
  std::int64_t failures() const { return failures_; }

 private:
  std::size_t hidden_;
  std::int64_t checks_ = 0, failures_ = 0;
};

std::string at(std::size_t a, std::size_t b) { return "[" + std::to_string(a) + "][" + std::to_string(b) + "]"; }
std::string at(std::size_t a, std::size_t b, std::size_t c) { return at(a, b) + "[" + std::to_string(c) + "]"; }

// MLP-layout start of every shard: starts[r][j] = P_r(j).
std::vector<std::vector<std::int64_t>> shard_starts(const Metadata& fwd) {
  std::vector<std::vector<std::int64_t>> starts(static_cast<std::size_t>(fwd.world_size));
  for (std::size_t r = 0; r < starts.size(); ++r) {
    std::int64_t p = 0;
    for (std::size_t j = 0; j < static_cast<std::size_t>(fwd.num_seqs(r)); ++j) {
      starts[r].push_back(p);
      p += fwd.seq_len(r, j);
    }
  }
  return starts;
}

int run_demo(const Options& o) {
  using clock = std::chrono::steady_clock;
  const auto W = static_cast<std::size_t>(o.world_size);
  const auto H = static_cast<std::size_t>(o.hidden);

  // ---- 1. plan
  const cpdispatch::QkvPlan plan = cpdispatch::create_qkv_dispatch(o.world_size, o.tokens, o.docs, o.max_cp, o.seed);
  const auto p0 = clock::now();
  const cpdispatch::QkvMetadata meta = cpdispatch::plan_qkv(plan);
  const double plan_s = std::chrono::duration<double>(clock::now() - p0).count();
  const std::size_t C = meta.kv_fwd.num_copies();

  std::printf("cpdispatch %s demo: %zu ranks x %lld tokens, %lld documents per rank, CP degree <= %lld, "
              "%zu-byte tokens (bf16 x %zu), seed %llu\n",
              cpdispatch::version_string, W, static_cast<long long>(o.tokens), static_cast<long long>(o.docs),
              static_cast<long long>(o.max_cp), H * sizeof(bfloat16), H, static_cast<unsigned long long>(o.seed));
  std::printf("planned in %.3f ms\n\nrank 0's documents (length -> attention ranks of its shards):\n", plan_s * 1e3);
  for (std::size_t i = 0; i < plan.ranks[0].docs.size() && i < 8; ++i) {
    const cpdispatch::Document& doc = plan.ranks[0].docs[i];
    std::int64_t len = 0;
    std::string dst;
    for (std::size_t s = 0; s < doc.shard_len.size(); ++s) {
      len += doc.shard_len[s];
      dst += (s ? ", " : "") + std::to_string(doc.dst[s]);
    }
    std::printf("  doc %zu: %6lld tokens -> CP %zu on ranks [%s]\n", i, static_cast<long long>(len), doc.shard_len.size(), dst.c_str());
  }
  if (plan.ranks[0].docs.size() > 8) std::printf("  ... (%zu documents)\n", plan.ranks[0].docs.size());

  Checker check(H);
  for (auto [m, name] : {std::pair{&meta.q_fwd, "q_fwd"}, std::pair{&meta.q_rev, "q_rev"}, std::pair{&meta.kv_fwd, "kv_fwd"},
                         std::pair{&meta.kv_rev, "kv_rev"}}) {
    try {
      m->validate(name);
      check.expect(true, name);
    } catch (const cpdispatch::invalid_input& e) {
      check.expect(false, e.what());
    }
  }

  // ---- 2./3. the exchanges
  const Buffers q_in = make_data(meta.q_fwd, H, o.seed, 0);
  const Buffers kv_in = make_data(meta.kv_fwd, H, o.seed + 1, std::max<std::int64_t>(1, 256 / static_cast<std::int64_t>(C)));
  auto outputs_of = [&](const Metadata& m) {
    return make_outputs(W, H, [&](std::size_t r) { return m.output_tokens(static_cast<std::int64_t>(r)); });
  };
  Buffers q_attn = outputs_of(meta.q_fwd), q_back = outputs_of(meta.q_rev);
  Buffers kv_attn = outputs_of(meta.kv_fwd), kv_replica = outputs_of(meta.kv_rev);
  Buffers kv_grad = make_outputs(W, H, [&](std::size_t r) { return meta.kv_fwd.send_tokens(static_cast<std::int64_t>(r)); });

  std::vector<Exchange> exchanges;
  exchanges.push_back(run("q forward", meta.q_fwd, q_in, q_attn, H));
  exchanges.push_back(run("kv forward", meta.kv_fwd, kv_in, kv_attn, H));
  exchanges.push_back(run("q reverse", meta.q_rev, q_attn, q_back, H));
  exchanges.push_back(run("kv reverse (grad)", meta.kv_rev, kv_attn, kv_replica, H));
  const auto c0 = clock::now();
  for (std::size_t r = 0; r < W; ++r) {
    cpdispatch::combine_copies<bfloat16>(meta.kv_rev, static_cast<std::int64_t>(r), std::span<const bfloat16>(kv_replica[r]),
                                         std::span<bfloat16>(kv_grad[r]), H);
  }
  const double combine_s = std::chrono::duration<double>(clock::now() - c0).count();

  // ---- 4. checks
  const auto starts = shard_starts(meta.q_fwd);
  // Every query shard lands where q_fwd says; the round trip is the identity.
  for (std::size_t r = 0; r < W; ++r) {
    for (std::size_t j = 0; j < starts[r].size(); ++j) {
      const auto d = static_cast<std::size_t>(meta.q_fwd.dst_rank(r, j));
      check.same(q_attn[d], meta.q_fwd.dst_offset(r, j), q_in[r], starts[r][j], meta.q_fwd.seq_len(r, j), "q_fwd" + at(r, j));
    }
    check.same(q_back[r], 0, q_in[r], 0, meta.q_fwd.send_tokens(static_cast<std::int64_t>(r)), "q round trip on rank " + std::to_string(r));
    check.expect(q_back[r].size() == q_in[r].size(), "q round trip size on rank " + std::to_string(r));
  }
  // Each KV copy equals its source.
  for (std::size_t r = 0; r < W; ++r)
    for (std::size_t g = 0; g < starts[r].size(); ++g)
      for (std::size_t c = 0; c < C; ++c) {
        const std::int64_t d = meta.kv_fwd.dst_rank(r, g, c);
        if (d < 0) continue;
        check.same(kv_attn[static_cast<std::size_t>(d)], meta.kv_fwd.dst_offset(r, g, c), kv_in[r], starts[r][g],
                   meta.kv_fwd.seq_len(r, g), "kv_fwd" + at(r, g, c));
      }
  // The attention layout: query m at rank d is its shard, and its KV group is
  // the document's causal prefix (shards of a document are contiguous at the source).
  for (std::size_t d = 0; d < W; ++d) {
    const auto& cu_q = meta.attn.cu_seqlens_q[d];
    const auto& cu_kv = meta.attn.cu_seqlens_kv[d];
    check.expect(static_cast<std::size_t>(cu_q.back()) * H == q_attn[d].size(), "cu_seqlens_q of rank " + std::to_string(d));
    check.expect(static_cast<std::size_t>(cu_kv.back()) * H == kv_attn[d].size(), "cu_seqlens_kv of rank " + std::to_string(d));
    for (std::size_t m = 0; m + 1 < cu_q.size(); ++m) {
      const auto r = static_cast<std::size_t>(meta.q_rev.dst_rank(d, m));
      const std::int64_t start = meta.q_rev.dst_offset(d, m), q_len = meta.attn.seqlens_q[d][m], kv_len = meta.attn.seqlens_kv[d][m];
      check.same(q_attn[d], cu_q[m], q_in[r], start, q_len, "attention query " + at(d, m));
      check.same(kv_attn[d], cu_kv[m], kv_in[r], start + q_len - kv_len, kv_len, "attention KV group " + at(d, m));
    }
  }
  // The combined gradient is the source times the number of its copies.
  std::int64_t combined_tokens = 0;
  for (std::size_t r = 0; r < W; ++r) {
    for (std::size_t g = 0; g < starts[r].size(); ++g) {
      std::int64_t copies = 0;
      for (std::size_t c = 0; c < C; ++c) copies += (*meta.kv_rev.seq_recv_mask)(r, g, c);
      const std::size_t begin = static_cast<std::size_t>(starts[r][g]) * H;
      const std::size_t end = begin + static_cast<std::size_t>(meta.kv_fwd.seq_len(r, g)) * H;
      std::size_t bad = end;
      for (std::size_t i = begin; i < end && bad == end; ++i)
        if (!(kv_grad[r][i] == bfloat16(static_cast<float>(kv_in[r][i]) * static_cast<float>(copies)))) bad = i;
      check.expect(bad == end, "combined KV gradient" + at(r, g) + " (" + std::to_string(copies) + " copies) at element " +
                                   std::to_string(bad - begin));
      combined_tokens += meta.kv_fwd.seq_len(r, g) * copies;
    }
  }

  // ---- 5. report
  std::printf("\n%4s %5s %6s %10s %10s %8s %10s %6s %8s %8s\n", "rank", "docs", "shards", "q sent", "q recv", "(local)",
              "kv recv", "seqs", "max q", "max kv");
  std::int64_t tot[6] = {};
  for (std::size_t r = 0; r < W; ++r) {
    const std::int64_t row[6] = {static_cast<std::int64_t>(plan.ranks[r].docs.size()), meta.q_fwd.num_seqs(r),
                                 meta.q_fwd.send_tokens(static_cast<std::int64_t>(r)), meta.q_fwd.num_recv_tokens(r, W),
                                 meta.q_fwd.num_recv_tokens(r, r), meta.kv_fwd.num_recv_tokens(r, W)};
    for (int i = 0; i < 6; ++i) tot[i] += row[i];
    std::printf("%4zu %5lld %6lld %10lld %10lld %8lld %10lld %6zu %8lld %8lld\n", r, static_cast<long long>(row[0]),
                static_cast<long long>(row[1]), static_cast<long long>(row[2]), static_cast<long long>(row[3]),
                static_cast<long long>(row[4]), static_cast<long long>(row[5]), meta.attn.seqlens_q[r].size(),
                static_cast<long long>(meta.attn.max_seqlen_q[r]), static_cast<long long>(meta.attn.max_seqlen_kv[r]));
  }
  std::printf("%4s %5lld %6lld %10lld %10lld %8lld %10lld\n", "all", static_cast<long long>(tot[0]), static_cast<long long>(tot[1]),
              static_cast<long long>(tot[2]), static_cast<long long>(tot[3]), static_cast<long long>(tot[4]),
              static_cast<long long>(tot[5]));
  std::printf("(q sent/recv, kv recv: tokens; local: received from itself; seqs: query shards attended on the rank)\n\n");

  std::printf("%-20s %12s %10s %10s\n", "simulated exchange", "MiB moved", "ms", "GB/s");
  double bytes = 0, seconds = 0;
  for (const Exchange& e : exchanges) {
    std::printf("%-20s %12.1f %10.3f %10.2f\n", e.name, e.bytes / (1 << 20), e.seconds * 1e3, e.bytes / e.seconds / 1e9);
    bytes += e.bytes;
    seconds += e.seconds;
  }
  std::printf("%-20s %12.1f %10.3f %10.2f\n", "all exchanges", bytes / (1 << 20), seconds * 1e3, bytes / seconds / 1e9);
  const double combine_bytes = static_cast<double>(combined_tokens) * static_cast<double>(H * sizeof(bfloat16));
  std::printf("%-20s %12.1f %10.3f %10.2f  (replica bytes summed)\n\n", "kv grad combine", combine_bytes / (1 << 20),
              combine_s * 1e3, combine_bytes / combine_s / 1e9);

  if (check.failures() > 0) {
    std::printf("verification FAILED: %lld of %lld checks\n", static_cast<long long>(check.failures()),
                static_cast<long long>(check.checks()));
    return 1;
  }
  std::printf("all checks passed (%lld checks: placements, KV groups, copies, round trip, combined gradients)\n",
              static_cast<long long>(check.checks()));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  try {
    options = parse_options(argc, argv);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "cpdispatch-demo: %s\n", e.message.c_str());
    return 2;
  }
  if (options.help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  try {
    return run_demo(options);
  } catch (const cpdispatch::error& e) {
    std::fprintf(stderr, "cpdispatch-demo: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cpdispatch-demo: unexpected error: %s\n", e.what());
    return 1;
  }
}
