// bench_cp_attention: one attention layer's step (forward + backward) with
// ContextParallelAttention, W ranks as threads over SimulatedLinkTransport,
// on packed batches drawn from document-length samples (ProLong and WLB-LLM,
// or a file) and balanced by plan_balanced; against ring attention with the
// zig-zag layout (Transformer Engine / Megatron p2p), Ulysses (all-to-all
// from sequence to heads and back, DeepSpeed) and USP (Ulysses inside groups
// of u consecutive ranks, the zig-zag ring across the W / u groups) over the
// same kernel and link. Query and key-value heads may differ (grouped-query
// attention): Ulysses and USP move every query head and every key-value head.
//
// Each rank's kernel calls are paced (paced_kernel.hpp; --pace 0: not) to the
// time they take when all W ranks compute at once, so that a rank computes at
// one speed, as on its own GPU, whether or not the others compute too.
// The link's bandwidth comes from the kernel's FLOP rate measured while all
// W ranks compute at once, so that FLOPs per byte match an H100 (400 TFLOP/s
// of attention) over 400 Gb/s InfiniBand (50 GB/s) or NVLink (450 GB/s).
// In the same run: compute = the step over an instant link, communication =
// the step with a kernel that does nothing; bound = max(compute,
// communication) + min(compute, communication) / stages (bench_overlap's).
// Per link also ours with the plan the step model picks for it
// (plan_for_cluster: as balanced as pays on that link), at --plan-stages (2).
// Per batch also: the most bytes a rank sends or receives in one step (forward and
// backward; counted by the link) and the attention work's max / mean over
// the ranks, for each method.
// USP runs every u with 1 < u < W that divides W and both head counts (u = 1
// is the ring, u = W Ulysses: those are their own lines) and reports the
// fastest u, beside the u the step model (model_usp) picks for the link.
// --shared-prefix N makes every document a prompt (a third of it) and N equal
// responses, each seeing the prompt and itself (docs/plan-format.md, 2e): ours
// runs the plan of those slices, Ulysses whole documents under the same mask;
// both lines then give the key-value bytes the busiest rank moves (forward).
// Prints one line per (sample, batch, link, method) and the medians.
//   bench_cp_attention [--world 8] [--tokens 1024] [--batches 3] [--first-batch 0]
//                      [--sample prolong|wlbllm|both | --lengths FILE] [--heads 8 | --heads-q 8 --heads-kv 8]
//                      [--head-dim 64] [--dedup 1] [--links ib|nvlink|none|both] [--stages 1,2,4]
//                      [--peers ulysses,ring,usp|both|all] [--shared-prefix 0] [--bound 1] [--balanced 1]
//                      [--model-check 1] [--kernel-rate forward:peak=...,.../backward:...] [--head-parallel off|auto]
//                      [--plan-stages 2] [--trace PREFIX] [--pace 1]
// --head-parallel auto lets the step model's plan (plan_for_cluster) make documents head-parallel in groups of
// any size the heads allow (docs/planning.md); its line then names how many and the group size.
// --model-check 1 (2: also the kernel sweep's entries) prints, per batch, link and method (ours at each stage
// count, Ulysses, the ring), the step model's step (model_plan, model_ulysses, model_zigzag_ring over the link
// as a cluster) next to the measured one, twice: with one FLOP rate (the kernel's rate measured on the batch, as without the flag) and with the
// kernel priced by the entries each rank runs (cpdispatch/model/kernel_rate.hpp). That kernel rate is fitted at
// the start from a short sweep of entries run by all W ranks at once, as in the step (or read from
// --kernel-rate, as bench_attention --sweep prints it). --links none runs an instant link (1e6 bytes a
// FLOP: the kernels alone), which --links both adds with --model-check 1, to check the compute part alone.
// --lengths FILE: a JSON array of document lengths like data/*.json, the sample named by the file's stem.
// --trace PREFIX writes each run of ours (the balanced plan per batch, link and stage count; the step model's
// plan) and each peer's run as every rank's step timeline, Chrome trace-event JSON (attention/step_trace.hpp;
// open it in ui.perfetto.dev), to PREFIX-<sample>-b<batch>-<link>-<run>.json, <run> one of s<stages> (the
// balanced plan), model-s<stages> (the step model's plan), model-s<stages>-predicted (the step model's
// timeline of that run: model_plan_trace), ulysses, ring, usp<u>: ours'
// events are the op's (posts, waits, kernel passes, merges, fans), the peers' their all-to-alls, ring
// passes' waits, kernel calls, merges and sums. tools/trace_diff.py lists where two timelines differ most.
// --peers both (the default) is ulysses,ring; all adds usp. --shared-prefix runs with --peers ulysses only.
// Ours runs the deduplicated key-value exchange (each shard once per destination rank) unless --dedup 0.
// Batch b is the packed batch drawn with seed b: --first-batch and --sample run part of a long
// measurement (at 8K tokens a rank, twenty minutes a batch on two cores) in separate runs; --links,
// --stages, --peers, --bound 0 (no communication-only run, so no step / bound) and --balanced 0 (ours with the
// step model's plan only, not with the balanced plan) leave out runs.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "paced_kernel.hpp"
#include "stage_list.hpp"
#include "cpdispatch/attention.hpp"
#include "cpdispatch/balance/balance.hpp"
#include "cpdispatch/model/cost.hpp"
#include "cpdispatch/model/kernel_rate.hpp"
#include "cpdispatch/model/step_model.hpp"
#include "cpdispatch/plan/rank.hpp"
#include "cpdispatch/workload/workload.hpp"
#include "cpdispatch/transports/sim.hpp"
#include "cpdispatch/adapters/simulated_link.hpp"
#include "stats.hpp"

