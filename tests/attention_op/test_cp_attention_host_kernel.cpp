// ContextParallelAttention over its default kernel, HostAttentionKernel:
// float equals whole-document attention within 1e-5; 16-bit types stay
// within twice the error of the same kernel run unsharded in that type.

#include <gtest/gtest.h>

#include <array>
#include <string>

#include "attention_op/run_op.hpp"
#include "cpdispatch/attention.hpp"
#include "cpdispatch/plan/generate.hpp"

namespace {

using attention_test::CpWorld;
using attention_test::run_op;
using cpdispatch::AttentionMask;
using cpdispatch::AttentionShape;
using cpdispatch::HostAttentionKernel;

static_assert(std::is_same_v<cpdispatch::ContextParallelAttention<cpdispatch::SimTransport, float>::kernel_type, HostAttentionKernel>);

cpdispatch::QkvDocumentsPlan plan_of(int world_size, std::uint64_t seed) {
  cpdispatch::RandomDocumentsOptions o;
  o.world_size = world_size;
  o.num_documents = world_size + 2;
  o.max_shards = 4;
  o.max_len = 6;
  return cpdispatch::random_documents_plan(o, seed);
}

/// One kernel thread per rank: the ranks are threads already.
const cpdispatch::HostAttentionOptions one_thread{1, 4, 4};

TEST(CpAttentionHostKernel, FloatEqualsWholeDocumentAttention) {
  const AttentionShape shape{4, 2, 8, 0.35f};
  for (const int stages : {1, 3}) {
    const CpWorld world(plan_of(5, 41), shape, AttentionMask::causal(), 41, attention_test::round_to<float>);
    world.expect_equal(run_op<float, HostAttentionKernel>(world, shape, {false, stages}, one_thread), 1e-5);
  }
}

template <class E>
void expect_within_twice_unsharded(int stages) {
  const AttentionShape shape{2, 1, 8, 0.35f};
  const CpWorld sharded(plan_of(4, 43), shape, AttentionMask::causal(), 43, attention_test::round_to<E>);
  const CpWorld whole(CpWorld::unsharded(sharded.plan()), shape, AttentionMask::causal(), 43, attention_test::round_to<E>);
  const std::array<double, 5> got = sharded.relative_errors(run_op<E, HostAttentionKernel>(sharded, shape, {false, stages}, one_thread));
  const std::array<double, 5> base = whole.relative_errors(run_op<E, HostAttentionKernel>(whole, shape, {}, one_thread));
  const char* names[5] = {"out", "dq", "dk", "dv", "lse"};
  for (std::size_t i = 0; i < 5; ++i) {
    EXPECT_LE(got[i], 2 * base[i] + 1e-6) << names[i] << " with " << stages << " stages; unsharded " << base[i];
  }
}

TEST(CpAttentionHostKernel, Bfloat16WithinTwiceTheUnshardedError) {
  expect_within_twice_unsharded<cpdispatch::bfloat16>(1);
  expect_within_twice_unsharded<cpdispatch::bfloat16>(2);
}

TEST(CpAttentionHostKernel, Float16WithinTwiceTheUnshardedError) {
  expect_within_twice_unsharded<cpdispatch::float16>(1);
  expect_within_twice_unsharded<cpdispatch::float16>(4);
}

}  // namespace
