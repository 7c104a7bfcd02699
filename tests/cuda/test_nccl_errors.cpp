// NcclTransport's failures on a GPU: bad arguments are invalid_input naming
// the call and the rank; a call NCCL itself refuses throws nccl_error naming
// the NCCL call, the file and line and NCCL's error. Plain C++ (the
// transport needs no nvcc), in its own program because it changes how NCCL
// checks pointers for the whole process. Without a CUDA device the tests
// skip ("no CUDA device").

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "cpdispatch/cuda_runtime/memory.hpp"
#include "cpdispatch/transports/nccl.hpp"
#include "cuda_test_util.hpp"

namespace {

// NCCL validates buffer pointers only when asked, and reads the setting once,
// at its first communicator: set it before any test makes one. Without it a
// null buffer is not refused but faults on the GPU.
[[maybe_unused]] const int nccl_checks_pointers = ::setenv("NCCL_CHECK_POINTERS", "1", 0);

using ::testing::HasSubstr;

/// A one-rank communicator on GPU 0 and a stream, released at the end.
class OneRank {
 public:
  OneRank() {
    CPDISPATCH_CUDA_CHECK(cudaSetDevice(0));
    const int device = 0;
    CPDISPATCH_NCCL_CHECK(ncclCommInitAll(&comm_, 1, &device));
  }
  OneRank(const OneRank&) = delete;
  OneRank& operator=(const OneRank&) = delete;
  ~OneRank() { (void)ncclCommDestroy(comm_); }
  ncclComm_t comm() const { return comm_; }
  cudaStream_t stream() const { return stream_.get(); }

 private:
  ncclComm_t comm_ = nullptr;
  cpdispatch::cuda::Stream stream_;
};

template <class E, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw \"" << e.what() << "\", not the expected type";
    return {};
  }
  ADD_FAILURE() << "no exception thrown";
  return {};
}

TEST(NcclTransportErrors, BadArgumentsAreInvalidInput) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  OneRank one;
  cpdispatch::NcclTransport t(one.comm(), one.stream());
  EXPECT_THAT(message_of<cpdispatch::invalid_input>([&] { (void)t.isend(nullptr, 4, 1, 0); }),
              HasSubstr("NcclTransport: isend on rank 0 of 1: peer 1 is outside [0, 1)"));
  EXPECT_THAT(message_of<cpdispatch::invalid_input>([&] { t.wait(cpdispatch::Request{99}); }), HasSubstr("request 99 is not pending"));
  EXPECT_THAT(message_of<cpdispatch::invalid_input>([&] { t.broadcast(nullptr, 4, 3); }), HasSubstr("root 3 is outside [0, 1)"));
  const std::vector<std::size_t> one_byte{1}, two_bytes{2}, zero{0}, two_peers{0, 0};
  EXPECT_THAT(message_of<cpdispatch::invalid_input>([&] { t.all_to_all_v(nullptr, one_byte, zero, nullptr, two_bytes, zero); }),
              HasSubstr("send_counts[0] = 1 to itself but recv_counts[0] = 2"));
  EXPECT_THAT(message_of<cpdispatch::invalid_input>([&] { t.all_to_all_v(nullptr, two_peers, zero, nullptr, zero, zero); }),
              HasSubstr("send_counts has 2 entries, world_size is 1"));
}

TEST(NcclTransportErrors, WhatNcclRefusesIsAnNcclErrorNamingTheCall) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  OneRank one;
  cpdispatch::NcclTransport t(one.comm(), one.stream());
  try {
    t.all_reduce(nullptr, 16, cpdispatch::ElementType::float32, cpdispatch::ReduceOp::sum);
    ADD_FAILURE() << "no exception";
  } catch (const cpdispatch::nccl_error& e) {
    const std::string what = e.what();
    EXPECT_THAT(what, HasSubstr("ncclAllReduce failed at nccl.hpp:"));
    EXPECT_THAT(what, HasSubstr(cpdispatch::detail::nccl_result_name(e.code())));
    EXPECT_NE(e.code(), 0);
  }
  // The failure was reported once: CUDA's last error is clear, the stream usable.
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  CPDISPATCH_CUDA_CHECK(cudaStreamSynchronize(one.stream()));
}

}  // namespace
