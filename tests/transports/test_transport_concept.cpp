// Compile-time checks of the Transport concept: the real and mock transports
// model it; a type missing any one member (or with a wrong signature) does not.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <span>

#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/testing/mock_transport.hpp"
#include "cpdispatch/transport.hpp"
#include "cpdispatch/transports/sim.hpp"

namespace {

using cpdispatch::ElementType;
using cpdispatch::MemorySpace;
using cpdispatch::ReduceOp;
using cpdispatch::Request;
using cpdispatch::Transport;
using cpdispatch::testing::MockTransport;
using cpdispatch::testing::RecordingTransport;
using Counts = std::span<const std::size_t>;

static_assert(Transport<cpdispatch::SimTransport>);
static_assert(Transport<MockTransport>);
static_assert(Transport<::testing::StrictMock<MockTransport>>);
static_assert(Transport<::testing::NiceMock<MockTransport>>);
static_assert(Transport<RecordingTransport<cpdispatch::SimTransport>>);
static_assert(Transport<::testing::StrictMock<RecordingTransport<cpdispatch::SimTransport>>>);
static_assert(Transport<cpdispatch::testing::BasicMockTransport<MemorySpace::device>>);
static_assert(RecordingTransport<cpdispatch::SimTransport>::memory_space == MemorySpace::host);
// The optional refinement: the sim transport exchanges pieces in place; the
// mocks (and so the recording mock around the sim) take the all_to_all_v path.
static_assert(cpdispatch::PieceTransport<cpdispatch::SimTransport>);
static_assert(!cpdispatch::PieceTransport<MockTransport>);
static_assert(!cpdispatch::PieceTransport<RecordingTransport<cpdispatch::SimTransport>>);
static_assert(Transport<cpdispatch::SimPackingTransport> && !cpdispatch::PieceTransport<cpdispatch::SimPackingTransport>);

// A complete transport, then copies of it that each lack (or break) one member.
struct Complete {
  static constexpr MemorySpace memory_space = MemorySpace::host;
  int rank() const { return 0; }
  int world_size() const { return 1; }
  void all_to_all_v(const void*, Counts, Counts, void*, Counts, Counts) {}
  Request isend(const void*, std::size_t, int, int) { return {}; }
  Request irecv(void*, std::size_t, int, int) { return {}; }
  void wait(Request) {}
  void barrier() {}
  void broadcast(void*, std::size_t, int) {}
  void all_reduce(void*, std::size_t, ElementType, ReduceOp) {}
  void all_gather(const void*, void*, std::size_t, ElementType) {}
  void reduce_scatter(const void*, void*, std::size_t, ElementType, ReduceOp) {}
};
static_assert(Transport<Complete>);

struct NoMemorySpace {
  int rank() const { return 0; }
  int world_size() const { return 1; }
  void all_to_all_v(const void*, Counts, Counts, void*, Counts, Counts) {}
  Request isend(const void*, std::size_t, int, int) { return {}; }
  Request irecv(void*, std::size_t, int, int) { return {}; }
  void wait(Request) {}
  void barrier() {}
  void broadcast(void*, std::size_t, int) {}
  void all_reduce(void*, std::size_t, ElementType, ReduceOp) {}
  void all_gather(const void*, void*, std::size_t, ElementType) {}
  void reduce_scatter(const void*, void*, std::size_t, ElementType, ReduceOp) {}
};
static_assert(!Transport<NoMemorySpace>);

struct NoRank {
  static constexpr MemorySpace memory_space = MemorySpace::host;
  int world_size() const { return 1; }
  void all_to_all_v(const void*, Counts, Counts, void*, Counts, Counts) {}
  Request isend(const void*, std::size_t, int, int) { return {}; }
  Request irecv(void*, std::size_t, int, int) { return {}; }
  void wait(Request) {}
  void barrier() {}
  void broadcast(void*, std::size_t, int) {}
  void all_reduce(void*, std::size_t, ElementType, ReduceOp) {}
  void all_gather(const void*, void*, std::size_t, ElementType) {}
  void reduce_scatter(const void*, void*, std::size_t, ElementType, ReduceOp) {}
};
static_assert(!Transport<NoRank>);

struct NonConstRank : Complete {  // rank() must be callable on a const transport
  int rank() { return 0; }
};
static_assert(!Transport<NonConstRank>);

struct NoAllToAll {
  static constexpr MemorySpace memory_space = MemorySpace::host;
  int rank() const { return 0; }
  int world_size() const { return 1; }
  Request isend(const void*, std::size_t, int, int) { return {}; }
  Request irecv(void*, std::size_t, int, int) { return {}; }
  void wait(Request) {}
  void barrier() {}
  void broadcast(void*, std::size_t, int) {}
  void all_reduce(void*, std::size_t, ElementType, ReduceOp) {}
  void all_gather(const void*, void*, std::size_t, ElementType) {}
  void reduce_scatter(const void*, void*, std::size_t, ElementType, ReduceOp) {}
};
static_assert(!Transport<NoAllToAll>);

struct IsendReturnsVoid {
  static constexpr MemorySpace memory_space = MemorySpace::host;
  int rank() const { return 0; }
  int world_size() const { return 1; }
  void all_to_all_v(const void*, Counts, Counts, void*, Counts, Counts) {}
  void isend(const void*, std::size_t, int, int) {}
  Request irecv(void*, std::size_t, int, int) { return {}; }
  void wait(Request) {}
  void barrier() {}
  void broadcast(void*, std::size_t, int) {}
  void all_reduce(void*, std::size_t, ElementType, ReduceOp) {}
  void all_gather(const void*, void*, std::size_t, ElementType) {}
  void reduce_scatter(const void*, void*, std::size_t, ElementType, ReduceOp) {}
};
static_assert(!Transport<IsendReturnsVoid>);

struct NoWait {
  static constexpr MemorySpace memory_space = MemorySpace::host;
  int rank() const { return 0; }
  int world_size() const { return 1; }
  void all_to_all_v(const void*, Counts, Counts, void*, Counts, Counts) {}
  Request isend(const void*, std::size_t, int, int) { return {}; }
  Request irecv(void*, std::size_t, int, int) { return {}; }
  void barrier() {}
  void broadcast(void*, std::size_t, int) {}
  void all_reduce(void*, std::size_t, ElementType, ReduceOp) {}
  void all_gather(const void*, void*, std::size_t, ElementType) {}
  void reduce_scatter(const void*, void*, std::size_t, ElementType, ReduceOp) {}
};
static_assert(!Transport<NoWait>);

struct NoBarrier {
  static constexpr MemorySpace memory_space = MemorySpace::host;
  int rank() const { return 0; }
  int world_size() const { return 1; }
  void all_to_all_v(const void*, Counts, Counts, void*, Counts, Counts) {}
  Request isend(const void*, std::size_t, int, int) { return {}; }
  Request irecv(void*, std::size_t, int, int) { return {}; }
  void wait(Request) {}
  void broadcast(void*, std::size_t, int) {}
  void all_reduce(void*, std::size_t, ElementType, ReduceOp) {}
  void all_gather(const void*, void*, std::size_t, ElementType) {}
  void reduce_scatter(const void*, void*, std::size_t, ElementType, ReduceOp) {}
};
static_assert(!Transport<NoBarrier>);

struct NoBroadcast {
  static constexpr MemorySpace memory_space = MemorySpace::host;
  int rank() const { return 0; }
  int world_size() const { return 1; }
  void all_to_all_v(const void*, Counts, Counts, void*, Counts, Counts) {}
  Request isend(const void*, std::size_t, int, int) { return {}; }
  Request irecv(void*, std::size_t, int, int) { return {}; }
  void wait(Request) {}
  void barrier() {}
  void all_reduce(void*, std::size_t, ElementType, ReduceOp) {}
  void all_gather(const void*, void*, std::size_t, ElementType) {}
  void reduce_scatter(const void*, void*, std::size_t, ElementType, ReduceOp) {}
};
static_assert(!Transport<NoBroadcast>);

struct NoReduceScatter {
  static constexpr MemorySpace memory_space = MemorySpace::host;
  int rank() const { return 0; }
  int world_size() const { return 1; }
  void all_to_all_v(const void*, Counts, Counts, void*, Counts, Counts) {}
  Request isend(const void*, std::size_t, int, int) { return {}; }
  Request irecv(void*, std::size_t, int, int) { return {}; }
  void wait(Request) {}
  void barrier() {}
  void broadcast(void*, std::size_t, int) {}
  void all_reduce(void*, std::size_t, ElementType, ReduceOp) {}
  void all_gather(const void*, void*, std::size_t, ElementType) {}
};
static_assert(!Transport<NoReduceScatter>);

// The per-member checks name the member that is missing.
static_assert(!cpdispatch::detail::transport_has_barrier<NoBarrier>);
static_assert(cpdispatch::detail::transport_has_all_to_all_v<NoBarrier>);
static_assert(!cpdispatch::detail::transport_has_collectives<NoReduceScatter>);

TEST(TransportConcept, ModelsAndNonModelsAreSortedAtCompileTime) {
  // Everything is checked by the static_asserts above; this test documents it
  // in the test list. The dispatcher works through a complete transport.
  Complete t;
  cpdispatch::Dispatcher<Complete>* none = nullptr;
  EXPECT_EQ(none, nullptr);
  EXPECT_EQ(t.world_size(), 1);
}

}  // namespace