namespace {

using bench::stage_list;

using Clock = std::chrono::steady_clock;
using Link = cpdispatch::SimulatedLinkTransport<cpdispatch::SimTransport>;

struct Config {
  int world = 8;
  std::int64_t tokens = 1024, heads_q = 8, heads_kv = 8, head_dim = 64, shared_prefix = 0;
  int batches = 3, first_batch = 0;
  std::string sample = "both", lengths, links = "both";
  bool ulysses = true, ring = true, usp = false;
  std::vector<int> stages{1, 2, 4};
  int plan_stages = 2;  ///< the stages of ours with the step model's plan (the model plans for them too)
  bool dedup = true, bound = true, balanced = true;
  bool head_parallel = false;  ///< --head-parallel auto: the step model's plan may have head-parallel documents
  int model_check = 0;  ///< 1: the model's step beside each measured one; 2: also the kernel sweep's entries
  std::string kernel_rate;  ///< --kernel-rate: the fitted rates to use instead of the sweep
  std::string trace;        ///< --trace PREFIX: each run to PREFIX-<sample>-b<batch>-<link>-<run>.json
  bool pace = true;         ///< --pace 0: kernels run as fast as the cores let each rank (no PacedKernel)
};

/// A kernel that attends nothing: the step's communication alone.
struct NoKernel {
  template <class... A>
  void forward(A&&...) {}
  template <class... A>
  void backward(A&&...) {}
};

/// A JSON array of document lengths (data/*.json).
std::vector<std::int64_t> read_lengths(const std::filesystem::path& file) {
  std::ifstream in(file);
  if (!in) {
    std::fprintf(stderr, "bench_cp_attention: cannot read %s\n", file.c_str());
    std::exit(2);
  }
  try {
    return nlohmann::json::parse(in).get<std::vector<std::int64_t>>();
  } catch (const nlohmann::json::exception& e) {
    std::fprintf(stderr, "bench_cp_attention: %s is not a JSON array of document lengths: %s\n", file.c_str(), e.what());
    std::exit(2);
  }
}

/// The samples to run, each with its name: the file of --lengths (named by its stem), or the shipped ones.
std::vector<std::pair<std::string, std::vector<std::int64_t>>> samples(const Config& c) {
  if (!c.lengths.empty()) return {{std::filesystem::path(c.lengths).stem().string(), read_lengths(c.lengths)}};
  const char* env = std::getenv("CPDISPATCH_DOC_LENGTHS_DIR");
  const std::filesystem::path dir = env && *env ? env : CPDISPATCH_DOC_LENGTHS_DIR;
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> out;
  for (const char* name : {"prolong", "wlbllm"}) {
    if (c.sample == "both" || c.sample == name) out.emplace_back(name, read_lengths(dir / (std::string(name) + ".json")));
  }
  return out;
}

std::int64_t length_of(const cpdispatch::BalanceDocument& d) {
  std::int64_t L = 0;
  for (const auto& p : d.pieces) L += p.len;
  return L;
}

/// A shared prefix (docs/plan-format.md, 2e) of `len` tokens: a prompt (a third, with what the responses
/// leave) and `responses` equal responses, each seeing the whole prompt and itself causally. Empty (the
/// document stays causal) when the document is too short for a token of prompt and of every response.
std::vector<cpdispatch::AttentionSlice> shared_prefix(std::int64_t len, std::int64_t responses) {
  const std::int64_t each = (len - len / 3) / responses, prompt = len - responses * each;
  if (len / 3 < 1 || each < 1) return {};
  using cpdispatch::SliceType;
  std::vector<cpdispatch::AttentionSlice> slices{{0, prompt, 0, prompt, SliceType::causal}};
  for (std::int64_t at = prompt; at < len; at += each) {
    slices.push_back({at, at + each, 0, prompt, SliceType::full});
    slices.push_back({at, at + each, at, at + each, SliceType::causal});
  }
  return slices;
}

/// (query, key) pairs of a batch (what every method attends in all): a document's slices, else causal.
double mask_pairs(const std::vector<cpdispatch::BalanceDocument>& docs) {
  double pairs = 0;
  for (const auto& d : docs) {
    const std::int64_t L = length_of(d);
    pairs += d.slices.empty() ? static_cast<double>(L) * static_cast<double>(L + 1) / 2
                              : static_cast<double>(cpdispatch::slice_pairs(d.slices, 0, L, 0, L));
  }
  return pairs;
}

/// One method's step: the slowest rank's seconds and the most bytes a rank sent to, or received from, others.
struct Step {
  double seconds = 0;
  double bytes = 0;
};

/// Every rank's step, timed between two barriers.
template <class Body>
Step timed_world(int W, const cpdispatch::LinkModel& link, Body&& body) {
  cpdispatch::SimWorld world(W);
  std::vector<double> seconds(static_cast<std::size_t>(W)), bytes(seconds.size());
  world.run([&](cpdispatch::SimTransport& sim) {
    Link t(sim, link);
    body(t, [&](auto&& step) {
      sim.barrier();
      const auto start = Clock::now();
      const std::uint64_t sent = t.bytes_sent(), received = t.bytes_received();
      step();
      seconds[static_cast<std::size_t>(sim.rank())] = std::chrono::duration<double>(Clock::now() - start).count();
      bytes[static_cast<std::size_t>(sim.rank())] = static_cast<double>(std::max(t.bytes_sent() - sent, t.bytes_received() - received));
    });
  });
  return {*std::max_element(seconds.begin(), seconds.end()), *std::max_element(bytes.begin(), bytes.end())};
}

/// Every rank's timeline of one run (attention/step_trace.hpp), one origin for all, written to `file` as
/// Chrome trace-event JSON by write(); nothing is recorded when no file is named.
class RunTrace {
 public:
  RunTrace(int W, std::string file) : file_(std::move(file)) {
    const auto origin = cpdispatch::StepTrace::Clock::now();
    if (!file_.empty())
      for (int r = 0; r < W; ++r) traces_.emplace_back(r, origin);
  }
  cpdispatch::StepTrace* of(int rank) { return file_.empty() ? nullptr : &traces_[static_cast<std::size_t>(rank)]; }
  void write() const {
    if (file_.empty()) return;
    std::ofstream out(file_);
    std::vector<const cpdispatch::StepTrace*> all;
    for (const auto& t : traces_) all.push_back(&t);
    cpdispatch::write_chrome_trace(out, all);
    std::printf("  (timeline: %s)\n", file_.c_str());
  }

 private:
  std::string file_;
  std::vector<cpdispatch::StepTrace> traces_;
};

/// Runs f, recorded as one event of `trace` where there is one (a peer's all-to-all, ring pass, kernel or merge).
template <class F>
void traced(cpdispatch::StepTrace* trace, const char* name, const char* call, int group, std::int64_t bytes, F&& f) {
  if (trace == nullptr) return std::forward<F>(f)();
  trace->record(name, call, group, bytes, std::forward<F>(f));
}

/// max / mean of per-rank work.
double imbalance(const std::vector<double>& work) {
  double max = 0, sum = 0;
  for (const double w : work) max = std::max(max, w), sum += w;
  return sum > 0 ? max * static_cast<double>(work.size()) / sum : 1.0;
}

/// Causal pairs per rank of the zig-zag layout: rank r holds chunks r and 2W-1-r of every document, padded to 2W chunks.
std::vector<double> zigzag_pairs(const std::vector<cpdispatch::BalanceDocument>& docs, int W) {
  std::vector<double> pairs(static_cast<std::size_t>(W));
  for (const auto& d : docs) {
    const double ch = std::ceil(static_cast<double>(length_of(d)) / (2.0 * W));
    for (int r = 0; r < W; ++r) {
      for (const int chunk : {r, 2 * W - 1 - r}) pairs[static_cast<std::size_t>(r)] += ch * ch * chunk + ch * (ch + 1) / 2;
    }
  }
  return pairs;
}

/// The host kernel on one thread, paced so that each rank computes at one speed (paced_kernel.hpp).
using HostDevice = cpdispatch_bench::PacedKernel<cpdispatch::HostAttentionKernel>;

template <class Kernel>
Kernel make_kernel(const Config& c) {
  if constexpr (std::is_same_v<Kernel, HostDevice>) {
    return HostDevice(cpdispatch::HostAttentionKernel(cpdispatch::HostAttentionOptions{1, 128, 256}), c.pace ? cpdispatch_bench::pace_for(c.world) : 1.0);
  } else {
    return Kernel{};
  }
}

/// Ours: the balanced plan through ContextParallelAttention with `stages`.
template <class Kernel>
Step ours_step(const Config& c, const cpdispatch::QkvDocumentsPlan& plan, const cpdispatch::LinkModel& link, int stages,
               const std::string& trace_file = "") {
  const cpdispatch::AttentionShape shape{c.heads_q, c.heads_kv, c.head_dim, 0.125f};
  RunTrace traces(c.world, trace_file);
  const Step step = timed_world(c.world, link, [&](Link& t, auto&& time) {
    const auto share = cpdispatch::plan_qkv_for_rank(plan, t.rank());
    cpdispatch::CpAttentionOptions o{c.dedup, stages};
    o.trace = traces.of(t.rank());
    cpdispatch::ContextParallelAttention<Link, float, Kernel> op(t, share, shape, o, Kernel(make_kernel<Kernel>(c)));
    const auto nq = static_cast<std::size_t>(op.mlp_tokens() * c.heads_q * c.head_dim);
    const auto nkv = static_cast<std::size_t>(op.mlp_tokens() * c.heads_kv * c.head_dim);
    std::vector<float> q(nq, 0.01f), k(nkv, 0.02f), v(nkv, 0.03f), out(nq), dq(nq), dk(nkv), dv(nkv);
    time([&] {
      op.forward(q, k, v, out);
      op.backward(out, dq, dk, dv);
    });
  });
  traces.write();
  return step;
}

std::size_t sz(std::int64_t n) { return static_cast<std::size_t>(n); }

/// Ulysses' all-to-all inside the group of `group` consecutive ranks that holds this rank: each rank's
/// `tokens` rows [tokens][heads][D] to the group's rows [group x tokens][heads / group][D] (in rank order, this
/// rank's share of the heads), and back. Ranks outside the group get nothing.
class HeadExchange {
 public:
  HeadExchange(Link& t, std::int64_t tokens, std::int64_t group, std::int64_t head_dim, cpdispatch::StepTrace* trace = nullptr)
      : t_(t), tokens_(tokens), group_(group), dim_(head_dim), first_(t.rank() / group * group), trace_(trace) {}

  /// `call`: "forward" or "backward", for the timeline.
  void to_heads(const float* from, std::int64_t heads, float* to, const char* call = "forward") {
    const std::int64_t hg = blocks(heads);
    for (std::int64_t p = 0; p < group_; ++p)
      for (std::int64_t i = 0; i < tokens_; ++i) std::memcpy(staged(p, i, hg), from + row(i, p, heads, hg), sz(hg * dim_) * sizeof(float));
    traced(trace_, "all-to-all", call, -1, sent(), [&] { t_.all_to_all_v(staging_.data(), counts_, displs_, to, counts_, displs_); });
  }

