// CudaAttentionKernel on a GPU (nvcc) and through the cuda-cpu harness: forward and backward
// against the double-precision reference (float, every mask, MHA and GQA),
// entries covering parts of documents (their own bands, empty entries, rows
// that see nothing) against HostAttentionKernel, entries sharing query and
// key rows (a shared prefix, inverse and bi-causal bands, random calls)
// against the brute-force reference, 16-bit types, prepared entry lists
// (bitwise equal, capturable, changed lists recognised), and the invariant
// mode (every split on the grid gives the bits of one call; accurate against
// the reference; non-finite inputs refused).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "../attention_kernel/attention_case.hpp"
#include "../attention_kernel/invariant_splits.hpp"
#include "cpdispatch/attention/host_kernel.hpp"
#include "cpdispatch/cuda/attention.hpp"
#include "cuda_test_util.hpp"

namespace cpdispatch::testing {
namespace {

/// A host vector's copy in device memory, and back.
template <class T>
struct OnDevice {
  cuda::DeviceBuffer<T> buffer;
  explicit OnDevice(const std::vector<T>& host) : buffer(host.size()) {
    CPDISPATCH_CUDA_CHECK(cudaMemcpy(buffer.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::span<T> span() { return {buffer.data(), buffer.size()}; }
  std::span<const T> cspan() const { return {buffer.data(), buffer.size()}; }
  std::vector<T> host() const {
    std::vector<T> x(buffer.size());
    CPDISPATCH_CUDA_CHECK(cudaDeviceSynchronize());
    CPDISPATCH_CUDA_CHECK(cudaMemcpy(x.data(), buffer.data(), x.size() * sizeof(T), cudaMemcpyDeviceToHost));
    return x;
  }
};

template <class E>
struct Inputs {
  AttentionShape shape;
  std::int64_t tokens;
  std::vector<E> q, k, v, dout;
  Inputs(AttentionShape s, std::int64_t t, unsigned seed) : shape(s), tokens(t) {
    std::mt19937 rng(seed);
    q = random_elements<E>(static_cast<std::size_t>(t * s.heads_q * s.head_dim), rng);
    k = random_elements<E>(static_cast<std::size_t>(t * s.heads_kv * s.head_dim), rng);
    v = random_elements<E>(k.size(), rng);
    dout = random_elements<E>(q.size(), rng);
  }
};

template <class E>
struct Outputs {
  std::vector<E> out, dq, dk, dv;
  std::vector<float> lse;
};

/// Forward then backward (with the forward's own out and lse) on the device.
/// Outputs start as NaN so that an element the kernel should write but does not shows.
template <class E>
Outputs<E> on_device(const Inputs<E>& in, const std::vector<AttentionEntry>& entries) {
  const E poison = to_element<E>(std::numeric_limits<float>::quiet_NaN());
  OnDevice<E> q(in.q), k(in.k), v(in.v), dout(in.dout), out(std::vector<E>(in.q.size(), poison));
  OnDevice<E> dq(std::vector<E>(in.q.size(), poison)), dk(std::vector<E>(in.k.size(), poison)), dv(dk.host());
  OnDevice<float> lse(std::vector<float>(static_cast<std::size_t>(in.shape.heads_q * in.tokens), -1.0f));
  cuda::CudaAttentionKernel kernel;
  kernel.forward<E>(in.shape, entries, q.cspan(), k.cspan(), v.cspan(), out.span(), lse.span());
  kernel.backward<E>(in.shape, entries, q.cspan(), k.cspan(), v.cspan(), out.cspan(), lse.cspan(), dout.cspan(), dq.span(),
                     dk.span(), dv.span());
  return {out.host(), dq.host(), dk.host(), dv.host(), lse.host()};
}

template <class E>
Outputs<E> on_host(const Inputs<E>& in, const std::vector<AttentionEntry>& entries) {
  const E poison = to_element<E>(std::numeric_limits<float>::quiet_NaN());
  Outputs<E> r{std::vector<E>(in.q.size(), poison), std::vector<E>(in.q.size(), poison), std::vector<E>(in.k.size(), poison),
               std::vector<E>(in.k.size(), poison), std::vector<float>(static_cast<std::size_t>(in.shape.heads_q * in.tokens), -1.0f)};
  HostAttentionKernel kernel({1, 4, 4});
  kernel.forward<E>(in.shape, entries, in.q, in.k, in.v, r.out, r.lse);
  kernel.backward<E>(in.shape, entries, in.q, in.k, in.v, r.out, r.lse, in.dout, r.dq, r.dk, r.dv);
  return r;
}

template <class E>
std::vector<double> doubles(const std::vector<E>& x) {
  return as_doubles<E>(std::span<const E>(x));
}

TEST(CudaAttentionKernel, FloatMatchesTheReferenceForEveryMask) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  for (const AttentionShape shape : {make_shape(2, 2, 8), make_shape(4, 1, 5)}) {
    const std::vector<std::int64_t> lengths{1, 9, 14};
    const auto cu = prefix_sums(lengths);
    const Inputs<float> in(shape, cu.back(), 23);
    for (const AttentionMask& mask : all_masks()) {
      SCOPED_TRACE(to_string(mask) + ", heads " + std::to_string(shape.heads_q) + "/" + std::to_string(shape.heads_kv));
      const auto got = on_device(in, layout_entries(cu, cu, mask));
      const std::int64_t wq = shape.heads_q * shape.head_dim, wk = shape.heads_kv * shape.head_dim;
      for (std::size_t d = 0; d < lengths.size(); ++d) {
        const std::int64_t first = cu[d], L = lengths[d];
        const auto q = rows_of(doubles(in.q), first, L, wq), k = rows_of(doubles(in.k), first, L, wk);
        const auto v = rows_of(doubles(in.v), first, L, wk), dout = rows_of(doubles(in.dout), first, L, wq);
        const auto fwd = reference_attention_forward(q, k, v, L, reference_shape(shape), mask);
        const auto grad = reference_attention_backward(q, k, v, dout, L, reference_shape(shape), mask);
        std::vector<double> lse;
        for (std::int64_t h = 0; h < shape.heads_q; ++h) {
          for (std::int64_t p = first; p < first + L; ++p) lse.push_back(got.lse[static_cast<std::size_t>(h * cu.back() + p)]);
        }
        EXPECT_LE(relative_error(rows_of(doubles(got.out), first, L, wq), fwd.out), 1e-5) << "document " << d;
        EXPECT_LE(relative_error(lse, fwd.lse), 1e-5) << "document " << d;
        EXPECT_LE(relative_error(rows_of(doubles(got.dq), first, L, wq), grad.dq), 1e-5) << "document " << d;
        EXPECT_LE(relative_error(rows_of(doubles(got.dk), first, L, wk), grad.dk), 1e-5) << "document " << d;
        EXPECT_LE(relative_error(rows_of(doubles(got.dv), first, L, wk), grad.dv), 1e-5) << "document " << d;
      }
    }
  }
}

/// Parts of documents under `mask`, each with its own band (written as the
/// document position of its first query counted from its first key), an
/// entry without keys, one without queries and rows that see nothing.
std::vector<AttentionEntry> partial_entries(const AttentionMask& mask) {
  return {part_entry(mask, 0, 5, 7, 6, 7), part_entry(mask, 5, 0, 0, 3, 0), part_entry(mask, 5, 3, 3, 0, 0),
          part_entry(mask, 8, 7, 13, 5, -4), part_entry(mask, 15, 9, 18, 6, 2)};
}

/// The partial entries above: the device agrees with the host kernel.
TEST(CudaAttentionKernel, PartialEntriesAgreeWithTheHostKernel) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const AttentionShape shape = make_shape(4, 2, 6);
  const Inputs<float> in(shape, 24, 29);
  for (const AttentionMask& mask : all_masks()) {
    SCOPED_TRACE(to_string(mask));
    const auto entries = partial_entries(mask);
    const auto got = on_device(in, entries), want = on_host(in, entries);
    std::vector<double> got_lse(got.lse.begin(), got.lse.end()), want_lse(want.lse.begin(), want.lse.end());
    EXPECT_LE(relative_error(doubles(got.out), doubles(want.out)), 1e-5);
    EXPECT_LE(relative_error(got_lse, want_lse), 1e-5);
    EXPECT_LE(relative_error(doubles(got.dq), doubles(want.dq)), 1e-5);
    // Key rows 0-2 and 6 belong to no entry with queries (or to none): both kernels write zeros or leave NaN alike.
    const auto gk = doubles(got.dk), wk = doubles(want.dk), gv = doubles(got.dv), wv = doubles(want.dv);
    for (std::size_t i = 0; i < gk.size(); ++i) {
      EXPECT_EQ(std::isnan(gk[i]), std::isnan(wk[i])) << "dk element " << i;
      EXPECT_EQ(std::isnan(gv[i]), std::isnan(wv[i])) << "dv element " << i;
    }
    auto finite = [](std::vector<double> x) {
      for (auto& e : x) e = std::isnan(e) ? 0.0 : e;
      return x;
    };
    EXPECT_LE(relative_error(finite(gk), finite(wk)), 1e-5);
    EXPECT_LE(relative_error(finite(gv), finite(wv)), 1e-5);
  }
}

/// Entries sharing query rows and key rows: a shared-prefix document (a
/// prompt of 7 tokens, responses of 5 and 6 that see the prompt whole and
/// themselves causally), inverse and bi-causal bands with an empty one, and
/// random calls; the forward folds each row's entries into one softmax and
/// the backward sums each row's shares, against the brute-force reference.
TEST(CudaAttentionKernel, EntriesSharingRowsMatchTheReference) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const AttentionShape shape = make_shape(4, 2, 6);
  const Inputs<float> in(shape, 18, 53);
  const Band causal{Band::unbounded_lo, 0}, full{};
  std::vector<std::vector<AttentionEntry>> calls{
      {{0, 7, 0, 7, causal}, {7, 5, 0, 7, full}, {7, 5, 7, 5, causal}, {12, 6, 0, 7, full}, {12, 6, 12, 6, causal}},
      {{0, 8, 0, 12, {0, Band::unbounded_hi}}, {0, 8, 12, 4, full}, {8, 8, 0, 16, {-3, 2}}, {4, 6, 2, 9, {5, 1}},
       {10, 6, 3, 6, {-9, -4}}}};
  std::mt19937 rng(59);
  for (int n = 0; n < 6; ++n) {
    std::vector<AttentionEntry> entries(1 + rng() % 5);
    for (AttentionEntry& e : entries) {
      e.q_start = static_cast<std::int64_t>(rng() % 19);
      e.q_len = static_cast<std::int64_t>(rng() % static_cast<unsigned>(19 - e.q_start));
      e.kv_start = static_cast<std::int64_t>(rng() % 19);
      e.kv_len = static_cast<std::int64_t>(rng() % static_cast<unsigned>(19 - e.kv_start));
      const std::int64_t lo = static_cast<std::int64_t>(rng() % 21) - 10;
      e.band = {rng() % 4 == 0 ? Band::unbounded_lo : lo, rng() % 4 == 0 ? Band::unbounded_hi : lo + static_cast<std::int64_t>(rng() % 12) - 2};
    }
    calls.push_back(entries);
  }
  for (std::size_t c = 0; c < calls.size(); ++c) {
    SCOPED_TRACE("call " + std::to_string(c));
    const auto& entries = calls[c];
    // Outputs start as NaN: compare the rows some entry covers, where the reference defines them.
    const auto got = on_device(in, entries);
    const auto want = reference_by_entries(doubles(in.q), doubles(in.k), doubles(in.v), doubles(in.dout), shape, entries);
    auto covered = [&](std::vector<double> x, const std::vector<double>& ref, std::int64_t width, bool query) {
      for (std::size_t i = 0; i < x.size(); ++i) {
        const auto row = static_cast<std::int64_t>(i) / width;
        bool in_entry = false;
        for (const AttentionEntry& e : entries) {
          in_entry |= query ? (row >= e.q_start && row < e.q_start + e.q_len) : (row >= e.kv_start && row < e.kv_start + e.kv_len);
        }
        if (!in_entry) x[i] = ref[i];
      }
      return relative_error(x, ref);
    };
    const std::int64_t wq = shape.heads_q * shape.head_dim, wk = shape.heads_kv * shape.head_dim;
    std::vector<double> lse_by_row;  // [row][head], to walk it by row like the others
    std::vector<double> want_lse;
    for (std::int64_t row = 0; row < in.tokens; ++row) {
      for (std::int64_t h = 0; h < shape.heads_q; ++h) {
        lse_by_row.push_back(got.lse[static_cast<std::size_t>(h * in.tokens + row)]);
        want_lse.push_back(want.lse[static_cast<std::size_t>(h * in.tokens + row)]);
      }
    }
    EXPECT_LE(covered(doubles(got.out), want.out, wq, true), 1e-5) << "out";
    EXPECT_LE(covered(lse_by_row, want_lse, shape.heads_q, true), 1e-5) << "lse";
    EXPECT_LE(covered(doubles(got.dq), want.dq, wq, true), 1e-5) << "dq";
    EXPECT_LE(covered(doubles(got.dk), want.dk, wk, false), 1e-5) << "dk";
    EXPECT_LE(covered(doubles(got.dv), want.dv, wk, false), 1e-5) << "dv";
  }
}

/// 16-bit types: within twice the host kernel's error against the double
/// reference (the host kernel is held to flash-attention's rule in tests/attention_kernel).
template <class E>
void expect_16bit_close_to_the_reference() {
  const AttentionShape shape = make_shape(4, 2, 8);
  const std::int64_t L = 17;
  const Inputs<E> in(shape, L, 31);
  for (const AttentionMask& mask : {AttentionMask::causal(), AttentionMask::sliding_window(4)}) {
    SCOPED_TRACE(to_string(mask));
    const std::vector<AttentionEntry> entries{part_entry(mask, 0, L, 0, L, 0)};
    const auto dev = on_device(in, entries), host = on_host(in, entries);
    const auto q = doubles(in.q), k = doubles(in.k), v = doubles(in.v), dout = doubles(in.dout);
    const auto fwd = reference_attention_forward(q, k, v, L, reference_shape(shape), mask);
    const auto grad = reference_attention_backward(q, k, v, dout, L, reference_shape(shape), mask);
    auto both = [&](const std::vector<E>& a, const std::vector<E>& b, const std::vector<double>& want, const char* what) {
      EXPECT_TRUE(within_twice(relative_error(doubles(a), want), relative_error(doubles(b), want))) << what;
    };
    both(dev.out, host.out, fwd.out, "out");
    both(dev.dq, host.dq, grad.dq, "dq");
    both(dev.dk, host.dk, grad.dk, "dk");
    both(dev.dv, host.dv, grad.dv, "dv");
  }
}

TEST(CudaAttentionKernel, Bfloat16CloseToTheReference) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  expect_16bit_close_to_the_reference<bfloat16>();
}
TEST(CudaAttentionKernel, Float16CloseToTheReference) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  expect_16bit_close_to_the_reference<float16>();
}

