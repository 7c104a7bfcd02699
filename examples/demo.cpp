// cpdispatch-demo: context-parallel QKV dispatch of a packed batch on the
// memcpy simulation, every byte checked.
//
//   1. draw a batch: documents with lengths from a real sample (ProLong by
//      default) packed end to end into every rank's token budget, so a long
//      document starts on one rank and continues on the next ones
//      (draw_workload); balance it (plan_balanced: shards inside each piece,
//      attended where the largest causal attention cost is smallest), and
//      plan the metadata of the documents-form plan (plan_qkv);
//   2. forward: queries and key-values from the MLP layout to the attention
//      layout (KV shards replicated to every later query shard of their
//      document, wherever that document's shards live);
//   3. reverse: queries back (the round trip must be the identity), and the
//      KV gradients back into [C][T] replica buffers that combine_copies sums;
//   4. checks, from the plan itself: every query shard of every document
//      lands where the attention layout says, its KV group is exactly its
//      document's causal prefix gathered from all the ranks the document
//      spans, each KV copy equals its source, the query round trip is the
//      identity, and the combined KV gradient equals source x copies;
//   5. prints the per-rank table, the balance against the lower bound and
//      the bytes moved per second.
//
// The KV gradient sent back is the forwarded KV itself, so the expected
// combined gradient is the source times its number of copies. KV values are
// small integers, so that sum is exact in bfloat16.
//
// Exit status: 0 when every check passes, 1 when one fails, 2 on bad options.

#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <initializer_list>
#include <iterator>
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

#ifndef CPDISPATCH_DOC_LENGTHS_DIR
#error "CPDISPATCH_DOC_LENGTHS_DIR: the folder of the document-length samples (examples/CMakeLists.txt sets it)"
#endif

struct Options {
  std::int64_t world_size = 8;
  std::int64_t tokens = 8192;  // per rank
  std::int64_t docs = 0;       // with builtin: mean documents per rank of the built-in sample
  bool builtin = false;        // --docs given: draw from the built-in sample
  std::int64_t max_cp = 8;     // most shards per document (raised to the widest span of a document)
  std::int64_t hidden = 128;   // bfloat16 elements per token
  std::uint64_t seed = 42;
  cpdispatch::AttentionMask mask;  // causal unless --mask says otherwise
  std::string lengths;         // JSON array of document lengths; empty: data/prolong.json (unless --docs)
  bool help = false;
};

constexpr const char* kUsage = R"(usage: cpdispatch-demo [options]

Draws a batch of documents packed end to end over the ranks (long documents
span ranks), balances it, runs the forward and reverse query and key-value
exchanges and the KV-gradient combine on the memcpy simulation, checks every
byte and prints a per-rank table.