  void to_sequence(const float* from, std::int64_t heads, float* to, const char* call = "forward") {
    const std::int64_t hg = blocks(heads);
    traced(trace_, "all-to-all", call, -1, sent(), [&] { t_.all_to_all_v(from, counts_, displs_, staging_.data(), counts_, displs_); });
    for (std::int64_t p = 0; p < group_; ++p)
      for (std::int64_t i = 0; i < tokens_; ++i) std::memcpy(to + row(i, p, heads, hg), staged(p, i, hg), sz(hg * dim_) * sizeof(float));
  }

 private:
  /// One block of `heads` / group heads to each rank of the group; returns heads / group.
  std::int64_t blocks(std::int64_t heads) {
    const std::int64_t hg = heads / group_;
    const std::size_t block = sz(tokens_ * hg * dim_) * sizeof(float);
    counts_.assign(sz(t_.world_size()), 0);
    displs_.assign(counts_.size(), 0);
    for (std::int64_t p = 0; p < group_; ++p) counts_[sz(first_ + p)] = block, displs_[sz(first_ + p)] = sz(p) * block;
    staging_.resize(sz(group_ * tokens_ * hg * dim_));
    return hg;
  }
  float* staged(std::int64_t p, std::int64_t i, std::int64_t hg) { return staging_.data() + sz((p * tokens_ + i) * hg * dim_); }
  /// Bytes this rank sends and receives in one exchange (its own block stays).
  std::int64_t sent() const {
    std::size_t n = 0;
    for (std::size_t p = 0; p < counts_.size(); ++p) n += static_cast<int>(p) == t_.rank() ? 0 : 2 * counts_[p];
    return static_cast<std::int64_t>(n);
  }
  std::size_t row(std::int64_t i, std::int64_t p, std::int64_t heads, std::int64_t hg) const { return sz((i * heads + p * hg) * dim_); }

  Link& t_;
  std::int64_t tokens_, group_, dim_, first_;
  cpdispatch::StepTrace* trace_;
  std::vector<float> staging_;
  std::vector<std::size_t> counts_, displs_;
};

/// The documents as entries on the packed batch's rows: each slice of a document (its band, in document
/// positions, holds on rows too), or the whole document, causal.
std::vector<cpdispatch::AttentionEntry> batch_entries(const std::vector<cpdispatch::BalanceDocument>& docs) {
  std::vector<cpdispatch::AttentionEntry> entries;
  std::int64_t at = 0;
  for (const auto& d : docs) {
    const std::int64_t L = length_of(d);
    if (d.slices.empty()) entries.push_back({at, L, at, L, cpdispatch::AttentionMask::causal().band()});
    for (const auto& s : d.slices) entries.push_back({at + s.q_begin, s.q_end - s.q_begin, at + s.k_begin, s.k_end - s.k_begin, s.band()});
    at += L;
  }
  return entries;
}

/// Ulysses: all-to-all from sequence to heads (every rank gets every token of heads_q / W query heads and
/// heads_kv / W key-value heads), attention over whole documents under their masks, all-to-all back;
/// backward the same with the gradients.
template <class Kernel>
Step ulysses_step(const Config& c, const std::vector<cpdispatch::BalanceDocument>& docs, const cpdispatch::LinkModel& link,
                  const std::string& trace_file = "") {
  const std::int64_t W = c.world, D = c.head_dim, T = c.tokens, total = T * W, hq = c.heads_q / W, hkv = c.heads_kv / W;
  const std::vector<cpdispatch::AttentionEntry> entries = batch_entries(docs);
  const cpdispatch::AttentionShape shape{hq, hkv, D, 0.125f};
  RunTrace traces(c.world, trace_file);
  const Step step = timed_world(c.world, link, [&](Link& t, auto&& time) {
    Kernel kernel = make_kernel<Kernel>(c);
    cpdispatch::StepTrace* trace = traces.of(t.rank());
    HeadExchange heads(t, T, W, D, trace);
    std::vector<float> x(sz(T * c.heads_q * D), 0.01f), y(x.size()), xkv(sz(T * c.heads_kv * D), 0.02f), ykv(xkv.size());
    std::vector<float> q(sz(total * hq * D)), out(q.size()), dout(q.size()), dq(q.size()), lse(sz(total * hq));
    std::vector<float> k(sz(total * hkv * D)), v(k.size()), dk(k.size()), dv(k.size());
    const std::span<const cpdispatch::AttentionEntry> e(entries);
    time([&] {
      heads.to_heads(x.data(), c.heads_q, q.data());
      heads.to_heads(xkv.data(), c.heads_kv, k.data());
      heads.to_heads(xkv.data(), c.heads_kv, v.data());
      traced(trace, "kernel", "forward", -1, 0, [&] {
        kernel.forward(shape, e, std::span<const float>(q), std::span<const float>(k), std::span<const float>(v), std::span<float>(out),
                       std::span<float>(lse));
      });
      heads.to_sequence(out.data(), c.heads_q, y.data());
      heads.to_heads(y.data(), c.heads_q, dout.data(), "backward");
      traced(trace, "kernel", "backward", -1, 0, [&] {
        kernel.backward(shape, e, std::span<const float>(q), std::span<const float>(k), std::span<const float>(v), std::span<const float>(out),
                        std::span<const float>(lse), std::span<const float>(dout), std::span<float>(dq), std::span<float>(dk), std::span<float>(dv));
      });
      heads.to_sequence(dq.data(), c.heads_q, y.data(), "backward");
      heads.to_sequence(dk.data(), c.heads_kv, ykv.data(), "backward");
      heads.to_sequence(dv.data(), c.heads_kv, ykv.data(), "backward");
    });
  });
  traces.write();
  return step;
}

/// The zig-zag layout over `groups` groups of ranks: every document padded to a multiple of 2 x groups and cut
/// into as many chunks, group g holding chunks g and 2 groups - 1 - g of each, back to back.
struct ZigZagLayout {
  int groups = 1;
  std::vector<std::int64_t> chunk{};  ///< each document's chunk length
  std::int64_t tokens = 0;            ///< a group's tokens: two chunks of every document
};
ZigZagLayout zigzag_layout(const std::vector<cpdispatch::BalanceDocument>& docs, int groups) {
  ZigZagLayout z;
  z.groups = groups;
  for (const auto& d : docs) {
    z.chunk.push_back((length_of(d) + 2 * groups - 1) / (2 * groups));
    z.tokens += 2 * z.chunk.back();
  }
  return z;
}

/// Ring attention with the zig-zag layout across groups of `group` ranks (Transformer Engine's and Megatron's
/// p2p context parallelism; rank r passes to rank r + group): groups - 1 ring steps pass the key-value blocks on
/// (isend / irecv, overlapped with the step's attention), partial outputs merged by log-sum-exp; backward passes
/// the key-values and their gradients around the ring once more, each block's gradients ending at home (in dkv).
/// The buffers hold `rows` rows (at least the layout's tokens) of `shape`'s heads; K then V in kv and dkv.
template <class Kernel>
class ZigZagRing {
 public:
  ZigZagRing(Link& t, Kernel& kernel, const ZigZagLayout& layout, std::int64_t group, std::int64_t rows, cpdispatch::AttentionShape shape)
      : q(sz(rows * shape.heads_q * shape.head_dim), 0.01f), kv(2 * sz(rows * shape.heads_kv * shape.head_dim), 0.02f), out(q.size()),
        lse(sz(rows * shape.heads_q)), dout(q.size(), 0.01f), dq(q.size()), dkv(kv.size()), t_(t), kernel_(kernel), layout_(layout),
        shape_(shape), rows_(rows), me_(static_cast<int>(t.rank() / group)), to_(static_cast<int>((t.rank() + group) % t.world_size())),
        from_(static_cast<int>((t.rank() + t.world_size() - group) % t.world_size())), kv_cur_(kv.size()), kv_next_(kv.size()),
        part_(q.size()), lse_part_(lse.size()), dkv_cur_(kv.size()), dkv_part_(kv.size()), dkv_in_(kv.size()), dkv_out_(kv.size()) {}

  std::vector<float> q, kv, out, lse, dout, dq, dkv;
  cpdispatch::StepTrace* trace = nullptr;  ///< where to record the ring's timeline (none: nothing)