// ---- prepared entry lists (PreparedAttentionKernel) ----

/// Entry lists as a staged step passes them: whole KV groups, parts of
/// documents with their own bands (an entry without keys, one without
/// queries), a second split, and parts sharing query and key rows; all over
/// 24 rows, under `mask`.
std::vector<std::vector<AttentionEntry>> step_lists(const AttentionMask& mask) {
  const std::vector<std::int64_t> cu{0, 5, 14, 24};
  return {layout_entries(cu, cu, mask),
          partial_entries(mask),
          {part_entry(mask, 2, 10, 0, 12, 4), part_entry(mask, 14, 10, 12, 12, -3)},
          {part_entry(mask, 14, 10, 0, 6, 14), part_entry(mask, 14, 10, 10, 14, 4), part_entry(mask, 4, 6, 0, 6, 4)}};
}

std::vector<std::span<const AttentionEntry>> spans_of(const std::vector<std::vector<AttentionEntry>>& lists) {
  return {lists.begin(), lists.end()};
}

/// The inputs on the device, and one output set per entry list, poisoned as on_device's.
template <class E>
struct StepBuffers {
  struct Out {
    OnDevice<E> out, dq, dk, dv;
    OnDevice<float> lse;
  };
  OnDevice<E> q, k, v, dout;
  std::vector<Out> outs;

