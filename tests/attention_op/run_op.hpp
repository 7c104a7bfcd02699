#pragma once
// Runs ContextParallelAttention on every rank of a SimWorld (ranks as threads)
// over a CpWorld's tensors and collects what each rank returned.

#include <cstdint>
#include <limits>
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

/// One rank's step: forward and backward of its op on its own tensors; the
/// outputs start as NaN so that an element the op leaves unwritten shows.
template <class E, class Op>
RankResult step(Op& op, const RankTensors& x) {
  const std::vector<E> q = to_elements<E>(x.q), k = to_elements<E>(x.k), v = to_elements<E>(x.v), dout = to_elements<E>(x.dout);
  const E nan = cpdispatch::detail::from_f32<E>(std::numeric_limits<float>::quiet_NaN());
  std::vector<E> out(q.size(), nan), dq(q.size(), nan), dk(k.size(), nan), dv(v.size(), nan);
  op.forward(q, k, v, out);
  op.backward(dout, dq, dk, dv);
  RankResult r{to_floats(out), to_floats(dq), to_floats(dk), to_floats(dv), std::vector<float>(op.lse().begin(), op.lse().end()), {}};
  r.hp_lse.assign(op.head_parallel_lse().begin(), op.head_parallel_lse().end());
  return r;
}

/// Every rank of `sim` (ranks as threads) plans its own share of the
/// world's plan and runs rank_step(transport, share), which returns its
/// results; the share's q_rev goes with them.
template <class Sim, class RankStep>
std::vector<RankResult> on_every_rank(Sim& sim, const CpWorld& world, RankStep&& rank_step) {
  std::vector<RankResult> results(static_cast<std::size_t>(world.plan().world_size));
  sim.run([&](auto& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    const cpdispatch::RankQkvMetadata share = cpdispatch::plan_qkv_for_rank(world.plan(), t.rank());
    results[r] = rank_step(t, share);
    results[r].q_rev = share.q_rev;
    results[r].hp = share.hp_attn;
  });
  return results;
}

/// Every rank plans its own share, builds the op (its kernel from kernel_args) and runs one step.
template <class E, class Kernel = ExactKernel, class... KernelArgs>
std::vector<RankResult> run_op(const CpWorld& world, const cpdispatch::AttentionShape& shape, cpdispatch::CpAttentionOptions options,
                               const KernelArgs&... kernel_args) {
  cpdispatch::SimWorld sim(static_cast<int>(world.plan().world_size), cpdispatch::SimOptions{sim_test::hang_timeout});
  return on_every_rank(sim, world, [&](cpdispatch::SimTransport& t, const cpdispatch::RankQkvMetadata& share) {
    cpdispatch::ContextParallelAttention<cpdispatch::SimTransport, E, Kernel> op(t, share, shape, options, Kernel(kernel_args...));
    return step<E>(op, world.tensors(static_cast<std::size_t>(t.rank())));
  });
}

}  // namespace attention_test
