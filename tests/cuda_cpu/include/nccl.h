#pragma once
// An NCCL double for the cuda-cpu harness (test-only, never installed): the
// communicators of one clique are ranks driven by threads of this process;
// every operation is enqueued on the caller's stream of the CUDA runtime
// double (cuda_runtime.h) and moves bytes when the scheduler finds all of
// its partners arrived on their streams.
//
// Matching, per communicator clique: the k-th collective of every rank must
// be the same call with the same count, datatype, root and operation; the
// k-th send from rank a to rank b meets the k-th receive of b from a, with
// the same count and datatype. A mismatch is a violation (the test fails),
// the communicators involved get the asynchronous error ncclInvalidUsage,
// and nothing is copied. Operations between ncclGroupStart and ncclGroupEnd
// are one unit per communicator (they progress together); an unbalanced
// ncclGroupEnd is ncclInvalidUsage. Buffers must be device memory
// (ncclInvalidArgument otherwise, like NCCL_CHECK_POINTERS=1), and the
// current device must be the communicator's (ncclInvalidUsage).
//
// Streams: a call is enqueued on the stream it names (any stream, ordered
// by that stream's events like any other operation). A communicator runs one
// operation at a time, as NCCL's kernels of one communicator share its
// channels: a group (the parts of one ncclGroupEnd, on whatever streams)
// starts when it reaches the front of its stream and no other operation of
// the communicator is under way, and holds the communicator until all of
// its parts have moved their bytes. So two ranks whose GPUs reach a
// communicator's operations in different orders (e.g. one enqueued on two
// streams without events between them) deadlock here too: the scheduler
// reports the stall.
//
// Non-blocking communicators (ncclConfig_t::blocking = 0): a call returns
// ncclInProgress, and ncclCommGetAsyncError reports ncclInProgress until
// every partner of the call has issued its side (a peer that never does
// keeps it in progress forever, as a dead peer does). ncclCommAbort drops
// the communicator's pending work; any later use of it is a violation.
// Reductions sum in rank order with the host sim's arithmetic (real NCCL
// sums in ring or tree order).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "cpdispatch/transports/sim.hpp"
#include "cuda_runtime.h"

#define NCCL_MAJOR 2
#define NCCL_MINOR 21
#define NCCL_PATCH 5
#define NCCL_VERSION_CODE 22105

enum ncclResult_t : int {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
  ncclNumResults = 8
};
enum ncclDataType_t {
  ncclInt8 = 0,
  ncclChar = 0,
  ncclUint8 = 1,
  ncclInt32 = 2,
  ncclInt = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6,
  ncclHalf = 6,
  ncclFloat32 = 7,
  ncclFloat = 7,
  ncclFloat64 = 8,
  ncclDouble = 8,
  ncclBfloat16 = 9
};
enum ncclRedOp_t { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4 };
struct ncclUniqueId {
  char internal[128];
};
struct ncclConfig_t {
  std::size_t size;
  unsigned magic;
  unsigned version;
  int blocking;
};
#define NCCL_CONFIG_INITIALIZER {sizeof(ncclConfig_t), 0xcafebeefu, NCCL_VERSION_CODE, 1}

namespace nccl_harness {
struct Clique;
}
struct ncclComm {
  nccl_harness::Clique* clique = nullptr;
  int rank = 0;
  int device = 0;
  bool blocking = true;
  bool aborted = false;
  bool destroyed = false;
  ncclResult_t async = ncclSuccess;
  // Issued (at the call) and arrived (on the stream) counts: collectives, and per peer sends and receives.
  std::uint64_t issued_colls = 0, arrived_colls = 0;
  std::vector<std::uint64_t> issued_sends, issued_recvs, arrived_sends, arrived_recvs;
  struct Waiting {
    int kind;  // 0 send, 1 recv, 2 collective
    int peer;
    std::uint64_t index;
  };
  std::vector<Waiting> in_progress;  // non-blocking: calls whose partners have not all issued theirs
  // The operation under way on the GPU (one at a time): its group, and how many of its stream operations have started and not finished.
  std::uint64_t running_group = 0;
  int running = 0;
};
using ncclComm_t = ncclComm*;