  StepBuffers(const Inputs<E>& in, std::size_t lists) : q(in.q), k(in.k), v(in.v), dout(in.dout) {
    const E poison = to_element<E>(std::numeric_limits<float>::quiet_NaN());
    const std::vector<E> pq(in.q.size(), poison), pk(in.k.size(), poison);
    const std::vector<float> lse(static_cast<std::size_t>(in.shape.heads_q * in.tokens), -1.0f);
    outs.reserve(lists);
    for (std::size_t i = 0; i < lists; ++i) {
      outs.push_back(Out{OnDevice<E>(pq), OnDevice<E>(pq), OnDevice<E>(pk), OnDevice<E>(pk), OnDevice<float>(lse)});
    }
    cptest::device_sync();  // the kernels run on non-blocking streams
  }

  std::vector<Outputs<E>> read() const {
    std::vector<Outputs<E>> r;
    for (const Out& o : outs) r.push_back({o.out.host(), o.dq.host(), o.dk.host(), o.dv.host(), o.lse.host()});
    return r;
  }
};

/// A staged step's calls: every list's forward, then every list's backward.
template <class E>
void enqueue_step(cuda::CudaAttentionKernel& kernel, const AttentionShape& shape,
                  const std::vector<std::vector<AttentionEntry>>& lists, StepBuffers<E>& b) {
  for (std::size_t i = 0; i < lists.size(); ++i) {
    auto& o = b.outs[i];
    kernel.forward<E>(shape, lists[i], b.q.cspan(), b.k.cspan(), b.v.cspan(), o.out.span(), o.lse.span());
  }
  for (std::size_t i = 0; i < lists.size(); ++i) {
    auto& o = b.outs[i];
    kernel.backward<E>(shape, lists[i], b.q.cspan(), b.k.cspan(), b.v.cspan(), o.out.cspan(), o.lse.cspan(), b.dout.cspan(),
                       o.dq.span(), o.dk.span(), o.dv.span());
  }
}

