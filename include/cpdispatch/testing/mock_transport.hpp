#pragma once
// GoogleMock transports, for this project's tests and for downstream ones
// (link GTest::gmock).
//
//   ::testing::StrictMock<cpdispatch::testing::MockTransport> t(/*rank=*/0, /*world_size=*/4);
//   EXPECT_CALL(t, all_to_all_v(_, ElementsAreArray(send_counts), _, _, ElementsAreArray(recv_counts), _));
//   cpdispatch::Dispatcher d(t, fwd, rev, token_bytes);
//
// - One mock per transport concept, so a test mocks only what the code under
//   test may call: MockAllToAllTransport (all_to_all_v; what the Dispatcher
//   needs), MockCollectiveTransport (barrier, broadcast, all_reduce,
//   all_gather, reduce_scatter; the tensor-parallel layers) and
//   MockPointToPointTransport (isend, irecv, wait), MockPostedAllToAllTransport
//   (all_to_all_v, post_all_to_all_v, wait). MockTransport mocks every
//   member of the full Transport concept. rank() and world_size() are plain
//   values (set them in the constructor or with set_rank / set_world_size), so
//   a StrictMock only asks for expectations on communication. The Basic...
//   templates take the memory space (MemorySpace::device mocks a device
//   transport).
// - RecordingTransport<Inner>: the same mock whose default actions delegate to
//   a real transport (e.g. a SimTransport inside SimWorld::run), so the calls
//   can be checked with EXPECT_CALL while the data really moves. An
//   EXPECT_CALL without an action keeps delegating; .WillOnce(Throw(...))
//   injects a failure.

#include <cstddef>
#include <span>

#include <gmock/gmock.h>

#include "cpdispatch/transport.hpp"

namespace cpdispatch::testing {

/// rank() and world_size() as plain values: the base of every mock.
template <MemorySpace Space>
class MockTransportBase {
 public:
  static constexpr MemorySpace memory_space = Space;

  explicit MockTransportBase(int rank = 0, int world_size = 1) : rank_(rank), world_size_(world_size) {}

  int rank() const noexcept { return rank_; }
  int world_size() const noexcept { return world_size_; }
  void set_rank(int rank) noexcept { rank_ = rank; }
  void set_world_size(int world_size) noexcept { world_size_ = world_size; }

