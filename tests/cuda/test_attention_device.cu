// CudaAttentionKernel on a GPU (nvcc) and through the cuda-cpu harness: forward and backward
// against the double-precision reference (float, every mask, MHA and GQA),
// entries covering parts of documents (arbitrary diagonals, empty entries,
// rows that see nothing) against HostAttentionKernel, and 16-bit types.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "../attention_kernel/attention_case.hpp"
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
Outputs<E> on_device(const Inputs<E>& in, const AttentionMask& mask, const std::vector<AttentionEntry>& entries) {
  const E poison = to_element<E>(std::numeric_limits<float>::quiet_NaN());
  OnDevice<E> q(in.q), k(in.k), v(in.v), dout(in.dout), out(std::vector<E>(in.q.size(), poison));
  OnDevice<E> dq(std::vector<E>(in.q.size(), poison)), dk(std::vector<E>(in.k.size(), poison)), dv(dk.host());
  OnDevice<float> lse(std::vector<float>(static_cast<std::size_t>(in.shape.heads_q * in.tokens), -1.0f));
  cuda::CudaAttentionKernel kernel;
  kernel.forward<E>(in.shape, mask, entries, q.cspan(), k.cspan(), v.cspan(), out.span(), lse.span());
  kernel.backward<E>(in.shape, mask, entries, q.cspan(), k.cspan(), v.cspan(), out.cspan(), lse.cspan(), dout.cspan(),
                     dq.span(), dk.span(), dv.span());
  return {out.host(), dq.host(), dk.host(), dv.host(), lse.host()};
}

template <class E>
Outputs<E> on_host(const Inputs<E>& in, const AttentionMask& mask, const std::vector<AttentionEntry>& entries) {
  const E poison = to_element<E>(std::numeric_limits<float>::quiet_NaN());
  Outputs<E> r{std::vector<E>(in.q.size(), poison), std::vector<E>(in.q.size(), poison), std::vector<E>(in.k.size(), poison),
               std::vector<E>(in.k.size(), poison), std::vector<float>(static_cast<std::size_t>(in.shape.heads_q * in.tokens), -1.0f)};
  HostAttentionKernel kernel({1, 4, 4});
  kernel.forward<E>(in.shape, mask, entries, in.q, in.k, in.v, r.out, r.lse);
  kernel.backward<E>(in.shape, mask, entries, in.q, in.k, in.v, r.out, r.lse, in.dout, r.dq, r.dk, r.dv);
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
      const auto got = on_device(in, mask, layout_entries(cu, cu));
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

/// Parts of documents with their own diagonals, an entry without keys, one
/// without queries, rows that see nothing: the device agrees with the host kernel.
TEST(CudaAttentionKernel, PartialEntriesAgreeWithTheHostKernel) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const AttentionShape shape = make_shape(4, 2, 6);
  const Inputs<float> in(shape, 24, 29);
  const std::vector<AttentionEntry> entries{{0, 5, 7, 6, 7},  {5, 0, 0, 3, 0},   {5, 3, 3, 0, 0},
                                            {8, 7, 13, 5, -4}, {15, 9, 18, 6, 2}};
  for (const AttentionMask& mask : all_masks()) {
    SCOPED_TRACE(to_string(mask));
    const auto got = on_device(in, mask, entries), want = on_host(in, mask, entries);
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

/// 16-bit types: within twice the host kernel's error against the double
/// reference (the host kernel is held to flash-attention's rule in tests/attention_kernel).
template <class E>
void expect_16bit_close_to_the_reference() {
  const AttentionShape shape = make_shape(4, 2, 8);
  const std::int64_t L = 17;
  const Inputs<E> in(shape, L, 31);
  const std::vector<AttentionEntry> entries{{0, L, 0, L, 0}};
  for (const AttentionMask& mask : {AttentionMask::causal(), AttentionMask::sliding_window(4)}) {
    SCOPED_TRACE(to_string(mask));
    const auto dev = on_device(in, mask, entries), host = on_host(in, mask, entries);
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

TEST(CudaAttentionKernel, RefusesAHeadDimBeyondItsAccumulators) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  cuda::CudaAttentionKernel kernel;
  const AttentionShape shape = make_shape(1, 1, 300);
  std::vector<float> none;
  EXPECT_THROW(kernel.forward<float>(shape, AttentionMask::causal(), {}, none, none, none, none, none), invalid_input);
}

}  // namespace
}  // namespace cpdispatch::testing
