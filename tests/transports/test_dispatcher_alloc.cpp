// After its first call, a dispatcher (and the sim transport under it) does not
// allocate: the program's counting allocator counts each rank thread's allocations.

#include <gtest/gtest.h>

#include <chrono>
#include <cstddef>
#include <vector>

#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/transports/sim.hpp"
#include "../common/counting_allocator.hpp"
#include "dispatch_helpers.hpp"

namespace {

using thread_allocations::allocations;
using thread_allocations::counting;
using cpdispatch::Dispatcher;
using cpdispatch::ElementType;
using cpdispatch::SimTransport;
using cpdispatch::SimWorld;
using cptest::Bytes;

template <class Wrap>
void expect_no_allocation_after_the_first_call(Wrap wrap) {
  const int W = 4;
  const std::size_t tb = 8;
  const auto qkv = cptest::random_qkv(W, 31);
  std::vector<std::size_t> counted(W, 99);
  SimWorld world(W, cpdispatch::SimOptions{std::chrono::milliseconds(60000)});
  world.run([&](SimTransport& sim) {
    decltype(auto) t = wrap(sim);
    Dispatcher q(t, qkv.q_fwd, qkv.q_rev, tb);
    Dispatcher kv(t, qkv.kv_fwd, qkv.kv_rev, tb);
    Bytes q_mlp(q.required_bytes().mlp_bytes), q_attn(q.required_bytes().attention_bytes), q_back(q.required_bytes().replica_bytes);
    Bytes kv_mlp(kv.required_bytes().mlp_bytes), kv_attn(kv.required_bytes().attention_bytes),
        kv_replica(kv.required_bytes().replica_bytes), kv_grad(kv.required_bytes().mlp_bytes);
    auto step = [&] {
      q.forward(q_mlp, q_attn);
      kv.forward(kv_mlp, kv_attn);
      q.reverse(q_attn, q_back);
      kv.reverse_combine(kv_attn, kv_replica, kv_grad, ElementType::float32);
    };
    step();  // the first calls may allocate (the dispatchers' staging)
    counting = true;
    for (int i = 0; i < 5; ++i) step();
    counting = false;
    counted[static_cast<std::size_t>(sim.rank())] = allocations;
  });
  for (int r = 0; r < W; ++r) EXPECT_EQ(counted[static_cast<std::size_t>(r)], 0u) << "rank " << r;
}

TEST(DispatcherAllocation, NoAllocationAfterTheFirstCallWithPieces) {
  expect_no_allocation_after_the_first_call([](SimTransport& sim) -> SimTransport& { return sim; });
}

TEST(DispatcherAllocation, NoAllocationAfterTheFirstCallWithStaging) {
  expect_no_allocation_after_the_first_call([](SimTransport& sim) { return cpdispatch::SimPackingTransport(sim); });
}

}  // namespace