 private:
  int rank_;
  int world_size_;
};

// The mocked members of each concept, shared by its own mock and the full one.
#define CPDISPATCH_MOCK_ALL_TO_ALL_MEMBERS                                                                             \
  MOCK_METHOD(void, all_to_all_v,                                                                                      \
              (const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,   \
               void* recv, std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs))
#define CPDISPATCH_MOCK_COLLECTIVE_MEMBERS                                                                             \
  MOCK_METHOD(void, barrier, ());                                                                                      \
  MOCK_METHOD(void, broadcast, (void* buf, std::size_t bytes, int root));                                             \
  MOCK_METHOD(void, all_reduce, (void* buf, std::size_t count, ElementType type, ReduceOp op));                        \
  MOCK_METHOD(void, all_gather, (const void* send, void* recv, std::size_t count_per_rank, ElementType type));         \
  MOCK_METHOD(void, reduce_scatter,                                                                                    \
              (const void* send, void* recv, std::size_t count_per_rank, ElementType type, ReduceOp op))
#define CPDISPATCH_MOCK_POINT_TO_POINT_MEMBERS                                                                         \
  MOCK_METHOD(Request, isend, (const void* buf, std::size_t bytes, int peer, int tag));                                \
  MOCK_METHOD(Request, irecv, (void* buf, std::size_t bytes, int peer, int tag));                                      \
  MOCK_METHOD(void, wait, (Request request))

/// all_to_all_v only: exactly what the Dispatcher may call.
template <MemorySpace Space>
class BasicMockAllToAllTransport : public MockTransportBase<Space> {
 public:
  using MockTransportBase<Space>::MockTransportBase;
  CPDISPATCH_MOCK_ALL_TO_ALL_MEMBERS;
};

/// all_to_all_v, post_all_to_all_v and wait: a transport that posts exchanges (PostedAllToAllTransport).
template <MemorySpace Space>
class BasicMockPostedAllToAllTransport : public MockTransportBase<Space> {
 public:
  using MockTransportBase<Space>::MockTransportBase;
  CPDISPATCH_MOCK_ALL_TO_ALL_MEMBERS;
  MOCK_METHOD(Request, post_all_to_all_v,
              (const void* send, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs, void* recv,
               std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs));
  MOCK_METHOD(void, wait, (Request request));
};

/// The typed collectives only.
template <MemorySpace Space>
class BasicMockCollectiveTransport : public MockTransportBase<Space> {
 public:
  using MockTransportBase<Space>::MockTransportBase;
  CPDISPATCH_MOCK_COLLECTIVE_MEMBERS;
};

/// isend, irecv and wait only.
template <MemorySpace Space>
class BasicMockPointToPointTransport : public MockTransportBase<Space> {
 public:
  using MockTransportBase<Space>::MockTransportBase;
  CPDISPATCH_MOCK_POINT_TO_POINT_MEMBERS;
};

/// Every member of the full Transport concept.
template <MemorySpace Space>
class BasicMockTransport : public MockTransportBase<Space> {
 public:
  using MockTransportBase<Space>::MockTransportBase;
  CPDISPATCH_MOCK_ALL_TO_ALL_MEMBERS;
  CPDISPATCH_MOCK_COLLECTIVE_MEMBERS;
  CPDISPATCH_MOCK_POINT_TO_POINT_MEMBERS;
};

#undef CPDISPATCH_MOCK_ALL_TO_ALL_MEMBERS
#undef CPDISPATCH_MOCK_COLLECTIVE_MEMBERS
#undef CPDISPATCH_MOCK_POINT_TO_POINT_MEMBERS

using MockAllToAllTransport = BasicMockAllToAllTransport<MemorySpace::host>;
using MockCollectiveTransport = BasicMockCollectiveTransport<MemorySpace::host>;
using MockPointToPointTransport = BasicMockPointToPointTransport<MemorySpace::host>;
using MockPostedAllToAllTransport = BasicMockPostedAllToAllTransport<MemorySpace::host>;
using MockTransport = BasicMockTransport<MemorySpace::host>;

template <class Inner>
class RecordingTransport : public BasicMockTransport<Inner::memory_space> {
  CPDISPATCH_CHECK_TRANSPORT(Inner);

 public:
  /// Delegates to `inner`, which must outlive this mock.
  explicit RecordingTransport(Inner& inner)
      : BasicMockTransport<Inner::memory_space>(inner.rank(), inner.world_size()), inner_(inner) {
    using ::testing::Invoke;
    ON_CALL(*this, all_to_all_v).WillByDefault(Invoke(&inner_, &Inner::all_to_all_v));
    ON_CALL(*this, isend).WillByDefault(Invoke(&inner_, &Inner::isend));
    ON_CALL(*this, irecv).WillByDefault(Invoke(&inner_, &Inner::irecv));
    ON_CALL(*this, wait).WillByDefault(Invoke(&inner_, &Inner::wait));
    ON_CALL(*this, barrier).WillByDefault(Invoke(&inner_, &Inner::barrier));
    ON_CALL(*this, broadcast).WillByDefault(Invoke(&inner_, &Inner::broadcast));
    ON_CALL(*this, all_reduce).WillByDefault(Invoke(&inner_, &Inner::all_reduce));
    ON_CALL(*this, all_gather).WillByDefault(Invoke(&inner_, &Inner::all_gather));
    ON_CALL(*this, reduce_scatter).WillByDefault(Invoke(&inner_, &Inner::reduce_scatter));
  }

  Inner& inner() noexcept { return inner_; }

 private:
  Inner& inner_;
};

static_assert(Transport<MockTransport>);
static_assert(AllToAllTransport<MockAllToAllTransport> && !CollectiveTransport<MockAllToAllTransport> &&
              !PointToPointTransport<MockAllToAllTransport>);
static_assert(CollectiveTransport<MockCollectiveTransport> && !AllToAllTransport<MockCollectiveTransport>);
static_assert(PointToPointTransport<MockPointToPointTransport> && !AllToAllTransport<MockPointToPointTransport>);

static_assert(PostedAllToAllTransport<MockPostedAllToAllTransport> && !PointToPointTransport<MockPostedAllToAllTransport>);

}  // namespace cpdispatch::testing