namespace nccl_harness {

enum Kind { send_kind = 0, recv_kind = 1, coll_kind = 2 };

/// One operation as called.
struct Part {
  Kind kind;
  const char* call;
  ncclComm_t comm;
  const void* send;
  void* recv;
  std::size_t count;
  ncclDataType_t type;
  int peer;  // send/recv: the peer; collectives: the root (-1 none)
  ncclRedOp_t op;
  cudaStream_t stream = nullptr;
  // Per execution: where it is on the exchange board, and whether its bytes have moved.
  std::uint64_t index = 0;
  bool done = false;
};

struct Clique {
  int size = 0;
  std::vector<ncclComm_t> comms;
  std::map<std::tuple<int, int, std::uint64_t>, std::pair<Part*, Part*>> p2p;  // (from, to, k) -> send, recv
  std::map<std::uint64_t, std::vector<Part*>> colls;                            // k -> by rank
};

struct State {
  std::vector<std::unique_ptr<Clique>> cliques;
  std::vector<std::unique_ptr<ncclComm>> comms;
  std::map<std::string, Clique*> by_id;
  std::uint64_t next_id = 1;
  std::uint64_t next_group = 1;
};
inline State& state() {
  static State s;
  return s;
}

inline thread_local std::string last_error;
/// Test hook: the next ncclGroupEnd on this thread drops its group and returns this (ncclSuccess: none).
inline thread_local ncclResult_t fail_next_group_end = ncclSuccess;
inline thread_local int group_depth = 0;
inline thread_local std::vector<Part> group;

inline std::size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    default: return 8;
  }
}
inline cpdispatch::ElementType element_of(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: return cpdispatch::ElementType::int8;
    case ncclUint8: return cpdispatch::ElementType::uint8;
    case ncclInt32: case ncclUint32: return cpdispatch::ElementType::int32;
    case ncclInt64: case ncclUint64: return cpdispatch::ElementType::int64;
    case ncclFloat16: return cpdispatch::ElementType::float16;
    case ncclFloat32: return cpdispatch::ElementType::float32;
    case ncclFloat64: return cpdispatch::ElementType::float64;
    case ncclBfloat16: return cpdispatch::ElementType::bfloat16;
  }
  return cpdispatch::ElementType::uint8;
}

inline ncclResult_t error(ncclResult_t code, std::string what) {
  last_error = std::move(what);
  return code;
}

/// A violation: the communicators of `parts` get ncclInvalidUsage, nothing moves.
inline void mismatch(cuda_harness::Runtime& rt, const std::string& what, std::initializer_list<Part*> parts) {
  rt.violation("NCCL: " + what);
  for (Part* p : parts) {
    p->comm->async = ncclInvalidUsage;
    p->done = true;
  }
}

inline bool same_call(const Part& a, const Part& b) {
  return std::string(a.call) == b.call && a.count == b.count && a.type == b.type && a.peer == b.peer && a.op == b.op;
}

/// The bytes of one collective, every rank arrived: computed in full, then written.
inline void run_collective(cuda_harness::Runtime& rt, const std::vector<Part*>& ranks) {
  const Part& first = *ranks[0];
  const std::size_t n = static_cast<std::size_t>(ranks.size());
  const std::size_t bytes = first.count * type_size(first.type);
  const std::string call = first.call;
  const std::size_t in_bytes = call == "ncclReduceScatter" ? bytes * n : bytes;
  const std::size_t out_bytes = call == "ncclAllGather" ? bytes * n : bytes;
  for (Part* p : ranks) {
    const bool has_input = call != "ncclBroadcast" || p->comm->rank == first.peer;
    if ((has_input && !rt.device_range(p->call, "the send buffer", p->send, in_bytes)) ||
        !rt.device_range(p->call, "the receive buffer", p->recv, out_bytes)) {
      return;
    }
  }
  std::vector<std::vector<std::byte>> out(n, std::vector<std::byte>(out_bytes));
  auto input = [&](std::size_t r, std::size_t offset) { return static_cast<const std::byte*>(ranks[r]->send) + offset; };
  for (std::size_t r = 0; r < n; ++r) {
    if (call == "ncclBroadcast") {
      if (bytes) std::memcpy(out[r].data(), input(static_cast<std::size_t>(first.peer), 0), bytes);
    } else if (call == "ncclAllGather") {
      for (std::size_t k = 0; k < n; ++k) {
        if (bytes) std::memcpy(out[r].data() + k * bytes, input(k, 0), bytes);
      }
    } else {  // sums in rank order
      std::vector<const std::byte*> sources;
      for (std::size_t k = 0; k < n; ++k) sources.push_back(input(k, call == "ncclReduceScatter" ? r * bytes : 0));
      cpdispatch::detail::sim::sum(element_of(first.type), out[r].data(), sources, first.count);
    }
  }
  for (std::size_t r = 0; r < n; ++r) {
    if (out_bytes) std::memcpy(ranks[r]->recv, out[r].data(), out_bytes);
    ranks[r]->done = true;
  }
}

