#pragma once
// Runs ContextParallelAttention on every rank of a SimWorld (ranks as threads)
// over a CpWorld's tensors and collects what each rank returned.

#include <cstdint>
#include <span>
#include <vector>

#include "attention_op/cp_world.hpp"
#include "attention_op/exact_kernel.hpp"
#include "common/sim_world_fixture.hpp"
#include "cpdispatch/attention/context_parallel.hpp"
#include "cpdispatch/transports/sim.hpp"

namespace attention_test {

template <class E>
std::vector<E> to_elements(const std::vector<float>& x) {
  std::vector<E> out;
  out.reserve(x.size());
  for (float f : x) out.push_back(cpdispatch::detail::from_f32<E>(f));
  return out;
}

template <class E>
std::vector<float> to_floats(const std::vector<E>& x) {
  std::vector<float> out;
  out.reserve(x.size());
  for (E e : x) out.push_back(cpdispatch::detail::to_f32(e));
  return out;
}

template <class E>
float round_to(float x) { return cpdispatch::detail::to_f32(cpdispatch::detail::from_f32<E>(x)); }

/// One rank's step: forward and backward of its op on its own tensors.
template <class E, class Op>
RankResult step(Op& op, const RankTensors& x) {
  const std::vector<E> q = to_elements<E>(x.q), k = to_elements<E>(x.k), v = to_elements<E>(x.v), dout = to_elements<E>(x.dout);
  std::vector<E> out(q.size()), dq(q.size()), dk(k.size()), dv(v.size());
  op.forward(q, k, v, out);
  op.backward(dout, dq, dk, dv);
  RankResult r{to_floats(out), to_floats(dq), to_floats(dk), to_floats(dv), std::vector<float>(op.lse().begin(), op.lse().end()), {}};
  return r;
}

/// Every rank plans its own share, builds the op (its kernel from kernel_args) and runs one step.
template <class E, class Kernel = ExactKernel, class... KernelArgs>
std::vector<RankResult> run_op(const CpWorld& world, const cpdispatch::AttentionShape& shape, cpdispatch::CpAttentionOptions options,
                               const KernelArgs&... kernel_args) {
  const auto W = static_cast<std::size_t>(world.plan().world_size);
  std::vector<RankResult> results(W);
  cpdispatch::SimWorld sim(static_cast<int>(W), cpdispatch::SimOptions{sim_test::hang_timeout});
  sim.run([&](cpdispatch::SimTransport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    const cpdispatch::RankQkvMetadata share = cpdispatch::plan_qkv_for_rank(world.plan(), t.rank());
    cpdispatch::ContextParallelAttention<cpdispatch::SimTransport, E, Kernel> op(t, share, shape, options, Kernel(kernel_args...));
    results[r] = step<E>(op, world.tensors(r));
    results[r].q_rev = share.q_rev;
  });
  return results;
}

}  // namespace attention_test
