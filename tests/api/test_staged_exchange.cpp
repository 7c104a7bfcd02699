// The exchange engine's staged exchange (execute/staged_exchange.hpp): a
// call names the tensors it moves, and they must be those the exchange was
// laid out for, in its order; anything else is refused before a byte moves.

#include <gtest/gtest.h>

#include <cstddef>
#include <span>
#include <vector>

#include "cpdispatch/execute/data_path.hpp"
#include "cpdispatch/execute/exchange_plan.hpp"
#include "cpdispatch/execute/staged_exchange.hpp"
#include "cpdispatch/plan/plan.hpp"
#include "cpdispatch/workload/generate.hpp"

namespace {

using cpdispatch::HostDataPath;
using cpdispatch::detail::StagedExchange;
using cpdispatch::detail::StagedTensor;

TEST(StagedExchange, ACallWithOtherTensorsThanItsLayOutIsRefused) {
  const auto meta = cpdispatch::plan_qkv(cpdispatch::create_qkv_dispatch(2, 64, 4, 2, 7));
  const std::size_t tb = 8;
  const auto q = cpdispatch::detail::plan_dispatch(meta.q_fwd.get_slice(0), meta.q_rev.get_slice(0), tb, 0, 2);
  const auto kv = cpdispatch::detail::plan_dispatch(meta.kv_fwd.get_slice(0), meta.kv_rev.get_slice(0), tb, 0, 2);
  int no_transport = 0;
  HostDataPath path(no_transport);
  StagedExchange<HostDataPath> ex;
  const StagedTensor laid_out[] = {{&q.forward, nullptr, nullptr}, {&kv.forward, nullptr, nullptr}};
  ex.lay_out(path, laid_out, 0, 2, 1, true);
  path.commit();

  std::vector<std::byte> q_in(q.forward.input_bytes), q_out(q.forward.output_bytes), kv_in(kv.forward.input_bytes), kv_out(kv.forward.output_bytes);
  const StagedTensor same[] = {{&q.forward, q_in.data(), q_out.data()}, {&kv.forward, kv_in.data(), kv_out.data()}};
  EXPECT_NO_THROW(ex.copy_self(path, same));
  const StagedTensor swapped[] = {same[1], same[0]};
  const StagedTensor fewer[] = {same[0]};
  const StagedTensor other[] = {same[0], {&kv.reverse, kv_out.data(), kv_in.data()}};
  for (const auto& tensors : {std::span<const StagedTensor>(swapped), std::span<const StagedTensor>(fewer), std::span<const StagedTensor>(other)}) {
    EXPECT_THROW(ex.copy_self(path, tensors), cpdispatch::invalid_input);
    EXPECT_THROW(ex.finish(path, tensors, 0), cpdispatch::invalid_input);
  }
}

}  // namespace