/// Puts an arrived part on its clique's board; moves bytes when its partners are there.
inline void arrive(cuda_harness::Runtime& rt, Part& p) {
  ncclComm& c = *p.comm;
  Clique& q = *c.clique;
  const auto peer = static_cast<std::size_t>(p.peer);
  if (p.kind == coll_kind) {
    p.index = c.arrived_colls++;
    std::vector<Part*>& slot = q.colls[p.index];
    slot.resize(static_cast<std::size_t>(q.size), nullptr);
    slot[static_cast<std::size_t>(c.rank)] = &p;
    for (Part* o : slot) {
      if (!o) return;
    }
    for (Part* o : slot) {
      if (!same_call(*o, *slot[0])) {
        const std::vector<Part*> all = slot;
        q.colls.erase(p.index);
        rt.violation(std::string("NCCL: collective ") + std::to_string(p.index) + " does not match: rank 0 calls " + all[0]->call + " of " +
                     std::to_string(all[0]->count) + ", rank " + std::to_string(o->comm->rank) + " calls " + o->call + " of " +
                     std::to_string(o->count) + " (or the datatype, root or operation differ)");
        for (Part* m : all) {
          m->comm->async = ncclInvalidUsage;
          m->done = true;
        }
        return;
      }
    }
    const std::vector<Part*> all = slot;
    q.colls.erase(p.index);
    run_collective(rt, all);
    return;
  }
  const bool is_send = p.kind == send_kind;
  p.index = is_send ? c.arrived_sends[peer]++ : c.arrived_recvs[peer]++;
  const auto key = is_send ? std::tuple{c.rank, p.peer, p.index} : std::tuple{p.peer, c.rank, p.index};
  auto& [s, r] = q.p2p[key];
  (is_send ? s : r) = &p;
  if (!s || !r) return;
  Part* send = s;
  Part* recv = r;
  q.p2p.erase(key);
  if (send->count != recv->count || send->type != recv->type) {
    mismatch(rt,
             "send " + std::to_string(send->index) + " from rank " + std::to_string(send->comm->rank) + " to rank " +
                 std::to_string(recv->comm->rank) + " has " + std::to_string(send->count) + " elements of type " +
                 std::to_string(send->type) + ", the receive " + std::to_string(recv->count) + " of type " + std::to_string(recv->type),
             {send, recv});
    return;
  }
  const std::size_t bytes = send->count * type_size(send->type);
  if (rt.device_range("ncclSend", "the send buffer", send->send, bytes) && rt.device_range("ncclRecv", "the receive buffer", recv->recv, bytes) &&
      bytes) {
    std::memmove(recv->recv, send->send, bytes);
  }
  send->done = recv->done = true;
}

/// The stream operation of one communicator's share of a group (`group`:
/// the ncclGroupEnd it came from); the communicator runs one group at a time.
inline bool step(cuda_harness::Runtime& rt, std::vector<Part>& parts, bool& started, std::uint64_t group) {
  if (parts.empty()) return true;
  ncclComm& c = *parts[0].comm;
  auto finish = [&] {
    started = false;  // a graph replays the same operation
    if (--c.running == 0) c.running_group = 0;
    return true;
  };
  if (c.aborted) return started ? finish() : true;  // an aborted communicator's work is dropped
  if (!started) {
    if (c.running > 0 && c.running_group != group) return false;  // another operation holds the communicator
    c.running_group = group;
    ++c.running;
    started = true;
    for (Part& p : parts) p.done = false;
    for (Part& p : parts) arrive(rt, p);
  }
  for (const Part& p : parts) {
    if (!p.done) return false;
  }
  return finish();
}

