// simulate() of a realistic QKV plan (forward Q + forward KV) against a plain
// memcpy of the same bytes, measured in the same run, iteration by iteration.
//
// The plan: 8 ranks, 4096 tokens and 16 documents per rank, CP degrees 1, 2
// or 4 (create_qkv_dispatch); the same plan for every token size, so the
// bytes grow with the token. Each iteration runs
//   1. simulate(q_fwd) and simulate(kv_fwd): every copy the plan describes,
//   2. the baseline: memcpy of exactly as many bytes, from the same input
//      arena into the same output arena (distinct buffers, the same sizes:
//      Q in -> Q out in one call; KV in -> KV out in calls of at most the
//      KV input's size, because KV copies outnumber the KV input),
// so both touch the same memory and share the cache state and any
// interference from other processes.
//
// Counters: `bytes` (bytes copied per iteration), `sim_GB/s` and
// `memcpy_GB/s` (10^9 bytes per second), `ratio` = sim / memcpy throughput.
// The benchmark time is simulate's (manual time). Target: ratio of
// at least 0.8 for tokens of 1 KiB and more. Results: benchmarks/RESULTS.md.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include <benchmark/benchmark.h>

#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/execute/simulate.hpp"

namespace {

using cpdispatch::ConstBytes;
using cpdispatch::Metadata;
using cpdispatch::MutableBytes;

constexpr std::int64_t kWorld = 8;
constexpr std::int64_t kTokensPerRank = 4096;
constexpr std::int64_t kDocsPerRank = 16;
constexpr std::int64_t kMaxCpDegree = 4;
constexpr std::uint64_t kSeed = 2026;

// One contiguous arena, carved into per-rank buffers of whole tokens.
struct Arena {
  std::unique_ptr<std::byte[]> storage;
  std::size_t bytes = 0;

  explicit Arena(std::size_t n) : storage(new std::byte[n]), bytes(n) {}
  std::byte* data() const { return storage.get(); }
};

// Per-rank spans laid back to back from `base`: rank r gets tokens[r] tokens.
template <class Span>
std::vector<Span> carve(std::byte* base, const std::vector<std::int64_t>& tokens, std::size_t token_bytes) {
  std::vector<Span> spans;
  std::size_t at = 0;
  for (std::int64_t t : tokens) {
    const std::size_t n = static_cast<std::size_t>(t) * token_bytes;
    spans.emplace_back(base + at, n);
    at += n;
  }
  return spans;
}

std::vector<std::int64_t> send_tokens(const Metadata& m) {
  std::vector<std::int64_t> t;
  for (std::int64_t r = 0; r < m.world_size; ++r) t.push_back(m.send_tokens(r));
  return t;
}

std::vector<std::int64_t> output_tokens(const Metadata& m) {
  std::vector<std::int64_t> t;
  for (std::int64_t r = 0; r < m.world_size; ++r) t.push_back(m.output_tokens(r));
  return t;
}

std::int64_t sum(const std::vector<std::int64_t>& v) {
  std::int64_t s = 0;
  for (std::int64_t x : v) s += x;
  return s;
}

void BM_SimulateVsMemcpy(benchmark::State& state) {
  const auto token_bytes = static_cast<std::size_t>(state.range(0));
  const cpdispatch::QkvMetadata meta = cpdispatch::plan_qkv(
      cpdispatch::create_qkv_dispatch(kWorld, kTokensPerRank, kDocsPerRank, kMaxCpDegree, kSeed));

  const auto q_in_tokens = send_tokens(meta.q_fwd), kv_in_tokens = send_tokens(meta.kv_fwd);
  const auto q_out_tokens = output_tokens(meta.q_fwd), kv_out_tokens = output_tokens(meta.kv_fwd);
  const std::size_t q_in = static_cast<std::size_t>(sum(q_in_tokens)) * token_bytes;
  const std::size_t kv_in = static_cast<std::size_t>(sum(kv_in_tokens)) * token_bytes;
  const std::size_t q_out = static_cast<std::size_t>(sum(q_out_tokens)) * token_bytes;
  const std::size_t kv_out = static_cast<std::size_t>(sum(kv_out_tokens)) * token_bytes;

  // Inputs: Q then KV; outputs: Q then KV. Touch every page before timing.
  Arena in(q_in + kv_in), out(q_out + kv_out);
  std::memset(in.data(), 0x5a, in.bytes);
  std::memset(out.data(), 0, out.bytes);
  const auto q_src = carve<ConstBytes>(in.data(), q_in_tokens, token_bytes);
  const auto kv_src = carve<ConstBytes>(in.data() + q_in, kv_in_tokens, token_bytes);
  const auto q_dst = carve<MutableBytes>(out.data(), q_out_tokens, token_bytes);
  const auto kv_dst = carve<MutableBytes>(out.data() + q_out, kv_out_tokens, token_bytes);

  auto run_simulate = [&] {
    cpdispatch::simulate(meta.q_fwd, std::span<const ConstBytes>(q_src), std::span<const MutableBytes>(q_dst), token_bytes);
    cpdispatch::simulate(meta.kv_fwd, std::span<const ConstBytes>(kv_src), std::span<const MutableBytes>(kv_dst), token_bytes);
  };
  auto run_memcpy = [&] {
    std::memcpy(out.data(), in.data(), q_out);  // q_out == q_in
    for (std::size_t done = 0; done < kv_out;) {
      const std::size_t n = std::min(kv_in, kv_out - done);
      std::memcpy(out.data() + q_out + done, in.data() + q_in, n);
      done += n;
    }
  };
  run_simulate();  // warm-up: first touch, metadata in cache
  run_memcpy();

  using clock = std::chrono::steady_clock;
  double sim_s = 0, memcpy_s = 0;
  for (auto _ : state) {
    auto t0 = clock::now();
    run_simulate();
    benchmark::ClobberMemory();
    auto t1 = clock::now();
    run_memcpy();
    benchmark::ClobberMemory();
    auto t2 = clock::now();
    const double s = std::chrono::duration<double>(t1 - t0).count();
    sim_s += s;
    memcpy_s += std::chrono::duration<double>(t2 - t1).count();
    state.SetIterationTime(s);
  }
  const double bytes = static_cast<double>(q_out + kv_out);
  const auto iters = static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes * iters));
  state.counters["bytes"] = bytes;
  state.counters["sim_GB/s"] = bytes * iters / sim_s / 1e9;
  state.counters["memcpy_GB/s"] = bytes * iters / memcpy_s / 1e9;
  state.counters["ratio"] = memcpy_s / sim_s;
}

BENCHMARK(BM_SimulateVsMemcpy)
    ->ArgName("token_bytes")
    ->Arg(64)
    ->Arg(256)
    ->Arg(1024)
    ->Arg(4096)
    ->Arg(16384)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