/// A step on a kernel of its own, prepared with `prepared` first unless empty.
template <class E>
std::vector<Outputs<E>> run_step(const Inputs<E>& in, const std::vector<std::vector<AttentionEntry>>& lists,
                                 const std::vector<std::vector<AttentionEntry>>& prepared) {
  cuda::Stream stream;
  cuda::CudaAttentionKernel kernel(stream.get());
  if (!prepared.empty()) kernel.prepare(spans_of(prepared));
  StepBuffers<E> b(in, lists.size());
  enqueue_step(kernel, in.shape, lists, b);
  return b.read();
}

template <class T>
bool same_bytes(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <class E>
void expect_bitwise_equal(const std::vector<Outputs<E>>& got, const std::vector<Outputs<E>>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    EXPECT_TRUE(same_bytes(got[i].out, want[i].out)) << "list " << i << ": out";
    EXPECT_TRUE(same_bytes(got[i].lse, want[i].lse)) << "list " << i << ": lse";
    EXPECT_TRUE(same_bytes(got[i].dq, want[i].dq)) << "list " << i << ": dq";
    EXPECT_TRUE(same_bytes(got[i].dk, want[i].dk)) << "list " << i << ": dk";
    EXPECT_TRUE(same_bytes(got[i].dv, want[i].dv)) << "list " << i << ": dv";
  }
}

