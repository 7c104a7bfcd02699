// After its first call, a dispatcher (and the sim transport under it) does not
// allocate: this program counts the allocations of each thread.

#include <gtest/gtest.h>

#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <new>
#include <vector>

#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/transports/sim.hpp"
#include "dispatch_helpers.hpp"

// Clang's sanitizer runtimes define operator new themselves (statically
// linked), so there the count is not taken and the tests skip.
#if defined(__clang__) && defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
#define CPD_NO_NEW_REPLACEMENT 1
#endif
#endif

namespace {
thread_local bool counting = false;
thread_local std::size_t allocations = 0;
}  // namespace

#ifndef CPD_NO_NEW_REPLACEMENT
void* operator new(std::size_t n) {
  if (counting) ++allocations;
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
// GCC 12 pairs free() with the library's operator new at inlined call sites
// and warns (-Wmismatched-new-delete), though both sides are replaced here.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

namespace {

using cpdispatch::Dispatcher;
using cpdispatch::ElementType;
using cpdispatch::SimTransport;
using cpdispatch::SimWorld;
using cptest::Bytes;

template <class Wrap>
void expect_no_allocation_after_the_first_call(Wrap wrap) {
#ifdef CPD_NO_NEW_REPLACEMENT
  GTEST_SKIP() << "this sanitizer runtime owns operator new: allocations are not counted";
#endif
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
