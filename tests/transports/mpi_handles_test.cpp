// MpiTransport frees every MPI object it creates (datatypes, the 16-bit sum
// operators, duplicated communicators, error-handler references), on success
// and on error paths. The MPI calls are intercepted through the PMPI
// profiling interface: this program's MPI_Type_contiguous etc. count and
// forward to PMPI_*, so this file is a program of its own.
#include <cpdispatch/transports/mpi.hpp>

#include <gtest/gtest.h>

#include <climits>
#include <cstddef>
#include <vector>

namespace {
struct Live {
  int types = 0, ops = 0, comms = 0, errhandlers = 0;
  friend bool operator==(const Live&, const Live&) = default;
};
Live live;
}  // namespace

extern "C" {
int MPI_Type_contiguous(int count, MPI_Datatype old, MPI_Datatype* out) {
  const int rc = PMPI_Type_contiguous(count, old, out);
  live.types += rc == MPI_SUCCESS;
  return rc;
}
int MPI_Type_create_struct(int n, const int lengths[], const MPI_Aint displs[], const MPI_Datatype types[], MPI_Datatype* out) {
  const int rc = PMPI_Type_create_struct(n, lengths, displs, types, out);
  live.types += rc == MPI_SUCCESS;
  return rc;
}
int MPI_Type_create_resized(MPI_Datatype old, MPI_Aint lb, MPI_Aint extent, MPI_Datatype* out) {
  const int rc = PMPI_Type_create_resized(old, lb, extent, out);
  live.types += rc == MPI_SUCCESS;
  return rc;
}
int MPI_Type_free(MPI_Datatype* type) {
  const int rc = PMPI_Type_free(type);
  live.types -= rc == MPI_SUCCESS;
  return rc;
}
int MPI_Op_create(MPI_User_function* f, int commute, MPI_Op* op) {
  const int rc = PMPI_Op_create(f, commute, op);
  live.ops += rc == MPI_SUCCESS;
  return rc;
}
int MPI_Op_free(MPI_Op* op) {
  const int rc = PMPI_Op_free(op);
  live.ops -= rc == MPI_SUCCESS;
  return rc;
}
int MPI_Comm_dup(MPI_Comm comm, MPI_Comm* out) {
  const int rc = PMPI_Comm_dup(comm, out);
  live.comms += rc == MPI_SUCCESS;
  return rc;
}
int MPI_Comm_free(MPI_Comm* comm) {
  const int rc = PMPI_Comm_free(comm);
  live.comms -= rc == MPI_SUCCESS;
  return rc;
}
int MPI_Comm_get_errhandler(MPI_Comm comm, MPI_Errhandler* out) {
  const int rc = PMPI_Comm_get_errhandler(comm, out);
  live.errhandlers += rc == MPI_SUCCESS;
  return rc;
}
int MPI_Errhandler_free(MPI_Errhandler* h) {
  const int rc = PMPI_Errhandler_free(h);
  live.errhandlers -= rc == MPI_SUCCESS;
  return rc;
}
}

namespace cpdispatch {
namespace {

TEST(MpiHandles, EveryObjectCreatedIsFreed) {
  const Live before = live;
  {
    MpiTransportOptions small;
    small.max_count = 3;  // derived datatypes for every message above 3 bytes
    MpiTransport owned = MpiTransport::duplicate(MPI_COMM_WORLD, small);
    MpiTransportOptions borrow;
    borrow.communicator = MpiCommunicator::borrow;
    MpiTransport borrowed(MPI_COMM_WORLD, borrow);
    EXPECT_EQ(live.comms, before.comms + 1);
    EXPECT_EQ(live.ops, before.ops + 4);  // bfloat16 and float16 sums, per transport
    EXPECT_EQ(live.errhandlers, before.errhandlers + 1);  // the borrowed communicator's saved handler
    const int W = owned.world_size(), me = owned.rank();
    const auto Wu = static_cast<std::size_t>(W);
    std::vector<std::uint16_t> halves(Wu * 10, 0x3f80);  // bfloat16 1.0
    std::vector<std::uint16_t> out(Wu * 10);
    owned.all_reduce(halves.data(), 10, ElementType::bfloat16, ReduceOp::sum);
    owned.all_gather(halves.data(), out.data(), 10, ElementType::float16);
    owned.reduce_scatter(halves.data(), out.data(), 10, ElementType::float16, ReduceOp::sum);
    owned.broadcast(halves.data(), 20, 0);
    std::vector<std::size_t> counts(Wu, 8), displs(Wu);
    for (std::size_t i = 0; i < Wu; ++i) displs[i] = 8 * i;
    std::vector<std::byte> send(Wu * 8), recv(Wu * 8);
    owned.all_to_all_v(send.data(), counts, displs, recv.data(), counts, displs);
    const Request r = owned.irecv(recv.data(), 8, me, 1);
    owned.wait(owned.isend(send.data(), 8, me, 1));
    owned.wait(r);
    // Error paths: MPI rejects the call after the derived type was built.
    EXPECT_THROW(owned.broadcast(halves.data(), 20, W), mpi_error);
    EXPECT_THROW(owned.isend(send.data(), 8, W, 0), mpi_error);
    EXPECT_EQ(live.types, before.types + 2);  // only the transports' 2-byte types remain
    MpiTransport moved(std::move(owned));
  }
  EXPECT_EQ(live, before);
}

}  // namespace
}  // namespace cpdispatch