inline bool partners_issued(const ncclComm& c, const ncclComm::Waiting& w) {
  const Clique& q = *c.clique;
  if (w.kind == coll_kind) {
    for (ncclComm_t o : q.comms) {
      if (!o || o->issued_colls <= w.index) return false;
    }
    return true;
  }
  const ncclComm_t o = q.comms[static_cast<std::size_t>(w.peer)];
  if (!o) return false;
  const auto me = static_cast<std::size_t>(c.rank);
  return (w.kind == send_kind ? o->issued_recvs[me] : o->issued_sends[me]) > w.index;
}

inline ncclResult_t check_comm(ncclComm_t comm, const char* call) {
  if (!comm) return error(ncclInvalidArgument, std::string(call) + ": the communicator is null");
  if (comm->aborted || comm->destroyed) {
    cuda_harness::Runtime::get().violation(std::string(call) + ": use of a communicator after " + (comm->aborted ? "ncclCommAbort" : "ncclCommDestroy"));
    return error(ncclInvalidArgument, std::string(call) + ": the communicator was released");
  }
  return ncclSuccess;
}

/// Submits the calls of a finished group (or one ungrouped call).
inline ncclResult_t submit(std::vector<Part> parts) {
  auto lock = cuda_harness::lock();
  cuda_harness::Runtime& rt = cuda_harness::Runtime::get();
  std::map<std::pair<ncclComm_t, cudaStream_t>, std::vector<Part>> by_comm;
  for (Part& p : parts) by_comm[{p.comm, p.stream}].push_back(p);
  const std::uint64_t group = state().next_group++;
  bool in_progress = false;
  for (auto& [key, mine] : by_comm) {
    const ncclComm_t comm = key.first;
    const cudaStream_t stream = key.second;
    for (const Part& p : mine) {
      const auto peer = static_cast<std::size_t>(p.peer);
      const std::uint64_t index = p.kind == coll_kind ? comm->issued_colls++ : p.kind == send_kind ? comm->issued_sends[peer]++ : comm->issued_recvs[peer]++;
      if (!comm->blocking) comm->in_progress.push_back({p.kind, p.peer, index});
    }
    in_progress = in_progress || !comm->blocking;
    auto shared = std::make_shared<std::vector<Part>>(std::move(mine));
    auto started = std::make_shared<bool>(false);
    std::string name = std::string((*shared)[0].call) + " on rank " + std::to_string(comm->rank);
    const cudaError_t rc = rt.enqueue(rt.resolve(stream), name, [&rt, shared, started, group] { return step(rt, *shared, *started, group); });
    if (rc != cudaSuccess) return error(ncclUnhandledCudaError, std::string("enqueueing on the stream: ") + cudaGetErrorName(rc));
  }
  return in_progress ? ncclInProgress : ncclSuccess;
}

/// Checks and records (or, outside a group, submits) one call.
inline ncclResult_t call(Part p, cudaStream_t stream, std::size_t in_bytes, std::size_t out_bytes) {
  {
    auto lock = cuda_harness::lock();
    if (ncclResult_t rc = check_comm(p.comm, p.call); rc != ncclSuccess) return rc;
  }
  if (cuda_harness::current_device != p.comm->device) {
    return error(ncclInvalidUsage, std::string(p.call) + ": the current device is " + std::to_string(cuda_harness::current_device) +
                                       ", the communicator's is " + std::to_string(p.comm->device));
  }
  {
    auto lock = cuda_harness::lock();
    cuda_harness::Runtime& rt = cuda_harness::Runtime::get();
    const bool has_send = p.kind != recv_kind && !(std::string(p.call) == "ncclBroadcast" && p.comm->rank != p.peer);
    if ((has_send && in_bytes && !rt.find(p.send, in_bytes)) || (p.kind != send_kind && out_bytes && !rt.find(p.recv, out_bytes))) {
      return error(ncclInvalidArgument, std::string(p.call) + ": a buffer is not device memory of the size the call needs");
    }
  }
  if (p.kind != coll_kind && (p.peer < 0 || p.peer >= p.comm->clique->size)) return error(ncclInvalidArgument, std::string(p.call) + ": bad peer");
  p.stream = stream;
  if (group_depth > 0) {
    group.push_back(p);
    return ncclSuccess;
  }
  return submit({p});
}

}  // namespace nccl_harness

