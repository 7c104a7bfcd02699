#pragma once
// One rank's step of ContextParallelAttention on a device transport, for the
// device op's tests: the rank's tensors copied to the device, forward and
// backward, the results copied back (outputs start as NaN so that an
// element the op leaves unwritten shows).

#include <cstddef>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_op/cp_world.hpp"
#include "cpdispatch/cuda_runtime/error.hpp"
#include "cpdispatch/cuda_runtime/memory.hpp"

namespace cptest {

/// A host vector's copy in device memory (never empty: an idle rank still gets a valid pointer).
template <class E>
cpdispatch::cuda::DeviceBuffer<E> to_device(const std::vector<E>& host) {
  cpdispatch::cuda::DeviceBuffer<E> b(host.size() + 1);
  if (!host.empty()) CPDISPATCH_CUDA_CHECK(cudaMemcpy(b.data(), host.data(), host.size() * sizeof(E), cudaMemcpyHostToDevice));
  return b;
}

template <class E>
std::vector<float> to_host(const E* device, std::size_t n) {
  std::vector<E> host(n);
  CPDISPATCH_CUDA_CHECK(cudaDeviceSynchronize());
  if (n) CPDISPATCH_CUDA_CHECK(cudaMemcpy(host.data(), device, n * sizeof(E), cudaMemcpyDeviceToHost));
  if constexpr (std::is_same_v<E, float>) {
    return host;
  } else {
    return attention_test::to_floats(host);
  }
}

template <class E>
cpdispatch::cuda::DeviceSpan<const E> in(const cpdispatch::cuda::DeviceBuffer<E>& b, std::size_t n) {
  return {b.data(), n};
}
template <class E>
cpdispatch::cuda::DeviceSpan<E> out(const cpdispatch::cuda::DeviceBuffer<E>& b, std::size_t n) {
  return {b.data(), n};
}

/// One rank's forward and backward on the device.
template <class E, class Op>
attention_test::RankResult device_step(Op& op, const attention_test::RankTensors& x) {
  using attention_test::to_elements;
  const std::size_t nq = x.q.size(), nk = x.k.size();
  const auto q = to_device(to_elements<E>(x.q)), k = to_device(to_elements<E>(x.k)), v = to_device(to_elements<E>(x.v)),
             dout = to_device(to_elements<E>(x.dout));
  const std::vector<float> nan_q(nq, std::numeric_limits<float>::quiet_NaN()), nan_k(nk, std::numeric_limits<float>::quiet_NaN());
  const auto o = to_device(to_elements<E>(nan_q)), dq = to_device(to_elements<E>(nan_q)), dk = to_device(to_elements<E>(nan_k)),
             dv = to_device(to_elements<E>(nan_k));
  op.forward(in(q, nq), in(k, nk), in(v, nk), out(o, nq));
  op.backward(in(dout, nq), out(dq, nq), out(dk, nk), out(dv, nk));
  attention_test::RankResult r{to_host(o.data(), nq), to_host(dq.data(), nq), to_host(dk.data(), nk), to_host(dv.data(), nk),
                               to_host(op.lse().data(), op.lse().size()), {}};
  r.hp_lse = to_host(op.head_parallel_lse().data(), op.head_parallel_lse().size());
  return r;
}

}  // namespace cptest