  void forward() {
    const int G = layout_.groups;
    kv_cur_ = kv;
    for (int step = 0; step < G; ++step) {  // attend the block of group me - step while the next one travels
      const int src = (me_ - step + G) % G;
      std::pair<cpdispatch::Request, cpdispatch::Request> reqs{};
      if (step + 1 < G) reqs = pass();
      for (int a = 0; a < 2; ++a)
        for (int b = 0; b < 2; ++b) {
          entries_of(src, a, b);
          traced(trace, "kernel", "forward", step, 0, [&] {
            kernel_.forward(shape_, std::span<const cpdispatch::AttentionEntry>(entries_), std::span<const float>(q), k(), v(),
                            std::span<float>(part_), std::span<float>(lse_part_));
          });
          traced(trace, "merge", "forward", step, 0, [&] {
            for (const auto& x : entries_)
              cpdispatch::detail::merge_partial<float>(out, lse, std::span<const float>(part_), lse_part_, rows_, shape_.heads_q,
                                                       shape_.head_dim, x.q_start, x.q_start + x.q_len);
          });
        }
      if (step + 1 < G) wait_pass("forward", step, reqs);
    }
  }

  void backward() {
    const int G = layout_.groups;
    const std::size_t bytes = kv.size() * sizeof(float);
    kv_cur_ = kv;
    cpdispatch::Request g_send{};
    for (int step = 0; step < G; ++step) {  // each block's gradient accumulator travels with it
      const int src = (me_ - step + G) % G;
      cpdispatch::Request g_recv{};
      // The accumulator of this step's block comes from the previous rank (posted before the next block's
      // key-values, as the previous rank sends them: messages between two ranks match in posting order).
      if (step > 0) g_recv = t_.irecv(dkv_in_.data(), bytes, from_, 1);
      std::pair<cpdispatch::Request, cpdispatch::Request> reqs{};
      if (step + 1 < G) reqs = pass();
      std::fill(dkv_cur_.begin(), dkv_cur_.end(), 0.0f);
      const std::size_t n = kv.size() / 2;
      for (int a = 0; a < 2; ++a)
        for (int b = 0; b < 2; ++b) {
          entries_of(src, a, b);
          traced(trace, "kernel", "backward", step, 0, [&] {
            kernel_.backward(shape_, std::span<const cpdispatch::AttentionEntry>(entries_), std::span<const float>(q), k(), v(),
                             std::span<const float>(out), std::span<const float>(lse), std::span<const float>(dout), std::span<float>(dq),
                             std::span<float>(dkv_part_.data(), n), std::span<float>(dkv_part_.data() + n, n));
          });
          traced(trace, "sum", "backward", step, 0, [&] {
            for (std::size_t i = 0; i < kv.size(); ++i) dkv_cur_[i] += dkv_part_[i];  // a ring adds each pair's share (timed as such)
          });
        }
      if (step > 0) {
        traced(trace, "wait", "backward", step, static_cast<std::int64_t>(bytes), [&] { t_.wait(g_recv); });
        traced(trace, "sum", "backward", step, 0, [&] {
          for (std::size_t i = 0; i < kv.size(); ++i) dkv_cur_[i] += dkv_in_[i];
        });
        traced(trace, "wait", "backward", step, static_cast<std::int64_t>(bytes), [&] { t_.wait(g_send); });  // the previous accumulator has left
      }
      std::swap(dkv_cur_, dkv_out_);
      g_send = t_.isend(dkv_out_.data(), bytes, to_, 1);  // the last one goes home
      if (step + 1 < G) wait_pass("backward", step, reqs);
    }
    const cpdispatch::Request home = t_.irecv(dkv.data(), bytes, from_, 1);  // this rank's own block's gradients
    traced(trace, "wait", "backward", G, static_cast<std::int64_t>(2 * bytes), [&] {
      t_.wait(g_send);
      t_.wait(home);
    });
  }

 private:
  std::span<const float> k() const { return {kv_cur_.data(), kv_cur_.size() / 2}; }
  std::span<const float> v() const { return {kv_cur_.data() + kv_cur_.size() / 2, kv_cur_.size() / 2}; }

  /// The entries of Q chunk a (0: chunk me, 1: chunk 2G-1-me) against block chunk b of group `src`: causal in
  /// document positions, where the query chunk starts (qa - kb) * ch after the key chunk, so the band on buffer
  /// rows is t - j <= (qa - kb) * ch + (b - a) * ch.
  void entries_of(int src, int a, int b) {
    const int G = layout_.groups;
    entries_.clear();
    std::int64_t at = 0;
    const int qa = a == 0 ? me_ : 2 * G - 1 - me_, kb = b == 0 ? src : 2 * G - 1 - src;
    for (const std::int64_t ch : layout_.chunk) {
      if (kb <= qa) entries_.push_back({at + a * ch, ch, at + b * ch, ch, {cpdispatch::Band::unbounded_lo, (qa - kb + b - a) * ch}});
      at += 2 * ch;
    }
  }

  /// Waits for a ring step's pass (its key-values out and the next block in), then takes the next block.
  void wait_pass(const char* call, int step, std::pair<cpdispatch::Request, cpdispatch::Request> reqs) {
    traced(trace, "wait", call, step, static_cast<std::int64_t>(2 * kv_cur_.size() * sizeof(float)), [&] {
      t_.wait(reqs.first);
      t_.wait(reqs.second);
    });
    std::swap(kv_cur_, kv_next_);
  }

  /// The key-values held now to the next group, the previous group's into kv_next_.
  std::pair<cpdispatch::Request, cpdispatch::Request> pass() {
    const std::size_t bytes = kv_cur_.size() * sizeof(float);
    return {t_.isend(kv_cur_.data(), bytes, to_, 0), t_.irecv(kv_next_.data(), bytes, from_, 0)};
  }

  Link& t_;
  Kernel& kernel_;
  const ZigZagLayout& layout_;
  cpdispatch::AttentionShape shape_;
  std::int64_t rows_;
  int me_, to_, from_;
  std::vector<float> kv_cur_, kv_next_, part_, lse_part_, dkv_cur_, dkv_part_, dkv_in_, dkv_out_;
  std::vector<cpdispatch::AttentionEntry> entries_;
};

/// USP: Ulysses inside groups of `group` consecutive ranks, the zig-zag ring across the W / group groups. A
/// group's tokens (its two chunks of every document) lie spread over its ranks' MLP layouts; the all-to-all
/// gives each of them all those tokens on heads / group heads, which the ring attends. group = 1 is ring
/// attention alone (no all-to-all).
template <class Kernel>
Step usp_step(const Config& c, const std::vector<cpdispatch::BalanceDocument>& docs, const cpdispatch::LinkModel& link, std::int64_t group,
              const std::string& trace_file = "") {
  const ZigZagLayout layout = zigzag_layout(docs, static_cast<int>(c.world / group));
  const std::int64_t T = (layout.tokens + group - 1) / group, D = c.head_dim;  // T: a rank's MLP tokens
  const cpdispatch::AttentionShape shape{c.heads_q / group, c.heads_kv / group, D, 0.125f};
  RunTrace traces(c.world, trace_file);
  const Step step = timed_world(c.world, link, [&](Link& t, auto&& time) {
    Kernel kernel = make_kernel<Kernel>(c);
    ZigZagRing<Kernel> ring(t, kernel, layout, group, group * T, shape);
    ring.trace = traces.of(t.rank());
    HeadExchange heads(t, T, group, D, ring.trace);
    const std::size_t half = ring.kv.size() / 2;  // K, then V
    std::vector<float> x(sz(T * c.heads_q * D), 0.01f), y(x.size()), xkv(sz(T * c.heads_kv * D), 0.02f), ykv(xkv.size());
    time([&] {
      if (group > 1) {
        heads.to_heads(x.data(), c.heads_q, ring.q.data());
        heads.to_heads(xkv.data(), c.heads_kv, ring.kv.data());
        heads.to_heads(xkv.data(), c.heads_kv, ring.kv.data() + half);
      }
      ring.forward();
      if (group > 1) {
        heads.to_sequence(ring.out.data(), c.heads_q, y.data());
        heads.to_heads(y.data(), c.heads_q, ring.dout.data(), "backward");
      }
      ring.backward();
      if (group > 1) {
        heads.to_sequence(ring.dq.data(), c.heads_q, y.data(), "backward");
        heads.to_sequence(ring.dkv.data(), c.heads_kv, ykv.data(), "backward");
        heads.to_sequence(ring.dkv.data() + half, c.heads_kv, ykv.data(), "backward");
      }
    });
  });
  traces.write();
  return step;
}

using bench::median;

}  // namespace

/// The layer as the step model sees it: float elements, 2 stages.
cpdispatch::LayerShape layer_shape(const Config& c) {
  cpdispatch::LayerShape shape{c.heads_q, c.head_dim, 4, c.plan_stages};
  shape.heads_kv = c.heads_kv;
  return shape;
}