template <class E>
void expect_prepared_equals_unprepared() {
  const AttentionShape shape = make_shape(4, 2, 6);
  const Inputs<E> in(shape, 24, 37);
  for (const AttentionMask& mask : {AttentionMask::causal(), AttentionMask::sliding_window(3), AttentionMask::full()}) {
    SCOPED_TRACE(to_string(mask));
    const auto lists = step_lists(mask);
    expect_bitwise_equal(run_step(in, lists, lists), run_step(in, lists, {}));
  }
}

TEST(CudaAttentionKernel, PreparedCallsEqualUnpreparedOnesBitwiseFloat) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  expect_prepared_equals_unprepared<float>();
}
TEST(CudaAttentionKernel, PreparedCallsEqualUnpreparedOnesBitwiseBfloat16) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  expect_prepared_equals_unprepared<bfloat16>();
}

/// Captures a step on `kernel` (a synchronising call fails the capture),
/// runs the graph and returns its results.
template <class E>
std::vector<Outputs<E>> captured_step(cuda::CudaAttentionKernel& kernel, const Inputs<E>& in,
                                      const std::vector<std::vector<AttentionEntry>>& lists, cudaStreamCaptureMode mode) {
  StepBuffers<E> b(in, lists.size());
  CPDISPATCH_CUDA_CHECK(cudaStreamBeginCapture(kernel.stream(), mode));
  EXPECT_NO_THROW(enqueue_step(kernel, in.shape, lists, b));
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(kernel.stream(), &graph), cudaSuccess);
  if (!graph) return {};
  cudaGraphExec_t exec = nullptr;
  CPDISPATCH_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CPDISPATCH_CUDA_CHECK(cudaGraphLaunch(exec, kernel.stream()));
  CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(kernel.stream()));
  CPDISPATCH_CUDA_CHECK(cudaGraphExecDestroy(exec));
  CPDISPATCH_CUDA_CHECK(cudaGraphDestroy(graph));
  return b.read();
}