inline const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}
inline const char* ncclGetLastError(ncclComm_t) { return nccl_harness::last_error.c_str(); }

inline ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  auto lock = cuda_harness::lock();
  *id = {};
  std::snprintf(id->internal, sizeof id->internal, "clique-%llu", static_cast<unsigned long long>(nccl_harness::state().next_id++));
  return ncclSuccess;
}

namespace nccl_harness {
inline ncclComm_t join(Clique& q, int rank, int device, bool blocking) {
  auto c = std::make_unique<ncclComm>();
  c->clique = &q;
  c->rank = rank;
  c->device = device;
  c->blocking = blocking;
  const auto n = static_cast<std::size_t>(q.size);
  c->issued_sends.assign(n, 0);
  c->issued_recvs.assign(n, 0);
  c->arrived_sends.assign(n, 0);
  c->arrived_recvs.assign(n, 0);
  q.comms[static_cast<std::size_t>(rank)] = c.get();
  state().comms.push_back(std::move(c));
  return state().comms.back().get();
}
}  // namespace nccl_harness

inline ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t* config) {
  using namespace nccl_harness;
  auto lock = cuda_harness::lock();
  if (nranks < 1 || rank < 0 || rank >= nranks) return error(ncclInvalidArgument, "ncclCommInitRank: bad rank or size");
  Clique*& q = state().by_id[id.internal];
  if (!q) {
    state().cliques.push_back(std::make_unique<Clique>());
    q = state().cliques.back().get();
    q->size = nranks;
    q->comms.assign(static_cast<std::size_t>(nranks), nullptr);
  }
  if (q->size != nranks || q->comms[static_cast<std::size_t>(rank)]) return error(ncclInvalidUsage, "ncclCommInitRank: size differs or rank taken");
  *comm = join(*q, rank, cuda_harness::current_device, !config || config->blocking != 0);
  return ncclSuccess;
}
inline ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  return ncclCommInitRankConfig(comm, nranks, id, rank, nullptr);
}
inline ncclResult_t ncclCommInitAll(ncclComm_t* comms, int n, const int* devices) {
  using namespace nccl_harness;
  auto lock = cuda_harness::lock();
  if (n < 1) return error(ncclInvalidArgument, "ncclCommInitAll: no ranks");
  state().cliques.push_back(std::make_unique<Clique>());
  Clique& q = *state().cliques.back();
  q.size = n;
  q.comms.assign(static_cast<std::size_t>(n), nullptr);
  for (int r = 0; r < n; ++r) {
    const int d = devices ? devices[r] : r;
    if (d < 0 || d >= cuda_harness::Runtime::get().devices) return error(ncclInvalidArgument, "ncclCommInitAll: bad device");
    comms[r] = join(q, r, d, true);
  }
  return ncclSuccess;
}
inline ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  auto lock = cuda_harness::lock();
  if (ncclResult_t rc = nccl_harness::check_comm(comm, "ncclCommDestroy"); rc != ncclSuccess) return rc;
  comm->destroyed = true;
  return ncclSuccess;
}
inline ncclResult_t ncclCommAbort(ncclComm_t comm) {
  auto lock = cuda_harness::lock();
  if (ncclResult_t rc = nccl_harness::check_comm(comm, "ncclCommAbort"); rc != ncclSuccess) return rc;
  comm->aborted = true;
  comm->in_progress.clear();
  cuda_harness::Runtime::get().progress.notify_all();
  return ncclSuccess;
}
inline ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async) {
  auto lock = cuda_harness::lock();
  if (ncclResult_t rc = nccl_harness::check_comm(comm, "ncclCommGetAsyncError"); rc != ncclSuccess) return rc;
  if (comm->async != ncclSuccess) {
    *async = comm->async;
    return ncclSuccess;
  }
  auto& w = comm->in_progress;
  std::erase_if(w, [&](const ncclComm::Waiting& x) { return nccl_harness::partners_issued(*comm, x); });
  *async = w.empty() ? ncclSuccess : ncclInProgress;
  return ncclSuccess;
}
inline ncclResult_t ncclCommCount(ncclComm_t comm, int* count) {
  auto lock = cuda_harness::lock();
  if (ncclResult_t rc = nccl_harness::check_comm(comm, "ncclCommCount"); rc != ncclSuccess) return rc;
  *count = comm->clique->size;
  return ncclSuccess;
}
inline ncclResult_t ncclCommUserRank(ncclComm_t comm, int* rank) {
  auto lock = cuda_harness::lock();
  if (ncclResult_t rc = nccl_harness::check_comm(comm, "ncclCommUserRank"); rc != ncclSuccess) return rc;
  *rank = comm->rank;
  return ncclSuccess;
}
inline ncclResult_t ncclCommCuDevice(ncclComm_t comm, int* device) {
  auto lock = cuda_harness::lock();
  if (ncclResult_t rc = nccl_harness::check_comm(comm, "ncclCommCuDevice"); rc != ncclSuccess) return rc;
  *device = comm->device;
  return ncclSuccess;
}