/// The USP group sizes this config can run (1 < u < W; u = 1 is the ring, u = W Ulysses, run as such).
std::vector<std::int64_t> usp_groups(const Config& c) { return cpdispatch::usp_groups(c.world, layer_shape(c)); }

/// Key-value bytes (K and V, forward) the busiest rank sends or receives: ours from the plan's exchange,
/// Ulysses' all-to-all (every token's key-value heads but a rank's own share).
double ours_kv_bytes(const Config& c, const cpdispatch::QkvDocumentsPlan& plan) {
  return cpdispatch::max_kv_tokens_per_rank(cpdispatch::plan_qkv(plan).kv_fwd, c.dedup) * 2.0 * static_cast<double>(c.heads_kv * c.head_dim * 4);
}
double ulysses_kv_bytes(const Config& c) {
  return static_cast<double>((c.world - 1) * c.tokens * (c.heads_kv / c.world) * c.head_dim * 4) * 2.0;
}

/// One batch, drawn and planned, and what it measured over an instant link.
struct Batch {
  std::string name;
  int index = 0;
  cpdispatch::BalanceProblem problem{};
  cpdispatch::QkvDocumentsPlan plan{};
  double compute = 0;          ///< ours over an instant link, s
  double rate = 0;             ///< the kernel's FLOP rate per rank, all ranks computing at once
  bool bytes_printed = false;  ///< bytes and work do not depend on the link: printed once a batch
  std::optional<cpdispatch::KernelRates> kernel{};  ///< --model-check: the kernel priced by its entries
};

/// A link the batch runs over: its name, its --links option and its bandwidth (bytes a second).
struct LinkRun {
  const char* name;
  const char* option;
  double bandwidth;
};

using Ratios = std::map<std::string, std::vector<double>>;

/// --trace's file for one run of a batch over a link: PREFIX-<sample>-b<batch>-<link>-<run>.json (none without --trace).
std::string trace_name(const Config& c, const Batch& batch, const LinkRun& l, const std::string& run) {
  return c.trace.empty() ? "" : c.trace + "-" + batch.name + "-b" + std::to_string(batch.index) + "-" + l.option + "-" + run + ".json";
}

cpdispatch::ClusterModel link_cluster(const Config& c, const Batch& batch, double bandwidth);

/// --model-check: one method's modelled step (`model` of a cluster: one rate, then the kernel's entries) beside
/// the measured one.
template <class Model>
void model_check(const Config& c, const Batch& batch, const LinkRun& l, const std::string& method, double measured, Model&& model,
                 Ratios& ratios_of) {
  if (!c.model_check) return;
  cpdispatch::ClusterModel cluster = link_cluster(c, batch, l.bandwidth);
  const double one_rate = model(cluster);
  cluster.kernel = batch.kernel;
  const double by_entries = model(cluster);
  std::printf("%s batch %d | %s | model check %s | measured %.1f ms | modelled, one rate %.1f ms (%.2f) | by entries %.1f ms (%.2f)\n",
              batch.name.c_str(), batch.index, l.name, method.c_str(), measured * 1e3, one_rate * 1e3, one_rate / measured, by_entries * 1e3,
              by_entries / measured);
  const std::string key = batch.name + "|" + l.name + "|modelled/measured, ";
  ratios_of[key + "one rate, " + method].push_back(one_rate / measured);
  ratios_of[key + "by entries, " + method].push_back(by_entries / measured);
}

/// The step model's step of ours: the plan's exchange (dedup or flat, as the op runs it) at `stages`.
double modelled_ours(const Config& c, const cpdispatch::QkvDocumentsPlan& plan, const cpdispatch::ClusterModel& cluster, int stages) {
  cpdispatch::LayerShape shape = layer_shape(c);
  shape.stages = stages;
  const auto rows = cpdispatch::model_plan(cpdispatch::plan_qkv(plan), cpdispatch::plan_cost(plan), cpdispatch::Topology::uniform(c.world, c.world),
                                           cluster, shape);
  return rows[c.dedup ? 1 : 0].step;
}

/// Ours with the balanced plan at each of --stages (and its bound where asked): the best step (1e300 when not
/// run) and the bytes it moved.
Step run_balanced(const Config& c, const Batch& batch, const LinkRun& l, Ratios& ratios_of) {
  const cpdispatch::LinkModel link{std::chrono::nanoseconds{0}, l.bandwidth};
  const std::string key = batch.name + "|" + l.name + "|";
  const Step comm = c.bound && c.balanced ? ours_step<NoKernel>(c, batch.plan, link, 1) : Step{};  // the bound is the balanced plan's
  Step best{1e300, 0};
  double one_stage = 0;
  for (const int stages : c.balanced ? c.stages : std::vector<int>{}) {
    const Step ours = ours_step<HostDevice>(c, batch.plan, link, stages, trace_name(c, batch, l, "s" + std::to_string(stages)));
    if (ours.seconds < best.seconds) best.seconds = ours.seconds;
    best.bytes = ours.bytes;
    std::printf("%s batch %d | %s | ours stages=%d | step %.1f ms | compute %.1f ms", batch.name.c_str(), batch.index, l.name, stages,
                ours.seconds * 1e3, batch.compute * 1e3);
    if (c.bound) {
      const double bound = std::max(batch.compute, comm.seconds) + std::min(batch.compute, comm.seconds) / stages;
      std::printf(" | comm %.1f ms | step/bound %.2f", comm.seconds * 1e3, ours.seconds / bound);
      ratios_of[key + "overlap s" + std::to_string(stages)].push_back(ours.seconds / bound);
    }
    std::printf("\n");
    model_check(c, batch, l, "ours stages=" + std::to_string(stages), ours.seconds,
                [&](const cpdispatch::ClusterModel& m) { return modelled_ours(c, batch.plan, m, stages); }, ratios_of);
    if (stages == 1) one_stage = ours.seconds;
    if (one_stage > 0) ratios_of[key + "gain over stages=1, s" + std::to_string(stages)].push_back(one_stage / ours.seconds);
  }
  return best;
}

/// The link as the step model's cluster: one tier of its bandwidth, no latency, the kernel's rate.
cpdispatch::ClusterModel link_cluster(const Config& c, const Batch& batch, double bandwidth) {
  cpdispatch::ClusterModel cluster;
  cluster.intra = cluster.inter = {bandwidth, 0.0};
  cluster.attention_flops = batch.rate;
  cluster.ranks_per_node = c.world;
  return cluster;
}

/// --trace: the step model's timeline of ours with `plan` (model_plan_trace; the kernel priced by its entries
/// where --model-check fitted them, else at the batch's FLOP rate), to `file` beside the measured one.
void write_predicted(const Config& c, const Batch& batch, const LinkRun& l, const cpdispatch::QkvDocumentsPlan& plan, const std::string& file) {
  if (file.empty()) return;
  cpdispatch::ClusterModel cluster = link_cluster(c, batch, l.bandwidth);
  cluster.kernel = batch.kernel;
  const std::vector<cpdispatch::StepTrace> ranks = cpdispatch::model_plan_trace(
      cpdispatch::plan_qkv(plan), cpdispatch::plan_cost(plan), cpdispatch::Topology::uniform(c.world, c.world), cluster, layer_shape(c), c.dedup);
  std::vector<const cpdispatch::StepTrace*> all;
  for (const auto& t : ranks) all.push_back(&t);
  std::ofstream out(file);
  cpdispatch::write_chrome_trace(out, all);
  std::printf("  (predicted timeline: %s)\n", file.c_str());
}

/// USP at every group size it can run, the fastest kept (`u`), beside the group size the step model picks.
struct UspRun {
  Step step{};
  std::int64_t u = 0, model_u = 0;
};
UspRun run_usp(const Config& c, const Batch& batch, const LinkRun& l, const cpdispatch::ClusterModel& cluster) {
  const cpdispatch::LinkModel link{std::chrono::nanoseconds{0}, l.bandwidth};
  std::vector<std::int64_t> lengths;
  for (const auto& d : batch.problem.documents) lengths.push_back(length_of(d));
  UspRun best;
  for (const std::int64_t u : usp_groups(c)) {
    const Step s = usp_step<HostDevice>(c, batch.problem.documents, link, u, trace_name(c, batch, l, "usp" + std::to_string(u)));
    if (best.u == 0 || s.seconds < best.step.seconds) best.step = s, best.u = u;
  }
  best.model_u = cpdispatch::model_usp_best(lengths, cpdispatch::AttentionMask::causal(), c.world, cluster, layer_shape(c)).group;
  return best;
}