options (--name value or --name=value):
  -w, --world-size N   ranks (default 8)
  -t, --tokens N       tokens per rank (default 8192)
  -l, --lengths FILE   document lengths to draw from, a JSON array (default:
                       the project's ProLong sample, data/prolong.json)
  -d, --docs N         draw from a built-in heavy-tailed sample instead, with
                       N documents per rank on average
  -c, --max-cp N       most shards per document, 1..256 (default 8; raised to
                       the most ranks one document spans)
  -H, --hidden N       bfloat16 elements per token (default 128: 256-byte tokens)
  -s, --seed N         seed of the batch and the data (default 42)
  -m, --mask M         attention mask: causal (default), full, or window:N (a
                       sliding window of N tokens); balancing and the KV
                       exchange follow it
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

/// causal, full, or window:N.
cpdispatch::AttentionMask parse_mask(std::string_view text) {
  if (text == "causal") return cpdispatch::AttentionMask::causal();
  if (text == "full") return cpdispatch::AttentionMask::full();
  if (text.starts_with("window:")) {
    const auto w = parse_int<std::int64_t>("--mask window:N", text.substr(7));
    if (w < 1) throw UsageError{"--mask window:N needs N >= 1, got " + std::to_string(w)};
    return cpdispatch::AttentionMask::sliding_window(w);
  }
  throw UsageError{"--mask expects causal, full or window:N, got '" + std::string(text) + "'"};
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
    else if (arg == "-l" || arg == "--lengths") o.lengths = std::string(next());
    else if (arg == "-d" || arg == "--docs") {
      o.docs = parse_int<std::int64_t>("--docs", next());
      o.builtin = true;
    } else if (arg == "-c" || arg == "--max-cp") o.max_cp = parse_int<std::int64_t>("--max-cp", next());
    else if (arg == "-H" || arg == "--hidden") o.hidden = parse_int<std::int64_t>("--hidden", next());
    else if (arg == "-s" || arg == "--seed") o.seed = parse_int<std::uint64_t>("--seed", next());
    else if (arg == "-m" || arg == "--mask") o.mask = parse_mask(next());
    else throw UsageError{"unknown option '" + std::string(argv[i]) + "' (see --help)"};
  }
  if (o.help) return o;
  auto at_least_one = [](std::string_view name, std::int64_t v) {
    if (v < 1) throw UsageError{std::string(name) + " = " + std::to_string(v) + " must be at least 1"};
  };
  at_least_one("--world-size", o.world_size);
  at_least_one("--tokens", o.tokens);
  if (o.builtin) at_least_one("--docs", o.docs);
  if (o.builtin && !o.lengths.empty()) throw UsageError{"--docs and --lengths each choose the sample: give one"};
  at_least_one("--hidden", o.hidden);
  at_least_one("--max-cp", o.max_cp);
  if (o.max_cp > 256) throw UsageError{"--max-cp = " + std::to_string(o.max_cp) + " is above 256 (the checks need exact bfloat16 sums)"};
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

// ---- the batch ----------------------------------------------------------------

// A JSON array of positive integers (the doc-lengths sample format).
std::vector<std::int64_t> read_lengths(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw UsageError{"cannot read the length file '" + path + "'"};
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::int64_t> out;
  std::size_t i = text.find('[');
  if (i == std::string::npos) throw UsageError{"'" + path + "' is not a JSON array of lengths"};
  for (++i; i < text.size() && text[i] != ']'; ++i) {
    if (text[i] == ',' || std::isspace(static_cast<unsigned char>(text[i]))) continue;
    std::size_t end = i;
    while (end < text.size() && std::isdigit(static_cast<unsigned char>(text[end]))) ++end;
    if (end == i) throw UsageError{"'" + path + "': expected a positive integer at byte " + std::to_string(i)};
    out.push_back(parse_int<std::int64_t>("a length", std::string_view(text).substr(i, end - i)));
    if (out.back() < 1) throw UsageError{"'" + path + "': a length is not positive"};
    i = end - 1;
  }
  if (out.empty()) throw UsageError{"'" + path + "' holds no lengths"};
  return out;
}

// Heavy-tailed lengths, mean about `mean`: most short, one in eight up to 8x the mean.
std::vector<std::int64_t> builtin_sample(std::int64_t mean, std::uint64_t seed) {
  cpdispatch::Rng rng(seed);
  std::vector<std::int64_t> out;
  const std::int64_t short_max = std::max<std::int64_t>(1, mean / 2), long_max = std::max<std::int64_t>(1, mean * 8);
  for (int i = 0; i < 1024; ++i) out.push_back(rng.below(8) == 0 ? rng.between(1, long_max) : rng.between(1, short_max));
  return out;
}

struct Sample {
  std::vector<std::int64_t> lengths;
  std::string name;
};

Sample choose_sample(const Options& o) {
  if (!o.lengths.empty()) return {read_lengths(o.lengths), o.lengths};
  if (o.builtin) {
    const std::int64_t mean = std::max<std::int64_t>(1, o.tokens / o.docs);
    return {builtin_sample(mean, o.seed), "built-in heavy-tailed sample, mean " + std::to_string(mean) + " tokens"};
  }
  const std::string prolong = std::string(CPDISPATCH_DOC_LENGTHS_DIR) + "/prolong.json";
  return {read_lengths(prolong), "ProLong (" + prolong + ")"};
}

struct Batch {
  cpdispatch::BalanceProblem problem;
  cpdispatch::QkvDocumentsPlan plan;
  cpdispatch::QkvMetadata meta;
  cpdispatch::PlanCost before, after;
  double bound = 0, plan_ms = 0;
};

Batch plan_batch(const Options& o, const Sample& sample) {
  Batch b;
  b.problem.world_size = o.world_size;
  b.problem.documents = cpdispatch::draw_workload(sample.lengths, o.world_size, o.tokens, o.seed);
  // A shard never crosses a piece boundary: a document over n ranks needs n shards.
  b.problem.max_cp_degree = std::max(o.max_cp, static_cast<std::int64_t>(cpdispatch::widest_span(b.problem.documents)));
  b.problem.q_bytes = b.problem.kv_bytes = o.hidden * static_cast<std::int64_t>(sizeof(bfloat16));
  b.problem.mask = o.mask;
  const auto t0 = std::chrono::steady_clock::now();
  b.plan = cpdispatch::plan_balanced(b.problem);
  b.meta = cpdispatch::plan_qkv(b.plan);
  b.plan_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  b.bound = cpdispatch::balance_lower_bound(b.problem);
  b.before = cpdispatch::plan_cost(cpdispatch::plan_unbalanced(b.problem), b.problem.q_bytes, b.problem.kv_bytes);
  b.after = cpdispatch::plan_cost(b.plan, b.problem.q_bytes, b.problem.kv_bytes);
  return b;
}

// Where every shard of the plan lives in the MLP layout: rank `home` holds
// its shards ordered by (document, shard), from token `offset`.
struct ShardAt {
  std::size_t home, doc, index;
  std::int64_t offset, len, dst;
};

std::vector<std::vector<ShardAt>> shard_places(const cpdispatch::QkvDocumentsPlan& plan) {
  std::vector<std::int64_t> next(static_cast<std::size_t>(plan.world_size), 0);
  std::vector<std::vector<ShardAt>> out(plan.documents.size());
  for (std::size_t d = 0; d < plan.documents.size(); ++d)
    for (std::size_t k = 0; k < plan.documents[d].shards.size(); ++k) {
      const cpdispatch::DocumentShard& s = plan.documents[d].shards[k];
      const auto home = static_cast<std::size_t>(s.rank);
      out[d].push_back({home, d, k, next[home], s.len, s.dst});
      next[home] += s.len;
    }
  return out;
}

void print_batch(const Options& o, const Sample& sample, const Batch& b) {
  const auto& docs = b.problem.documents;
  std::printf("cpdispatch %s demo: %lld ranks x %lld tokens, %zu-byte tokens (bf16 x %lld), seed %llu\n", cpdispatch::version_string,
              static_cast<long long>(o.world_size), static_cast<long long>(o.tokens), static_cast<std::size_t>(o.hidden) * sizeof(bfloat16),
              static_cast<long long>(o.hidden), static_cast<unsigned long long>(o.seed));
  std::printf("lengths: %s; mask %s\n", sample.name.c_str(), to_string(o.mask).c_str());
  std::printf("packed batch: %zu documents, %zu of them span ranks (up to %zu ranks); at most %lld shards per document\n",
              docs.size(), cpdispatch::spanning_documents(docs), cpdispatch::widest_span(docs),
              static_cast<long long>(b.problem.max_cp_degree));
  std::printf("balanced and planned in %.3f ms: largest attention cost %.4g = %.3f x the lower bound (before balancing %.3f x); "
              "%.1f MiB moved\n\nspanning documents (pieces: rank x tokens -> attention ranks of the shards):\n",
              b.plan_ms, static_cast<double>(b.after.max_attention()), static_cast<double>(b.after.max_attention()) / b.bound,
              static_cast<double>(b.before.max_attention()) / b.bound, static_cast<double>(b.after.bytes_moved) / (1 << 20));
  int shown = 0;
  for (std::size_t i = 0; i < docs.size() && shown < 4; ++i) {
    const auto& doc = docs[i].pieces;
    if (std::all_of(doc.begin(), doc.end(), [&](const auto& pc) { return pc.rank == doc.front().rank; })) continue;
    std::string pieces, dst;
    for (const auto& pc : doc) pieces += (pieces.empty() ? "" : " + ") + std::to_string(pc.rank) + "x" + std::to_string(pc.len);
    for (const auto& s : b.plan.documents[i].shards) dst += (dst.empty() ? "" : ", ") + std::to_string(s.dst);
    std::printf("  doc %zu: %s -> [%s]\n", i, pieces.c_str(), dst.c_str());
    ++shown;
  }
}

// ---- the exchanges and the checks ----------------------------------------------

struct Run {
  Buffers q_in, kv_in, q_attn, q_back, kv_attn, kv_replica, kv_grad;
  std::vector<Exchange> exchanges;
  double combine_s = 0;
};

Run run_exchanges(const cpdispatch::QkvMetadata& meta, std::size_t H, std::uint64_t seed) {
  const std::size_t W = static_cast<std::size_t>(meta.q_fwd.world_size), C = meta.kv_fwd.num_copies();
  Run x;
  x.q_in = make_data(meta.q_fwd, H, seed, 0);
  x.kv_in = make_data(meta.kv_fwd, H, seed + 1, std::max<std::int64_t>(1, 256 / static_cast<std::int64_t>(C)));
  auto outputs_of = [&](const Metadata& m) {
    return make_outputs(W, H, [&](std::size_t r) { return m.output_tokens(static_cast<std::int64_t>(r)); });
  };
  x.q_attn = outputs_of(meta.q_fwd);
  x.q_back = outputs_of(meta.q_rev);
  x.kv_attn = outputs_of(meta.kv_fwd);
  x.kv_replica = outputs_of(meta.kv_rev);
  x.kv_grad = make_outputs(W, H, [&](std::size_t r) { return meta.kv_fwd.send_tokens(static_cast<std::int64_t>(r)); });
  x.exchanges.push_back(run("q forward", meta.q_fwd, x.q_in, x.q_attn, H));
  x.exchanges.push_back(run("kv forward", meta.kv_fwd, x.kv_in, x.kv_attn, H));
  x.exchanges.push_back(run("q reverse", meta.q_rev, x.q_attn, x.q_back, H));
  x.exchanges.push_back(run("kv reverse (grad)", meta.kv_rev, x.kv_attn, x.kv_replica, H));
  const auto c0 = std::chrono::steady_clock::now();
  for (std::size_t r = 0; r < W; ++r) {
    cpdispatch::combine_copies<bfloat16>(meta.kv_rev, static_cast<std::int64_t>(r), std::span<const bfloat16>(x.kv_replica[r]),
                                         std::span<bfloat16>(x.kv_grad[r]), H);
  }
  x.combine_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count();
  return x;
}

// The metadata validates, queries return unchanged, and every KV copy equals its source.
void check_metadata_and_copies(Checker& check, const cpdispatch::QkvMetadata& meta, const Run& x) {
  for (auto [m, name] : {std::pair{&meta.q_fwd, "q_fwd"}, std::pair{&meta.q_rev, "q_rev"}, std::pair{&meta.kv_fwd, "kv_fwd"},
                         std::pair{&meta.kv_rev, "kv_rev"}}) {
    try {
      m->validate(name);
      check.expect(true, name);
    } catch (const cpdispatch::invalid_input& e) {
      check.expect(false, e.what());
    }
  }
  const auto W = static_cast<std::size_t>(meta.q_fwd.world_size);
  for (std::size_t r = 0; r < W; ++r) {
    check.same(x.q_back[r], 0, x.q_in[r], 0, meta.q_fwd.send_tokens(static_cast<std::int64_t>(r)), "q round trip on rank " + std::to_string(r));
    check.expect(x.q_back[r].size() == x.q_in[r].size(), "q round trip size on rank " + std::to_string(r));
    std::int64_t start = 0;
    for (std::size_t g = 0; g < static_cast<std::size_t>(meta.kv_fwd.num_seqs(r)); ++g) {
      for (std::size_t c = 0; c < meta.kv_fwd.num_copies(); ++c) {
        const std::int64_t d = meta.kv_fwd.dst_rank(r, g, c);
        if (d < 0) continue;
        check.same(x.kv_attn[static_cast<std::size_t>(d)], meta.kv_fwd.dst_offset(r, g, c), x.kv_in[r], start, meta.kv_fwd.seq_len(r, g),
                   "kv_fwd" + at(r, g, c));
      }
      start += meta.kv_fwd.seq_len(r, g);
    }
  }
}

/// The needed ranges and users of one document's shards under `mask`.
cpdispatch::detail::DocumentRanges ranges_of(const std::vector<ShardAt>& doc, const cpdispatch::AttentionMask& mask) {
  std::vector<std::int64_t> len;
  for (const ShardAt& s : doc) len.push_back(s.len);
  cpdispatch::detail::DocumentRanges r;
  r.compute(mask, len.data(), len.size());
  return r;
}

// From the plan alone: at each attention rank, query shards arrive in order of
// (home rank, place there); each is its own tokens, and its KV group is the
// document's shards it needs under the mask (0..i when causal) gathered from
// their homes, in order.
void check_attention_layout(Checker& check, const cpdispatch::QkvMetadata& meta, const std::vector<std::vector<ShardAt>>& places,
                            const Run& x) {
  const auto W = static_cast<std::size_t>(meta.q_fwd.world_size);
  std::vector<std::vector<const ShardAt*>> arrivals(W);
  for (const auto& doc : places)
    for (const ShardAt& s : doc) arrivals[static_cast<std::size_t>(s.dst)].push_back(&s);
  for (auto& list : arrivals)
    std::sort(list.begin(), list.end(), [](const ShardAt* a, const ShardAt* b) { return a->home != b->home ? a->home < b->home : a->offset < b->offset; });
  for (std::size_t d = 0; d < W; ++d) {
    const auto& cu_q = meta.attn.cu_seqlens_q[d];
    const auto& cu_kv = meta.attn.cu_seqlens_kv[d];
    check.expect(cu_q.size() == arrivals[d].size() + 1, "query shards attended on rank " + std::to_string(d));
    for (std::size_t m = 0; m < arrivals[d].size() && m + 1 < cu_q.size(); ++m) {
      const ShardAt& q = *arrivals[d][m];
      check.same(x.q_attn[d], cu_q[m], x.q_in[q.home], q.offset, q.len, "attention query " + at(d, m));
      std::int64_t kv_at = cu_kv[m];
      const cpdispatch::detail::DocumentRanges need = ranges_of(places[q.doc], meta.attn.mask);
      for (std::size_t k = need.lo[q.index]; k <= need.hi[q.index]; ++k) {
        const ShardAt& kv = places[q.doc][k];
        check.same(x.kv_attn[d], kv_at, x.kv_in[kv.home], kv.offset, kv.len, "attention KV group " + at(d, m) + " shard " + std::to_string(k));
        kv_at += kv.len;
      }
      check.expect(kv_at == cu_kv[m + 1], "KV group length " + at(d, m));
    }
  }
}

// Each KV shard has one copy per query shard that needs it (n - k of an
// n-shard document when causal): its combined gradient is its source times
// that count. Returns the replica tokens summed.
std::int64_t check_combine(Checker& check, const std::vector<std::vector<ShardAt>>& places, const Run& x, std::size_t H,
                           const cpdispatch::AttentionMask& mask) {
  std::int64_t combined = 0;
  for (const auto& doc : places) {
    const cpdispatch::detail::DocumentRanges need = ranges_of(doc, mask);
    for (const ShardAt& s : doc) {
      const auto copies = static_cast<float>(need.users(s.index));
      const std::size_t begin = static_cast<std::size_t>(s.offset) * H, end = begin + static_cast<std::size_t>(s.len) * H;
      std::size_t bad = end;
      for (std::size_t i = begin; i < end && bad == end; ++i)
        if (!(x.kv_grad[s.home][i] == bfloat16(static_cast<float>(x.kv_in[s.home][i]) * copies))) bad = i;
      check.expect(bad == end, "combined KV gradient of document " + std::to_string(s.doc) + " shard " + std::to_string(s.index) +
                                   " at element " + std::to_string(bad - begin));
      combined += s.len * static_cast<std::int64_t>(doc.size() - s.index);
    }
  }
  return combined;
}

// ---- the report -----------------------------------------------------------------

void print_table(const Batch& b, const std::vector<std::vector<ShardAt>>& places) {
  const auto W = static_cast<std::size_t>(b.plan.world_size);
  const cpdispatch::QkvMetadata& meta = b.meta;
  std::vector<std::int64_t> spanning(W, 0);
  for (const auto& doc : places)
    for (const ShardAt& s : doc) spanning[s.home] += doc.front().home != doc.back().home ? 1 : 0;
  std::printf("\n%4s %6s %8s %8s %8s %8s %12s %12s %6s %7s %7s\n", "rank", "shards", "spanning", "tokens", "q recv", "kv recv",
              "attn before", "attn after", "seqs", "max q", "max kv");
  for (std::size_t r = 0; r < W; ++r) {
    std::printf("%4zu %6lld %8lld %8lld %8lld %8lld %12.4g %12.4g %6zu %7lld %7lld\n", r, static_cast<long long>(meta.q_fwd.num_seqs(r)),
                static_cast<long long>(spanning[r]), static_cast<long long>(meta.q_fwd.send_tokens(static_cast<std::int64_t>(r))),
                static_cast<long long>(meta.q_fwd.num_recv_tokens(r, W)), static_cast<long long>(meta.kv_fwd.num_recv_tokens(r, W)),
                static_cast<double>(b.before.attention[r]), static_cast<double>(b.after.attention[r]), meta.attn.seqlens_q[r].size(),
                static_cast<long long>(meta.attn.max_seqlen_q[r]), static_cast<long long>(meta.attn.max_seqlen_kv[r]));
  }
  std::printf("(shards: held in the MLP layout; spanning: of documents that span ranks; q/kv recv: tokens attended;\n"
              " attn: causal token pairs attended, before balancing and after; seqs: query shards attended)\n\n");
}

void print_throughput(const Run& x, std::int64_t combined_tokens, std::size_t H) {
  std::printf("%-20s %12s %10s %10s\n", "simulated exchange", "MiB moved", "ms", "GB/s");
  double bytes = 0, seconds = 0;
  for (const Exchange& e : x.exchanges) {
    std::printf("%-20s %12.1f %10.3f %10.2f\n", e.name, e.bytes / (1 << 20), e.seconds * 1e3, e.bytes / e.seconds / 1e9);
    bytes += e.bytes;
    seconds += e.seconds;
  }
  std::printf("%-20s %12.1f %10.3f %10.2f\n", "all exchanges", bytes / (1 << 20), seconds * 1e3, bytes / seconds / 1e9);
  const double combine_bytes = static_cast<double>(combined_tokens) * static_cast<double>(H * sizeof(bfloat16));
  std::printf("%-20s %12.1f %10.3f %10.2f  (replica bytes summed)\n\n", "kv grad combine", combine_bytes / (1 << 20),
              x.combine_s * 1e3, combine_bytes / x.combine_s / 1e9);
}

int run_demo(const Options& o) {
  const auto H = static_cast<std::size_t>(o.hidden);
  const Sample sample = choose_sample(o);
  const Batch batch = plan_batch(o, sample);
  print_batch(o, sample, batch);
  const auto places = shard_places(batch.plan);
  const Run x = run_exchanges(batch.meta, H, o.seed);
  Checker check(H);
  check_metadata_and_copies(check, batch.meta, x);
  check_attention_layout(check, batch.meta, places, x);
  const std::int64_t combined = check_combine(check, places, x, H, o.mask);
  print_table(batch, places);
  print_throughput(x, combined, H);
  if (check.failures() > 0) {
    std::printf("verification FAILED: %lld of %lld checks\n", static_cast<long long>(check.failures()),
                static_cast<long long>(check.checks()));
    return 1;
  }
  std::printf("all checks passed (%lld checks: placements, KV groups across ranks, copies, round trip, combined gradients)\n",
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
  } catch (const UsageError& e) {  // an unreadable length file
    std::fprintf(stderr, "cpdispatch-demo: %s\n", e.message.c_str());
    return 2;
  } catch (const cpdispatch::error& e) {
    std::fprintf(stderr, "cpdispatch-demo: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cpdispatch-demo: unexpected error: %s\n", e.what());
    return 1;
  }
}