inline ncclResult_t ncclGroupStart() {
  ++nccl_harness::group_depth;
  return ncclSuccess;
}
inline ncclResult_t ncclGroupEnd() {
  using namespace nccl_harness;
  if (group_depth == 0) return error(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--group_depth > 0) return ncclSuccess;
  std::vector<Part> parts = std::move(group);
  group.clear();
  if (const ncclResult_t injected = std::exchange(fail_next_group_end, ncclSuccess); injected != ncclSuccess) {
    return error(injected, "ncclGroupEnd: failure injected by the test");
  }
  if (parts.empty()) return ncclSuccess;
  return submit(std::move(parts));
}

inline ncclResult_t ncclSend(const void* buf, std::size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t stream) {
  const std::size_t bytes = count * nccl_harness::type_size(type);
  return nccl_harness::call({nccl_harness::send_kind, "ncclSend", comm, buf, nullptr, count, type, peer, ncclSum}, stream, bytes, 0);
}
inline ncclResult_t ncclRecv(void* buf, std::size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t stream) {
  const std::size_t bytes = count * nccl_harness::type_size(type);
  return nccl_harness::call({nccl_harness::recv_kind, "ncclRecv", comm, nullptr, buf, count, type, peer, ncclSum}, stream, 0, bytes);
}
inline ncclResult_t ncclAllReduce(const void* send, void* recv, std::size_t count, ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                                  cudaStream_t stream) {
  if (op != ncclSum) return nccl_harness::error(ncclInvalidArgument, "ncclAllReduce: the double sums only");
  const std::size_t bytes = count * nccl_harness::type_size(type);
  return nccl_harness::call({nccl_harness::coll_kind, "ncclAllReduce", comm, send, recv, count, type, -1, op}, stream, bytes, bytes);
}
inline ncclResult_t ncclBroadcast(const void* send, void* recv, std::size_t count, ncclDataType_t type, int root, ncclComm_t comm,
                                  cudaStream_t stream) {
  if (comm && (root < 0 || root >= comm->clique->size)) return nccl_harness::error(ncclInvalidArgument, "ncclBroadcast: bad root");
  const std::size_t bytes = count * nccl_harness::type_size(type);
  return nccl_harness::call({nccl_harness::coll_kind, "ncclBroadcast", comm, send, recv, count, type, root, ncclSum}, stream, bytes, bytes);
}
inline ncclResult_t ncclAllGather(const void* send, void* recv, std::size_t count, ncclDataType_t type, ncclComm_t comm, cudaStream_t stream) {
  const std::size_t bytes = count * nccl_harness::type_size(type);
  const std::size_t n = comm ? static_cast<std::size_t>(comm->clique->size) : 1;
  return nccl_harness::call({nccl_harness::coll_kind, "ncclAllGather", comm, send, recv, count, type, -1, ncclSum}, stream, bytes, bytes * n);
}
inline ncclResult_t ncclReduceScatter(const void* send, void* recv, std::size_t count, ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                                      cudaStream_t stream) {
  if (op != ncclSum) return nccl_harness::error(ncclInvalidArgument, "ncclReduceScatter: the double sums only");
  const std::size_t bytes = count * nccl_harness::type_size(type);
  const std::size_t n = comm ? static_cast<std::size_t>(comm->clique->size) : 1;
  return nccl_harness::call({nccl_harness::coll_kind, "ncclReduceScatter", comm, send, recv, count, type, -1, op}, stream, bytes * n, bytes);
}