/// What one batch measured over one link.
struct LinkResult {
  Step ours{}, modelled{}, ulysses{}, ring{};
  cpdispatch::ClusterPlan chosen{};
  UspRun usp{};
};

/// The bytes each method moves and the balance of the work: printed once a batch (they do not depend on the link).
void print_bytes(const Config& c, Batch& batch, const LinkRun& l, const LinkResult& m, Ratios& ratios_of) {
  if (batch.bytes_printed) return;
  batch.bytes_printed = true;
  std::printf("%s batch %d | most bytes a rank sends or receives per step (MiB):", batch.name.c_str(), batch.index);
  if (c.balanced) std::printf(" ours %.1f,", m.ours.bytes / 1048576.0);
  std::printf(" the step model's plan (%s) %.1f", l.option, m.modelled.bytes / 1048576.0);
  if (c.ulysses) std::printf(", ulysses %.1f", m.ulysses.bytes / 1048576.0);
  if (c.ring) std::printf(", ring %.1f", m.ring.bytes / 1048576.0);
  if (c.usp) std::printf(", USP u=%lld %.1f", static_cast<long long>(m.usp.u), m.usp.step.bytes / 1048576.0);
  if (c.shared_prefix > 0) {
    std::printf(" | key-value MiB a rank (forward):");
    if (c.balanced) std::printf(" ours %.1f,", ours_kv_bytes(c, batch.plan) / 1048576.0);
    std::printf(" the step model's plan (%s) %.1f, ulysses %.1f", l.option, ours_kv_bytes(c, m.chosen.plan) / 1048576.0,
                ulysses_kv_bytes(c) / 1048576.0);
  }
  const cpdispatch::PlanCost cost = cpdispatch::plan_cost(batch.plan);
  const double ours_imbalance = imbalance(std::vector<double>(cost.attention.begin(), cost.attention.end()));
  std::printf(" | attention work max/mean: ours %.3f, ulysses 1.000", ours_imbalance);
  ratios_of[batch.name + "|imbalance ours"].push_back(ours_imbalance);
  if (c.ring) {  // the causal zig-zag layout's (the ring runs no slices)
    const double ring_imbalance = imbalance(zigzag_pairs(batch.problem.documents, c.world));
    std::printf(", ring %.3f", ring_imbalance);
    ratios_of[batch.name + "|imbalance ring zig-zag"].push_back(ring_imbalance);
  }
  std::printf("\n");
  if (c.ulysses && c.balanced) ratios_of[batch.name + "|bytes ours/ulysses"].push_back(m.ours.bytes / m.ulysses.bytes);
  if (c.ring && c.balanced) ratios_of[batch.name + "|bytes ours/ring"].push_back(m.ours.bytes / m.ring.bytes);
}

/// One batch over one link: ours (balanced, at each stage count), ours with the plan the step model picks for
/// the link (plan_for_cluster: as balanced as pays, at --plan-stages), and the peers.
void run_link(const Config& c, Batch& batch, const LinkRun& l, Ratios& ratios_of) {
  const cpdispatch::LinkModel link{std::chrono::nanoseconds{0}, l.bandwidth};
  const std::string key = batch.name + "|" + l.name + "|";
  const char* name = batch.name.c_str();
  const auto& docs = batch.problem.documents;
  LinkResult m;
  m.ours = run_balanced(c, batch, l, ratios_of);
  const cpdispatch::ClusterModel cluster = link_cluster(c, batch, l.bandwidth);
  cpdispatch::BalanceOptions chosen_options;
  chosen_options.dedup = c.dedup;
  chosen_options.head_parallel = c.head_parallel ? cpdispatch::HeadParallel::automatic : cpdispatch::HeadParallel::off;
  m.chosen = cpdispatch::plan_for_cluster(batch.problem, cluster, layer_shape(c), cpdispatch::Topology::uniform(c.world, c.world), chosen_options);
  m.modelled = ours_step<HostDevice>(c, m.chosen.plan, link, c.plan_stages,
                                                         trace_name(c, batch, l, "model-s" + std::to_string(c.plan_stages)));
  std::printf("%s batch %d | %s | ours, the step model's plan (cost slack %.2f), stages=%d | step %.1f ms | %.1f MiB", name, batch.index, l.name,
              m.chosen.cost_slack, c.plan_stages, m.modelled.seconds * 1e3, m.modelled.bytes / 1048576.0);
  if (c.shared_prefix > 0) std::printf(" | key-value %.1f MiB a rank (forward)", ours_kv_bytes(c, m.chosen.plan) / 1048576.0);
  const auto hp = std::count_if(m.chosen.plan.documents.begin(), m.chosen.plan.documents.end(), [](const auto& d) { return d.head_parallel; });
  if (hp > 0) std::printf(" | %ld head-parallel document(s), groups of %lld", static_cast<long>(hp), static_cast<long long>(cpdispatch::detail::head_parallel_degree(m.chosen.plan)));
  std::printf("\n");
  write_predicted(c, batch, l, m.chosen.plan, trace_name(c, batch, l, "model-s" + std::to_string(c.plan_stages) + "-predicted"));
  model_check(c, batch, l, "ours (step model's plan) stages=" + std::to_string(c.plan_stages), m.modelled.seconds,
              [&](const cpdispatch::ClusterModel& mc) { return modelled_ours(c, m.chosen.plan, mc, c.plan_stages); }, ratios_of);
  std::vector<double> peers;
  const auto peer = [&](const std::string& what, const std::string& detail, const Step& s) {
    std::printf("%s batch %d | %s | %s%s | step %.1f ms", name, batch.index, l.name, what.c_str(), detail.c_str(), s.seconds * 1e3);
    if (c.balanced) std::printf(" | ours (best stages) / %s %.2f", what.c_str(), m.ours.seconds / s.seconds);
    std::printf(" | the step model's plan / %s %.2f\n", what.c_str(), m.modelled.seconds / s.seconds);
    if (c.balanced) ratios_of[key + "ours/" + what].push_back(m.ours.seconds / s.seconds);
    ratios_of[key + "ours (step model's plan)/" + what].push_back(m.modelled.seconds / s.seconds);
    peers.push_back(s.seconds);
  };
  if (c.ulysses) {
    char kv[64] = "";
    if (c.shared_prefix > 0) std::snprintf(kv, sizeof kv, " (key-value %.1f MiB a rank, forward)", ulysses_kv_bytes(c) / 1048576.0);
    peer("ulysses", kv, m.ulysses = ulysses_step<HostDevice>(c, docs, link, trace_name(c, batch, l, "ulysses")));
  }
  if (c.ring) peer("ring zig-zag", "", m.ring = usp_step<HostDevice>(c, docs, link, 1, trace_name(c, batch, l, "ring")));
  std::vector<std::int64_t> lengths;
  std::vector<std::vector<cpdispatch::AttentionSlice>> slices;
  for (const auto& d : docs) lengths.push_back(length_of(d)), slices.push_back(d.slices);
  if (c.shared_prefix == 0) slices.clear();
  const auto causal = cpdispatch::AttentionMask::causal();
  if (c.ulysses) {
    model_check(c, batch, l, "ulysses", m.ulysses.seconds, [&](const cpdispatch::ClusterModel& cl) {
      return cpdispatch::model_ulysses(lengths, causal, c.world, cl, layer_shape(c), slices).step;
    }, ratios_of);
  }
  if (c.ring) {
    model_check(c, batch, l, "ring zig-zag", m.ring.seconds, [&](const cpdispatch::ClusterModel& cl) {
      return cpdispatch::model_zigzag_ring(lengths, causal, c.world, cl, layer_shape(c), slices).step;
    }, ratios_of);
  }
  if (c.usp) {
    m.usp = run_usp(c, batch, l, cluster);
    peer("USP", " u=" + std::to_string(m.usp.u) + " (the step model picks u=" + std::to_string(m.usp.model_u) + ")", m.usp.step);
  }
  if (peers.size() > 1) {
    const double better = *std::min_element(peers.begin(), peers.end());
    if (c.balanced) ratios_of[key + "ours/better peer"].push_back(m.ours.seconds / better);
    ratios_of[key + "ours (step model's plan)/better peer"].push_back(m.modelled.seconds / better);
  }
  print_bytes(c, batch, l, m, ratios_of);
}