/// Steps of prepared calls synchronise nothing, so they capture into graphs
/// whose results equal unprepared calls' bitwise. A fresh kernel's first
/// backward allocates its scratch (relaxed mode allows that); a later prepare
/// of longer lists sizes the scratch itself, so that step allocates nothing
/// (global mode refuses an allocation).
TEST(CudaAttentionKernel, PreparedStepsCaptureIntoGraphs) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const AttentionShape shape = make_shape(4, 2, 6);
  const Inputs<bfloat16> in(shape, 24, 41);
  const AttentionMask mask = AttentionMask::sliding_window(4);
  const std::vector<std::vector<AttentionEntry>> short_lists{
      {part_entry(mask, 0, 5, 0, 5, 0), part_entry(mask, 5, 4, 5, 4, 0)}, {part_entry(mask, 2, 3, 0, 2, 3)}};
  const auto lists = step_lists(mask);
  cuda::Stream stream;
  cuda::CudaAttentionKernel kernel(stream.get());
  {
    SCOPED_TRACE("first step, relaxed capture");
    kernel.prepare(spans_of(short_lists));
    expect_bitwise_equal(captured_step(kernel, in, short_lists, cudaStreamCaptureModeRelaxed), run_step(in, short_lists, {}));
  }
  {
    SCOPED_TRACE("longer lists, global capture");
    kernel.prepare(spans_of(lists));
    expect_bitwise_equal(captured_step(kernel, in, lists, cudaStreamCaptureModeGlobal), run_step(in, lists, {}));
  }
}

/// The capture above would catch a synchronising call: an unprepared list does synchronise.
TEST(CudaAttentionKernel, UnpreparedCallFailsACapture) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const AttentionShape shape = make_shape(2, 2, 4);
  const Inputs<float> in(shape, 24, 43);
  const auto lists = step_lists(AttentionMask::causal());
  cuda::Stream stream;
  cuda::CudaAttentionKernel kernel(stream.get());
  kernel.prepare(spans_of(lists));
  StepBuffers<float> b(in, 1);
  CPDISPATCH_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeRelaxed));
  auto& o = b.outs[0];
  const std::vector<AttentionEntry> copy = lists[0];  // the same entries at another address: not recognised
  EXPECT_THROW(kernel.forward<float>(shape, copy, b.q.cspan(), b.k.cspan(), b.v.cspan(), o.out.span(), o.lse.span()),
               cuda_error);
  cudaGraph_t graph = nullptr;
  EXPECT_NE(cudaStreamEndCapture(stream.get(), &graph), cudaSuccess);
  (void)cudaGetLastError();
  if (graph) CPDISPATCH_CUDA_CHECK(cudaGraphDestroy(graph));
}

