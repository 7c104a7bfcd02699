// CommOverlapBuffer as a RAII object: layout, alignment, ownership, views.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

#include "cpdispatch/overlap/comm_overlap.hpp"

namespace ov = cpdispatch::overlap;
using cpdispatch::ElementType;
using ov::CommOverlapMethod;
using ov::CommOverlapType;

TEST(OverlapBuffer, HoldsItsParametersAndAZeroedAlignedBuffer) {
  ov::CommOverlapOptions options;
  options.num_splits = 3;
  options.tag = 77;
  ov::CommOverlapBuffer buffer(CommOverlapType::RS, CommOverlapMethod::PIPELINE, {12, 5}, ElementType::float64, 2, options);
  EXPECT_EQ(buffer.type(), CommOverlapType::RS);
  EXPECT_EQ(buffer.method(), CommOverlapMethod::PIPELINE);
  EXPECT_EQ(buffer.dtype(), ElementType::float64);
  EXPECT_EQ(buffer.tp_size(), 2);
  EXPECT_EQ(buffer.num_splits(), 3);
  EXPECT_EQ(buffer.options().tag, 77);
  EXPECT_FALSE(buffer.atomic_gemm());
  EXPECT_EQ(buffer.scaling_mode(), ov::ScalingMode::NO_SCALING);
  EXPECT_EQ(buffer.rows(), 12u);
  EXPECT_EQ(buffer.cols(), 5u);
  EXPECT_EQ(buffer.size(), 60u);
  EXPECT_EQ(buffer.bytes(), 480u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(buffer.data()) % ov::CommOverlapBuffer::alignment, 0u);
  EXPECT_THAT(buffer.view<double>(), testing::Each(0.0));
  EXPECT_TRUE(buffer.staging<double>().empty());
}

TEST(OverlapBuffer, RingExchangeReduceScatterHasStagingForItsPeers) {
  ov::CommOverlapBuffer buffer(CommOverlapType::RS, CommOverlapMethod::RING_EXCHANGE, {8, 3}, ElementType::float32, 4);
  EXPECT_EQ(buffer.size(), 24u);
  EXPECT_EQ(buffer.staging<float>().size(), 3u * 2u * 3u);  // tp - 1 blocks of 8/4 x 3
  EXPECT_EQ(buffer.staging<float>().data(), buffer.view<float>().data() + 24);
  EXPECT_THAT(buffer.staging<float>(), testing::Each(0.0f));
}

TEST(OverlapBuffer, CopyInAndOutAndMove) {
  ov::CommOverlapBuffer buffer(CommOverlapType::RS, CommOverlapMethod::BULK, {4, 3}, ElementType::float32, 2);
  std::vector<float> in(12);
  std::iota(in.begin(), in.end(), 1.0f);
  buffer.copy_into(std::span<const float>(in));
  const void* storage = buffer.data();
  ov::CommOverlapBuffer moved(std::move(buffer));
  EXPECT_EQ(moved.data(), storage);  // the memory changed owner, it was not copied
  std::vector<float> out(12);
  moved.copy_out(std::span<float>(out));
  EXPECT_EQ(out, in);
  std::vector<float> short_out(11);
  EXPECT_THROW(moved.copy_out(std::span<float>(short_out)), cpdispatch::invalid_input);
  try {
    (void)moved.view<double>();
    ADD_FAILURE() << "a float32 buffer was viewed as double";
  } catch (const cpdispatch::invalid_input& e) {
    EXPECT_THAT(e.what(), testing::HasSubstr("the buffer's dtype is float32, the element type asked for is float64"));
  }
}

TEST(OverlapBuffer, NamesOfTheEnumerations) {
  EXPECT_EQ(ov::to_string(CommOverlapType::AG), "AG");
  EXPECT_EQ(ov::to_string(CommOverlapMethod::RING_EXCHANGE), "RING_EXCHANGE");
  EXPECT_EQ(ov::to_string(ov::ScalingMode::MXFP8_1D_SCALING), "MXFP8_1D_SCALING");
  EXPECT_EQ(ov::to_string(static_cast<CommOverlapType>(5)), "CommOverlapType(5)");
}