/// "ulysses,ring,usp" (any of them; "both": ulysses and ring; "all": the three) into the config; false on a bad item.
bool parse_peers(const std::string& text, Config& c) {
  if (text == "both" || text == "all") {
    c.ulysses = c.ring = true, c.usp = text == "all";
    return true;
  }
  c.ulysses = c.ring = c.usp = false;
  std::size_t at = 0;
  while (at <= text.size()) {
    const std::size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    if (item == "ulysses") c.ulysses = true;
    else if (item == "ring") c.ring = true;
    else if (item == "usp") c.usp = true;
    else return false;
    at = comma + 1;
  }
  return true;
}

/// The options into `c`; a message for the first bad one, empty when all are good.
std::string parse_options(int argc, char** argv, Config& c) {
  for (int i = 1; i < argc; i += 2) {
    const std::string a = argv[i];
    if (i + 1 == argc) return a + ": every option takes a value (the options: the top of bench_cp_attention.cpp)";
    const std::string text = argv[i + 1];
    const long long v = std::atoll(text.c_str());
    if (a == "--sample") c.sample = text;
    else if (a == "--trace") c.trace = text;
    else if (a == "--lengths") c.lengths = text;
    else if (a == "--first-batch") c.first_batch = static_cast<int>(v);
    else if (a == "--world") c.world = static_cast<int>(v);
    else if (a == "--tokens") c.tokens = v;
    else if (a == "--batches") c.batches = static_cast<int>(v);
    else if (a == "--heads") c.heads_q = c.heads_kv = v;
    else if (a == "--heads-q") c.heads_q = v;
    else if (a == "--heads-kv") c.heads_kv = v;
    else if (a == "--head-dim") c.head_dim = v;
    else if (a == "--shared-prefix") c.shared_prefix = v;
    else if (a == "--dedup") c.dedup = v != 0;
    else if (a == "--links") c.links = text;
    else if (a == "--peers") {
      if (!parse_peers(text, c)) return "--peers is a comma-separated list of ulysses, ring and usp (or both, all), got " + text;
    } else if (a == "--stages") c.stages = stage_list(text);
    else if (a == "--plan-stages") c.plan_stages = static_cast<int>(v);
    else if (a == "--bound") c.bound = v != 0;
    else if (a == "--balanced") c.balanced = v != 0;
    else if (a == "--model-check") c.model_check = static_cast<int>(v);
    else if (a == "--head-parallel") {
      if (text != "off" && text != "auto") return "--head-parallel is off or auto, got " + text;
      c.head_parallel = text == "auto";
    }
    else if (a == "--kernel-rate") c.kernel_rate = text;
    else if (a == "--pace") c.pace = v != 0;
    else return "unknown option " + a;
  }
  return {};
}

/// Why the config cannot run; empty when it can.
std::string check_config(const Config& c) {
  const auto n = [](std::int64_t x) { return std::to_string(x); };
  if (c.world < 1 || c.tokens < 1 || c.head_dim < 1) return "--world, --tokens and --head-dim must be at least 1";
  if (c.heads_q < 1 || c.heads_kv < 1 || c.heads_q % c.heads_kv != 0) {
    return "--heads-q " + n(c.heads_q) + " must be a multiple of --heads-kv " + n(c.heads_kv) + " (both at least 1)";
  }
  if (c.ulysses && (c.heads_q % c.world != 0 || c.heads_kv % c.world != 0)) {
    return "Ulysses splits the heads over the ranks: --heads-q " + n(c.heads_q) + " and --heads-kv " + n(c.heads_kv) +
           " must divide by --world " + n(c.world) + " (or leave ulysses out of --peers)";
  }
  if (c.usp && usp_groups(c).empty()) {
    return "USP needs a group size u with 1 < u < --world " + n(c.world) + " dividing it, --heads-q " + n(c.heads_q) + " and --heads-kv " +
           n(c.heads_kv) + " (or leave usp out of --peers)";
  }
  if (c.shared_prefix < 0) return "--shared-prefix " + n(c.shared_prefix) + " must be at least 0";
  if (c.shared_prefix > 0 && (c.ring || c.usp)) return "--shared-prefix runs ours and Ulysses only: add --peers ulysses";
  if (!c.lengths.empty() && c.sample != "both") return "--lengths and --sample name two samples: give one";
  if (c.sample != "both" && c.sample != "prolong" && c.sample != "wlbllm") return "--sample " + c.sample + " is not prolong, wlbllm or both";
  if (c.first_batch < 0 || c.batches < 1) return "--first-batch >= 0 and --batches >= 1";
  if (c.links != "ib" && c.links != "nvlink" && c.links != "none" && c.links != "both") return "--links is ib, nvlink, none or both";
  if (c.stages.empty()) return "--stages is a comma-separated list of stage counts >= 1";
  if (c.plan_stages < 1) return "--plan-stages " + n(c.plan_stages) + " must be at least 1";
  return {};
}

/// Seconds of one pass of the host kernel over one entry with all W ranks running it at once, as in a step:
/// the slowest rank's, the median of three runs (a step meets the machine's load as it is, not at its best).
/// A short entry runs as copies on their own rows of buffers up to 8192 rows, in one call (as a step's layout
/// holds many), repeated up to 0.2 GFLOP a rank: the ranks then share the cores and the caches as in a step,
/// rather than each finishing alone, in cache, inside one time slice.
cpdispatch::KernelSample time_on_every_rank(const Config& c, const cpdispatch::AttentionEntry& e, std::int64_t hq, std::int64_t hkv,
                                            bool backward) {
  const cpdispatch::AttentionShape shape{hq, hkv, c.head_dim, 0.125f};
  const double flops = (backward ? 2.5 : 1.0) * cpdispatch::kernel_entry(e, hq, c.head_dim).forward_flops();
  const std::int64_t copies = std::clamp<std::int64_t>(static_cast<std::int64_t>(0.2e9 / flops), 1, std::max<std::int64_t>(1, 8192 / e.kv_len));
  const int calls = static_cast<int>(std::clamp(std::ceil(0.2e9 / (flops * static_cast<double>(copies))), 1.0, 1000.0));
  std::vector<cpdispatch::AttentionEntry> entries;
  for (std::int64_t i = 0; i < copies; ++i) {  // copy i's rows and columns start i x q_len and i x kv_len on: its band shifts
    entries.push_back({i * e.q_len, e.q_len, i * e.kv_len, e.kv_len, e.band.shifted(i * (e.kv_len - e.q_len))});
  }
  cpdispatch::SimWorld world(c.world);
  std::vector<double> seconds(sz(c.world)), runs;
  for (int run = 0; run < 3; ++run) {
    world.run([&](cpdispatch::SimTransport& sim) {
      auto kernel = make_kernel<HostDevice>(c);
      const std::size_t nq = sz(copies * e.q_len * hq * c.head_dim), nk = sz(copies * e.kv_len * hkv * c.head_dim);
      std::vector<float> q(nq, 0.01f), k(nk, 0.02f), v(nk, 0.03f), out(nq), dout(nq, 0.01f), dq(nq), dk(nk), dv(nk), lse(sz(copies * e.q_len * hq));
      const std::span<const float> cq(q), ck(k), cv(v);
      kernel.forward(shape, std::span<const cpdispatch::AttentionEntry>(entries), cq, ck, cv, std::span<float>(out), std::span<float>(lse));
      sim.barrier();
      const auto start = Clock::now();
      for (int i = 0; i < calls; ++i) {
        if (backward) {
          kernel.backward(shape, std::span<const cpdispatch::AttentionEntry>(entries), cq, ck, cv, std::span<const float>(out),
                          std::span<const float>(lse), std::span<const float>(dout), std::span<float>(dq), std::span<float>(dk), std::span<float>(dv));
        } else {
          kernel.forward(shape, std::span<const cpdispatch::AttentionEntry>(entries), cq, ck, cv, std::span<float>(out), std::span<float>(lse));
        }
      }
      seconds[sz(sim.rank())] = std::chrono::duration<double>(Clock::now() - start).count() / static_cast<double>(calls * copies);
    });
    runs.push_back(*std::max_element(seconds.begin(), seconds.end()));
  }
  return {cpdispatch::kernel_entry(e, hq, c.head_dim), median(runs)};
}