/// A prepared list changed in place (same address and size, other entries)
/// is recognised as changed: the results are those of its new contents.
TEST(CudaAttentionKernel, PreparedListChangedInPlaceStillGivesItsResults) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const AttentionShape shape = make_shape(4, 2, 6);
  const Inputs<float> in(shape, 24, 47);
  const AttentionMask mask = AttentionMask::causal();
  auto lists = step_lists(mask);
  const auto before = run_step(in, lists, {});

  cuda::Stream stream;
  cuda::CudaAttentionKernel kernel(stream.get());
  kernel.prepare(spans_of(lists));
  lists[1][3] = part_entry(mask, 8, 7, 13, 5, 1);  // was diagonal -4: the entry's rows see other keys
  lists[2][0].q_len = 9;     // one query row fewer
  StepBuffers<float> b(in, lists.size());
  enqueue_step(kernel, shape, lists, b);
  const auto got = b.read();
  const auto want = run_step(in, lists, {});
  expect_bitwise_equal(got, want);
  EXPECT_TRUE(same_bytes(got[0].out, before[0].out));  // the unchanged list
  EXPECT_FALSE(same_bytes(got[1].out, before[1].out));
  EXPECT_FALSE(same_bytes(got[2].dq, before[2].dq));
}

TEST(CudaAttentionKernel, RefusesAHeadDimBeyondItsAccumulators) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  cuda::CudaAttentionKernel kernel;
  const AttentionShape shape = make_shape(1, 1, 300);
  std::vector<float> none;
  EXPECT_THROW(kernel.forward<float>(shape, {}, none, none, none, none, none), invalid_input);
}

/// CudaAttentionKernel's invariant calls on host vectors, as run_split_with takes them: each copied to the device and back.
template <class E>
void device_invariant_calls(cuda::CudaAttentionKernel& kernel, const AttentionShape& s, const InvariantGrid& g,
                            const std::vector<AttentionEntry>& entries, const std::vector<E>& q_, const std::vector<E>& k_,
                            const std::vector<E>& v_, const std::vector<E>& dout_, std::vector<E>& out_, std::vector<float>& lse_,
                            std::vector<E>& dq_, std::vector<std::int64_t>& dk_, std::vector<std::int64_t>& dv_, KvGradientExponents ex) {
  OnDevice<E> q(q_), k(k_), v(v_), dout(dout_), out(out_), dq(dq_);
  OnDevice<float> lse(lse_);
  OnDevice<std::int64_t> dk(dk_), dv(dv_);
  kernel.forward_invariant<E>(s, g, entries, q.cspan(), k.cspan(), v.cspan(), out.span(), lse.span());
  kernel.backward_invariant<E>(s, g, entries, q.cspan(), k.cspan(), v.cspan(), out.cspan(), lse.cspan(), dout.cspan(), dq.span(),
                               {dk.span(), dv.span(), ex.dk, ex.dv});
  out_ = out.host();
  lse_ = lse.host();
  dq_ = dq.host();
  dk_ = dk.host();
  dv_ = dv.host();
}

template <class E>
SplitRun<E> device_split(cuda::CudaAttentionKernel& kernel, const Document<E>& doc, const AttentionMask& mask, std::int64_t grid,
                         std::int64_t packed, const Split& split, KvGradientExponents ex) {
  const auto calls = [&kernel]<class X>(auto&&... args) { device_invariant_calls<X>(kernel, args...); };
  return run_split_with(calls, doc, mask, grid, packed, split, ex);
}

/// Every split of check_splits_with, on the device kernel.
template <class E>
void check_device_splits(const AttentionShape& s, std::int64_t L, std::int64_t grid, std::int64_t packed) {
  cuda::CudaAttentionKernel kernel;
  check_splits_with<E>([&](const Document<E>& doc, const AttentionMask& mask, std::int64_t g, std::int64_t at, const Split& split,
                           KvGradientExponents ex) { return device_split(kernel, doc, mask, g, at, split, ex); },
                       s, L, grid, packed);
}

TEST(CudaAttentionKernelInvariant, TheSplitOnTheGridChangesNoBit) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  check_device_splits<float>(make_shape(2, 2, 8), 45, 8, 0);
  check_device_splits<float>(make_shape(4, 2, 5), 37, 4, 6);  // GQA, odd head_dim, a document starting inside a block
  check_device_splits<bfloat16>(make_shape(2, 1, 8), 30, 8, 5);
}

/// The whole document in one call against the double reference, within the
/// default mode's tolerance and never worse than twice its error.
TEST(CudaAttentionKernelInvariant, MatchesTheReferenceAsTheDefaultModeDoes) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const AttentionShape s = make_shape(4, 2, 8);
  const std::int64_t L = 41, grid = 8;
  const Document<float> doc(s, L, 13);
  const auto ex = exponents_of(doc);
  cuda::CudaAttentionKernel kernel;
  const auto q = as_doubles<float>(doc.q), k = as_doubles<float>(doc.k), v = as_doubles<float>(doc.v), dout = as_doubles<float>(doc.dout);
  for (const AttentionMask& mask : all_masks()) {
    SCOPED_TRACE(to_string(mask));
    const auto fwd = reference_attention_forward(q, k, v, L, reference_shape(s), mask);
    const auto grad = reference_attention_backward(q, k, v, dout, L, reference_shape(s), mask);
    const SplitRun<float> r = device_split(kernel, doc, mask, grid, 0, {grid_cuts(0, L, 0, 2 * grid), grid, 0, 0}, ex);
    Inputs<float> in(s, L, 13);
    in.q = doc.q, in.k = doc.k, in.v = doc.v, in.dout = doc.dout;
    const Outputs<float> plain = on_device(in, layout_entries(std::vector<std::int64_t>{0, L}, std::vector<std::int64_t>{0, L}, mask));
    expect_as_accurate_as_the_default(r, ex, plain, fwd, grad, 1e-5);
  }
}

TEST(CudaAttentionKernelInvariant, RefusesNonFiniteInputsAndBadGrids) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const Document<float> doc(make_shape(2, 1, 4), 9, 3);
  const auto entries = layout_entries(std::vector<std::int64_t>{0, 9}, std::vector<std::int64_t>{0, 9}, AttentionMask::causal());
  cuda::CudaAttentionKernel kernel;
  OnDevice<float> k(doc.k), v(doc.v), out(doc.q), lse(std::vector<float>(18));
  const auto forward = [&](const InvariantGrid& g, const std::vector<float>& q_) {
    OnDevice<float> q(q_);
    kernel.forward_invariant<float>(doc.shape, g, entries, q.cspan(), k.cspan(), v.cspan(), out.span(), lse.span());
  };
  const UnitPhase two[] = {{0, 0}, {0, 0}};
  EXPECT_THAT([&] { forward({0, {}}, doc.q); }, ::testing::ThrowsMessage<invalid_input>(::testing::HasSubstr("grid.size is 0")));
  EXPECT_THAT([&] { forward({8, two}, doc.q); }, ::testing::ThrowsMessage<invalid_input>(::testing::HasSubstr("grid.phases has 2 phases for 1 entries")));
  std::vector<float> bad = doc.q;
  bad[5] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT([&] { forward({8, {}}, bad); }, ::testing::ThrowsMessage<invalid_input>(::testing::HasSubstr("score maximum of row 0, head 1 is not finite")));
  forward({8, {}}, doc.q);  // a good call after a refused one
  // Key-value gradients beyond their exact sums' scale: an error, never a wrap.
  OnDevice<float> q(doc.q), dout(doc.dout), dq(doc.q);
  OnDevice<std::int64_t> dk(std::vector<std::int64_t>(doc.k.size())), dv(dk.host());
  const auto ex = exponents_of(doc);
  EXPECT_THAT(
      [&] {
        kernel.backward_invariant<float>(doc.shape, {8, {}}, entries, q.cspan(), k.cspan(), v.cspan(), out.cspan(), lse.cspan(), dout.cspan(),
                                         dq.span(), {dk.span(), dv.span(), ex.dk - 40, ex.dv});
      },
      ::testing::ThrowsMessage<invalid_input>(::testing::HasSubstr("dk or dv of key row")));
}

}  // namespace
}  // namespace cpdispatch::testing