/// The host kernel's rates, fitted to a short sweep run by all W ranks at once: for each head count the
/// methods run (ours and the ring all heads, Ulysses heads / W, USP heads / u), square causal and full entries
/// and causal query shards at the end of their keys (L / 4 x L), L = 64, 128, ... while a case's FLOPs a rank
/// stay under 4 GFLOP (longer entries run near the rate of the longest measured).
cpdispatch::KernelRates fit_host_rates(const Config& c) {
  std::vector<std::pair<std::int64_t, std::int64_t>> heads{{c.heads_q, c.heads_kv}};
  if (c.ulysses) heads.emplace_back(c.heads_q / c.world, c.heads_kv / c.world);
  for (const std::int64_t u : c.usp ? usp_groups(c) : std::vector<std::int64_t>{}) heads.emplace_back(c.heads_q / u, c.heads_kv / u);
  std::vector<cpdispatch::KernelSample> forward, backward;
  const auto causal = cpdispatch::AttentionMask::causal().band();
  for (const auto& [hq, hkv] : heads)
    for (std::int64_t L = 64; L <= 8192; L *= 2) {
      const cpdispatch::AttentionEntry entries[] = {{0, L, 0, L, causal}, {0, L, 0, L, {}}, {0, L / 4, 0, L, causal.shifted(L - L / 4)}};
      for (const cpdispatch::AttentionEntry& e : entries) {
        if (3.5 * cpdispatch::kernel_entry(e, hq, c.head_dim).forward_flops() > 4e9) continue;
        forward.push_back(time_on_every_rank(c, e, hq, hkv, false));
        backward.push_back(time_on_every_rank(c, e, hq, hkv, true));
      }
    }
  const cpdispatch::KernelRates rates{cpdispatch::fit_kernel_rate(forward, 1.0), cpdispatch::fit_kernel_rate(backward, 2.5)};
  double worst = 0;
  for (std::size_t i = 0; i < forward.size(); ++i) {
    const cpdispatch::KernelEntry& e = forward[i].entry;
    const double f = rates.forward_seconds(e) / forward[i].seconds, b = rates.backward_seconds(e) / backward[i].seconds;
    worst = std::max({worst, std::abs(f - 1), std::abs(b - 1)});
    if (c.model_check < 2) continue;
    std::printf("kernel sweep | %lld x %lld, %lld heads, %s | forward %.3f ms, %.2f GFLOP/s, model %+.0f %% | backward %.3f ms, %.2f GFLOP/s, model %+.0f %%\n",
                static_cast<long long>(e.q_len), static_cast<long long>(e.kv_len), static_cast<long long>(e.heads_q), e.cut ? "cut" : "whole",
                forward[i].seconds * 1e3, e.forward_flops() / forward[i].seconds * 1e-9, 100 * (f - 1), backward[i].seconds * 1e3,
                2.5 * e.forward_flops() / backward[i].seconds * 1e-9, 100 * (b - 1));
  }
  std::printf("host kernel, %d ranks at once, fitted to %zu entries (worst error %.0f %%): --kernel-rate forward:%s/backward:%s\n", c.world,
              forward.size(), 100 * worst, to_string(rates.forward).c_str(), to_string(rates.backward).c_str());
  return rates;
}

/// --kernel-rate "forward:peak=...,pair_seconds=...,.../backward:..." (bench_attention --sweep's line); exits on a bad one.
cpdispatch::KernelRates parse_kernel_rates(const std::string& text) {
  cpdispatch::KernelRates rates;
  const auto bad = [&](const std::string& why) {
    std::fprintf(stderr, "bench_cp_attention: --kernel-rate %s: %s\n", text.c_str(), why.c_str());
    std::exit(2);
  };
  std::size_t at = 0;
  while (at < text.size()) {
    const std::size_t end = std::min(text.find('/', at), text.size()), colon = text.find(':', at);
    if (colon >= end) bad("each part is forward:... or backward:...");
    const std::string pass = text.substr(at, colon - at);
    if (pass != "forward" && pass != "backward") bad("\"" + pass + "\" is not forward or backward");
    cpdispatch::KernelRate& r = pass == "forward" ? rates.forward : rates.backward;
    for (std::size_t p = colon + 1; p < end;) {
      const std::size_t comma = std::min(text.find(',', p), end), eq = text.find('=', p);
      if (eq >= comma) bad("each term is name=value");
      const std::string name = text.substr(p, eq - p);
      const double value = std::atof(text.substr(eq + 1, comma - eq - 1).c_str());
      if (name == "peak") r.peak = value;
      else if (name == "pair_seconds") r.pair_seconds = value;
      else if (name == "row_seconds") r.row_seconds = value;
      else if (name == "cut_row_seconds") r.cut_row_seconds = value;
      else if (name == "entry_seconds") r.entry_seconds = value;
      else bad("unknown term " + name);
      p = comma + 1;
    }
    at = end + 1;
  }
  try {
    rates.check();
  } catch (const cpdispatch::invalid_input& e) {
    bad(e.what());
  }
  return rates;
}

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // a line as soon as it is measured
  Config c;
  std::string bad = parse_options(argc, argv, c);
  if (bad.empty()) bad = check_config(c);
  if (!bad.empty()) return std::fprintf(stderr, "bench_cp_attention: %s\n", bad.c_str()), 2;
  const auto lengths_of = samples(c);  // read before anything is printed: a bad file stops here
  const cpdispatch::LinkModel instant{std::chrono::nanoseconds{0}, 1e15};
  struct Ratio {
    const char* name;
    const char* option;
    double bytes_per_flop;
  };
  const Ratio ratios[] = {{"IB 50 GB/s", "ib", 50e9 / 400e12}, {"NVLink 450 GB/s", "nvlink", 450e9 / 400e12}, {"no link", "none", 1e6}};
  std::printf("bench_cp_attention: W = %d ranks x %lld tokens, %lld query / %lld key-value heads x %lld, float; %d batches per sample; ours %s dedup",
              c.world, static_cast<long long>(c.tokens), static_cast<long long>(c.heads_q), static_cast<long long>(c.heads_kv),
              static_cast<long long>(c.head_dim), c.batches, c.dedup ? "with" : "without");
  if (c.shared_prefix > 0) std::printf("; each document a prompt and %lld responses", static_cast<long long>(c.shared_prefix));
  std::printf("\n");
  std::optional<cpdispatch::KernelRates> kernel;
  if (c.model_check) kernel = c.kernel_rate.empty() ? fit_host_rates(c) : parse_kernel_rates(c.kernel_rate);
  std::map<std::string, std::vector<double>> ratios_of;  // "sample|link|what" -> per batch
  for (const auto& [name, lengths] : lengths_of) {
    for (int b = c.first_batch; b < c.first_batch + c.batches; ++b) {
      cpdispatch::BalanceProblem p;
      p.world_size = c.world;
      p.documents = cpdispatch::draw_workload(lengths, c.world, c.tokens, static_cast<std::uint64_t>(b));
      if (c.shared_prefix > 0)
        for (auto& d : p.documents) d.slices = shared_prefix(length_of(d), c.shared_prefix);
      // As many shards per document as the zig-zag layout's chunks: with only W, a document spanning all W ranks
      // could not be re-cut at all (a shard never leaves its piece), and the plan would keep the packing's imbalance.
      p.max_cp_degree = std::max<std::int64_t>(2 * c.world, static_cast<std::int64_t>(cpdispatch::widest_span(p.documents)));
      p.q_bytes = c.heads_q * c.head_dim * 4;
      p.kv_bytes = 2 * c.heads_kv * c.head_dim * 4;
      cpdispatch::BalanceOptions options;
      options.dedup = c.dedup;
      cpdispatch::QkvDocumentsPlan plan = cpdispatch::plan_balanced(p, options);
      plan.dedup = c.dedup;
      const double flops = 3.5 * 4.0 * mask_pairs(p.documents) * static_cast<double>(c.head_dim * c.heads_q);  // forward + 2.5x backward
      const double compute = ours_step<HostDevice>(c, plan, instant, 1).seconds;
      const double rate = flops / compute / c.world;  // per rank, all ranks computing at once
      Batch batch{name, b, p, plan, compute, rate};
      batch.kernel = kernel;
      for (const Ratio& r : ratios) {
        const bool none = std::strcmp(r.option, "none") == 0, all = c.links == "both" && (!none || c.model_check);
        if (all || c.links == r.option) run_link(c, batch, {r.name, r.option, rate * r.bytes_per_flop}, ratios_of);
      }
      std::printf("%s batch %d | kernel %.2f GFLOP/s per rank with %d ranks computing\n", name.c_str(), b, rate * 1e-9, c.world);
      std::fflush(stdout);
    }
  }
  std::printf("\nmedians over the batches:\n");
  for (const auto& [key, v] : ratios_of) {
    std::printf("  %s: %.3f\n", key.c_str(), median(v));
  }
  return 0;
}
