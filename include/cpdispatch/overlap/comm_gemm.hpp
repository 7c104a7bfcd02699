#pragma once
// The overlapped GEMM: D = op(A) x op(B) with a
// collective running while the GEMM computes, generic over the Transport
// concept and the GEMM backend concept (gemm/gemm.hpp). Host memory.
//
//   comm_gemm(transport, gemm, buffer, a, transa, b, transb, d, rs_output)
//   comm_gemm(transport, gemm, registry, type, method, id, a, transa, b, transb, d, rs_output)   // by buffer id
//   comm_gemm(transport, gemm, type, method, id, a, transa, b, transb, d, rs_output)             // id, process-wide registry
//   comm_gemm(transport, gemm, a, transa, b, transb, d)                                          // NONE: plain GEMM
//
// Matrices are row-major MatrixViews with contiguous rows. op(A) is m x k
// (A is stored m x k, or k x m when transa), op(B) is k x n (B stored k x n,
// or n x k when transb). tp = buffer.tp_size() = transport.world_size().
//
//   type, method      a                      buffer (M x C)             d            rs_output
//   NONE NONE         op(A) m x k            none                       m x n        -
//   RS BULK           op(A) m x k            caller's data, M x C       m x n        M/tp x C: reduce-scatter of the buffer
//   RS PIPELINE       op(A) m x k            GEMM output, m x n         -            m/tp x n: reduce-scatter of the GEMM output
//   RS RING_EXCHANGE  op(A) m x k            GEMM output, m x n         -            m/tp x n: reduce-scatter of the GEMM output
//   AG RING_EXCHANGE  op(A) shard ml x k     gathered op(A), tp*ml x k  tp*ml x n    -
//
// ("-": pass an empty view, {}.) Each matches the unoverlapped computation:
// RS = GEMM, then transport.reduce_scatter of its rows; AG = all-gather of
// the shards (rank r's shard is rows [r*ml, (r+1)*ml) of op(A)), then GEMM.
//
// How each overlaps (the helper thread, CommOverlapOptions::helper_thread):
// - BULK (RS): one full GEMM runs while ONE transport.reduce_scatter of the
//   buffer, which the caller filled (CommOverlapBuffer::copy_into / view),
//   proceeds: the two are independent.
// - PIPELINE (RS): the output rows are split into num_splits chunks; chunk i
//   holds, for every rank p, rows [p*m/tp + i*h, +h) of D (h = m/(tp*num_splits)),
//   laid out contiguously in the buffer, so chunk i's reduce-scatter is one
//   transport.reduce_scatter, issued as soon as chunk i is computed and
//   running while chunk i+1 computes. One reduce-scatter per chunk, in chunk
//   order; the last chunk's is left exposed. The buffer holds D in this
//   chunk-major order, not in D's row order.
// - RING_EXCHANGE (AG): tp steps; at step i the rank multiplies the shard it
//   holds, shard c = (rank - i) mod tp, and writes rows [c*ml, (c+1)*ml) of D,
//   while sending shard c to rank + 1 and receiving shard (rank - i - 1) mod tp
//   from rank - 1 into its place in the buffer (irecv, isend, wait, wait per
//   step). The local shard goes first; step i's GEMM waits only for step
//   i-1's receive. Afterwards the buffer holds the all-gathered op(A): shard p
//   at elements [p*ml*k, (p+1)*ml*k), in A's stored orientation (ml x k, or
//   k x ml when transa).
// - RING_EXCHANGE (RS): tp steps; at step s < tp-1 the rank computes the
//   partial rows for peer p = (rank + s + 1) mod tp, and sends them to p
//   (irecv from (rank - s - 1) mod tp, isend, wait, wait) while the next
//   partial computes. Its own partial is computed last; then the tp partials
//   are summed into rs_output in rank order 0, 1, ..., tp-1 (a fixed order,
//   so every run gives the same bits). The buffer holds the rank's own
//   partial D in row order; the peers' blocks land in its staging.
// Reduce-scatter is the concept's reduce_scatter (BULK, PIPELINE) and a
// direct exchange of partials over isend/irecv (RING_EXCHANGE).
//
// Threads: the transport is not assumed thread-safe. Each call starts ONE
// helper thread; all transport calls of the call happen in order on one
// thread (the helper by default; the caller with HelperThread::gemm), all
// GEMM calls on the other, synchronised by two step counters. The transport
// and the GEMM backend must not be used by anybody else during the call.
// Under MPI, transport calls on the helper need MPI_Init_thread with
// MPI_THREAD_SERIALIZED; HelperThread::gemm needs only MPI_THREAD_FUNNELED.
// With tp = 1 ring exchange has nothing to send and starts no thread.
//
// Errors (cpdispatch::error family; messages give expected and actual
// values): Transformer Engine's "AllGather with bulk overlap not supported",
// "pipeline overlap is only supported for ReduceScatter", "Buffer size is incorrect",
// "Invalid collective type"; "atomic GEMM requires the CUDA backend" (every
// backend: cpdispatch has no CUDA GEMM backend yet, and a device backend does
// not compile here: the buffer is host memory); shape, dtype, tp_size and
// aliasing errors. All are raised before any transport call. A failure
// during the call (transport or GEMM) stops the other side at its next step
// (BULK's single GEMM runs to its end) and is rethrown; the transport may
// then be unusable (transport contract).

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <condition_variable>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>

#include "cpdispatch/bytes.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/overlap/comm_overlap.hpp"
#include "cpdispatch/gemm/gemm.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch::overlap {


/// A row-major matrix in the caller's memory, rows contiguous (leading
/// dimension == cols). An empty view ({}) stands for "not used".
template <class T>
struct MatrixView {
  T* data = nullptr;
  std::size_t rows = 0;
  std::size_t cols = 0;

  operator MatrixView<const T>() const noexcept
    requires(!std::is_const_v<T>)
  {
    return {data, rows, cols};
  }
};

template <class T>
MatrixView<T> matrix_view(T* data, std::size_t rows, std::size_t cols) noexcept {
  return {data, rows, cols};
}

namespace detail {

/// A counter one side advances and the other waits on; abort() releases the
/// waiter when the advancing side fails.
class StepCounter {
 public:
  void advance_to(int steps) {
    {
      const std::lock_guard lock(mutex_);
      steps_ = steps;
    }
    cv_.notify_all();
  }
  /// True once `steps` are done; false when the call was aborted first.
  bool wait_for(int steps) {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return steps_ >= steps || aborted_; });
    return !aborted_;
  }
  void abort() {
    {
      const std::lock_guard lock(mutex_);
      aborted_ = true;
    }
    cv_.notify_all();
  }
  bool aborted() {
    const std::lock_guard lock(mutex_);
    return aborted_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int steps_ = 0;
  bool aborted_ = false;
};

/// The synchronisation of one overlapped call: GEMM steps done, communication
/// steps done, and the first failure of either side.
struct OverlapSync {
  StepCounter computed;
  StepCounter communicated;
  std::mutex mutex;
  std::exception_ptr first_error;

  void fail(std::exception_ptr e) {
    {
      const std::lock_guard lock(mutex);
      if (!first_error) first_error = std::move(e);
    }
    computed.abort();
    communicated.abort();
  }
};

/// Runs the GEMM side and the communication side at once, one of them on the
/// buffer's helper thread, and rethrows the first failure after both have stopped.
template <class GemmSide, class CommSide>
void run_side_by_side(CommOverlapBuffer& buffer, OverlapSync& sync, GemmSide&& gemm_side, CommSide&& comm_side) {
  auto guarded_gemm = [&] {
    try {
      gemm_side();
    } catch (...) {
      sync.fail(std::current_exception());
    }
  };
  auto guarded_comm = [&] {
    try {
      comm_side();
    } catch (...) {
      sync.fail(std::current_exception());
    }
  };
  HelperWorker& helper = buffer.helper();
  if (buffer.options().helper_thread == HelperThread::communication) {
    helper.run(guarded_comm);
    guarded_gemm();
  } else {
    helper.run(guarded_gemm);
    guarded_comm();
  }
  helper.wait();
  if (sync.first_error) std::rethrow_exception(sync.first_error);
}

/// Rows and columns of op(X) for X stored rows x cols.
struct OpShape {
  std::size_t rows;
  std::size_t cols;
};
template <class T>
OpShape op_shape(MatrixView<const T> x, gemm::Transpose t) noexcept {
  return t == gemm::Transpose::no ? OpShape{x.rows, x.cols} : OpShape{x.cols, x.rows};
}

/// Row `row` of op(A): a pointer that, with lda = a.cols, addresses op(A)'s rows from there on.
template <class T>
const T* op_row(MatrixView<const T> a, gemm::Transpose ta, std::size_t row) noexcept {
  return ta == gemm::Transpose::no ? a.data + row * a.cols : a.data + row;
}

template <class T>
std::size_t checked_size(const char* who, const char* name, MatrixView<T> x) {
  const std::string what = cpdispatch::detail::concat(who, ": ", name, " (", x.rows, " x ", x.cols, " elements of ", sizeof(T), " bytes)");
  cpdispatch::detail::checked_mul(cpdispatch::detail::checked_mul(x.rows, x.cols, what), sizeof(T), what);
  return x.rows * x.cols;
}

/// A view the call reads or writes: non-null and of the expected shape.
template <class T>
void check_view(const char* who, const char* name, MatrixView<T> x, std::size_t rows, std::size_t cols, const char* why) {
  checked_size(who, name, x);
  if (x.rows != rows || x.cols != cols) {
    cpdispatch::detail::fail(who, ": ", name, " is ", x.rows, " x ", x.cols, ", expected ", rows, " x ", cols, " (", why, ")");
  }
  if (x.data == nullptr && rows * cols != 0) cpdispatch::detail::fail(who, ": ", name, " is null (", rows, " x ", cols, " expected)");
}

/// A view the method does not use must be empty, so a misplaced output is not silently ignored.
template <class T>
void check_unused(const char* who, const char* name, MatrixView<T> x, const std::string& method) {
  if (x.data != nullptr || x.rows != 0 || x.cols != 0) {
    cpdispatch::detail::fail(who, ": ", name, " is not used by ", method, ", expected an empty view ({}), got ", x.rows, " x ",
                             x.cols);
  }
}

/// A run of memory one side of the call touches.
struct Region {
  const char* name;
  const void* data;
  std::size_t bytes;
};

/// Rejects two regions that share memory: one side writes what the other reads.
inline void check_disjoint(const char* who, Region x, Region y) {
  if (cpdispatch::detail::regions_overlap(x.data, x.bytes, y.data, y.bytes)) {
    cpdispatch::detail::fail(who, ": ", x.name, " and ", y.name, " overlap in memory (", x.bytes, " bytes at ", x.data, ", ",
                             y.bytes, " bytes at ", y.data, "); the overlapped GEMM writes one while it reads the other");
  }
}

template <class T>
Region region(const char* name, MatrixView<T> x) noexcept {
  return {name, x.data, x.rows * x.cols * sizeof(T)};
}

/// D (m x n, row stride n) = op(A) rows [row0, row0 + rows) x op(B).
template <class G, class T>
void gemm_rows(G& gemm, MatrixView<const T> a, gemm::Transpose ta, std::size_t row0, std::size_t rows, MatrixView<const T> b,
               gemm::Transpose tb, std::size_t n, std::size_t k, T* out) {
  gemm.gemm(ta, tb, rows, n, k, T(1), op_row(a, ta, row0), a.cols, b.data, b.cols, T(0), out, n);
}

/// Sizes the unoverlapped GEMM D = op(A) x op(B) implies, after checking that they agree.
struct GemmDims {
  std::size_t m, n, k;
};
template <class T>
GemmDims gemm_dims(const char* who, MatrixView<const T> a, gemm::Transpose ta, MatrixView<const T> b, gemm::Transpose tb) {
  checked_size(who, "A", a);
  checked_size(who, "B", b);
  const OpShape oa = op_shape(a, ta);
  const OpShape ob = op_shape(b, tb);
  if (oa.cols != ob.rows) {
    cpdispatch::detail::fail(who, ": op(A) is ", oa.rows, " x ", oa.cols, " and op(B) is ", ob.rows, " x ", ob.cols,
                             ": the inner dimensions must agree (expected op(B) with ", oa.cols, " rows, got ", ob.rows, ")");
  }
  if (a.data == nullptr && a.rows * a.cols != 0) cpdispatch::detail::fail(who, ": A is null (", a.rows, " x ", a.cols, ")");
  if (b.data == nullptr && b.rows * b.cols != 0) cpdispatch::detail::fail(who, ": B is null (", b.rows, " x ", b.cols, ")");
  return {oa.rows, ob.cols, oa.cols};
}

/// "Buffer size is incorrect" unless the buffer is rows x cols.
inline void check_buffer_shape(const char* who, const CommOverlapBuffer& buffer, std::size_t rows, std::size_t cols,
                               const char* holds) {
  if (buffer.rows() != rows || buffer.cols() != cols) {
    cpdispatch::detail::fail(who, ": Buffer size is incorrect: ", to_string(buffer.type()), " ", to_string(buffer.method()),
                             " puts ", holds, " in the buffer: expected ", rows, " x ", cols, " = ", rows * cols,
                             " elements, got ", buffer.rows(), " x ", buffer.cols(), " = ", buffer.size(), " elements");
  }
}

// ---- the methods ---------------------------------------------------------------

template <class Tr, class G, class T>
void bulk_rs(Tr& transport, G& gemm, CommOverlapBuffer& buffer, MatrixView<const T> a, gemm::Transpose ta,
             MatrixView<const T> b, gemm::Transpose tb, GemmDims dims, MatrixView<T> d, MatrixView<T> rs_output) {
  const std::size_t count = (buffer.rows() / static_cast<std::size_t>(buffer.tp_size())) * buffer.cols();
  const T* send = buffer.view<T>().data();
  OverlapSync sync;
  run_side_by_side(
      buffer, sync,
      [&] { gemm_rows(gemm, a, ta, 0, dims.m, b, tb, dims.n, dims.k, d.data); },  // one call: nothing to stop
      [&] { transport.reduce_scatter(send, rs_output.data, count, buffer.dtype(), ReduceOp::sum); });
}

template <class Tr, class G, class T>
void pipeline_rs(Tr& transport, G& gemm, CommOverlapBuffer& buffer, MatrixView<const T> a, gemm::Transpose ta,
                 MatrixView<const T> b, gemm::Transpose tb, GemmDims dims, MatrixView<T> rs_output) {
  const auto tp = static_cast<std::size_t>(buffer.tp_size());
  const int splits = buffer.num_splits();
  const std::size_t block = dims.m / tp;                                // rows per rank
  const std::size_t h = block / static_cast<std::size_t>(splits);  // rows per rank per chunk
  T* out = buffer.view<T>().data();
  OverlapSync sync;
  run_side_by_side(
      buffer, sync,
      [&] {
        for (int i = 0; i < splits; ++i) {
          if (sync.computed.aborted()) return;  // the communication failed: stop computing
          const auto ui = static_cast<std::size_t>(i);
          for (std::size_t p = 0; p < tp; ++p) {
            gemm_rows(gemm, a, ta, p * block + ui * h, h, b, tb, dims.n, dims.k, out + (ui * tp + p) * h * dims.n);
          }
          sync.computed.advance_to(i + 1);
        }
      },
      [&] {
        for (int i = 0; i < splits; ++i) {
          if (!sync.computed.wait_for(i + 1)) return;
          const auto ui = static_cast<std::size_t>(i);
          transport.reduce_scatter(out + ui * tp * h * dims.n, rs_output.data + ui * h * dims.n, h * dims.n,
                                   buffer.dtype(), ReduceOp::sum);
        }
      });
}

inline int ring_peer(int rank, int offset, int tp) noexcept { return ((rank + offset) % tp + tp) % tp; }

template <class Tr, class G, class T>
void ring_exchange_ag(Tr& transport, G& gemm, CommOverlapBuffer& buffer, MatrixView<const T> shard, gemm::Transpose ta,
                      MatrixView<const T> b, gemm::Transpose tb, std::size_t ml, std::size_t n, std::size_t k, MatrixView<T> d) {
  const int tp = buffer.tp_size();
  const int rank = transport.rank();
  const std::size_t shard_elems = ml * k;
  T* gathered = buffer.view<T>().data();
  auto slot = [&](int p) { return gathered + static_cast<std::size_t>(p) * shard_elems; };
  if (shard.data != slot(rank)) gemm.copy(shard.data, slot(rank), shard_elems);
  // op(A) of shard c, as stored in its slot: ml x k, or k x ml when transa.
  auto held = [&](int c) {
    return ta == gemm::Transpose::no ? MatrixView<const T>{slot(c), ml, k} : MatrixView<const T>{slot(c), k, ml};
  };
  auto multiply = [&](int c) { gemm_rows(gemm, held(c), ta, 0, ml, b, tb, n, k, d.data + static_cast<std::size_t>(c) * ml * n); };
  if (tp == 1) return multiply(rank);
  OverlapSync sync;
  const std::size_t bytes = shard_elems * sizeof(T);
  const int tag = buffer.options().tag;
  run_side_by_side(
      buffer, sync,
      [&] {
        for (int i = 0; i < tp; ++i) {
          if (i > 0 && !sync.communicated.wait_for(i)) return;
          multiply(ring_peer(rank, -i, tp));
        }
      },
      [&] {
        const int next = ring_peer(rank, 1, tp);
        const int prev = ring_peer(rank, -1, tp);
        for (int i = 0; i + 1 < tp; ++i) {
          PendingRequests step(transport);
          const Request received = step.add(transport.irecv(slot(ring_peer(rank, -i - 1, tp)), bytes, prev, tag));
          const Request sent = step.add(transport.isend(slot(ring_peer(rank, -i, tp)), bytes, next, tag));
          step.wait(received);
          sync.communicated.advance_to(i + 1);
          step.wait(sent);
        }
      });
}

template <class Tr, class G, class T>
void ring_exchange_rs(Tr& transport, G& gemm, CommOverlapBuffer& buffer, MatrixView<const T> a, gemm::Transpose ta,
                      MatrixView<const T> b, gemm::Transpose tb, GemmDims dims, MatrixView<T> rs_output) {
  const int tp = buffer.tp_size();
  const int rank = transport.rank();
  const std::size_t block = dims.m / static_cast<std::size_t>(tp);
  const std::size_t block_elems = block * dims.n;
  T* partial = buffer.view<T>().data();
  T* received = buffer.staging<T>().data();
  auto own_slot = [&](int p) { return partial + static_cast<std::size_t>(p) * block_elems; };
  auto staged = [&](int s) { return received + static_cast<std::size_t>(s) * block_elems; };  // step s's block
  auto compute_for = [&](int p) {
    gemm_rows(gemm, a, ta, static_cast<std::size_t>(p) * block, block, b, tb, dims.n, dims.k, own_slot(p));
  };
  // rs_output = the partials of ranks 0, 1, ..., tp-1, summed in that order.
  auto sum_partials = [&] {
    for (int q = 0; q < tp; ++q) {
      const T* from = q == rank ? own_slot(rank) : staged(ring_peer(rank, -q - 1, tp));
      if (q == 0) {
        gemm.copy(from, rs_output.data, block_elems);
      } else {
        gemm.axpy(T(1), from, rs_output.data, block_elems);
      }
    }
  };
  if (tp == 1) {
    compute_for(rank);
    return sum_partials();
  }
  OverlapSync sync;
  const std::size_t bytes = block_elems * sizeof(T);
  const int tag = buffer.options().tag;
  run_side_by_side(
      buffer, sync,
      [&] {
        for (int s = 0; s + 1 < tp; ++s) {
          if (sync.computed.aborted()) return;  // the communication failed: stop computing
          compute_for(ring_peer(rank, s + 1, tp));
          sync.computed.advance_to(s + 1);
        }
        compute_for(rank);
        if (!sync.communicated.wait_for(1)) return;
        sum_partials();
      },
      [&] {
        for (int s = 0; s + 1 < tp; ++s) {
          if (!sync.computed.wait_for(s + 1)) return;
          const int to = ring_peer(rank, s + 1, tp);
          const int from = ring_peer(rank, -s - 1, tp);
          PendingRequests step(transport);
          const Request got = step.add(transport.irecv(staged(s), bytes, from, tag));
          const Request sent = step.add(transport.isend(own_slot(to), bytes, to, tag));
          step.wait(got);
          step.wait(sent);
        }
        sync.communicated.advance_to(1);
      });
}

}  // namespace detail

/// Method NONE: the plain GEMM D = op(A) x op(B); no transport call.
template <class Tr, class G, class T>
void comm_gemm(Tr& transport, G& gemm, MatrixView<const T> a, gemm::Transpose transa, MatrixView<const T> b, gemm::Transpose transb,
               MatrixView<T> d) {
  CPDISPATCH_CHECK_TRANSPORT_BASE(Tr);  // no communication
  CPDISPATCH_CHECK_GEMM_BACKEND(G, T);
  static_assert(G::memory_space == MemorySpace::host, "cpdispatch: comm_gemm needs a host GEMM backend");
  (void)transport;
  const char* who = "comm_gemm (NONE)";
  const detail::GemmDims dims = detail::gemm_dims(who, a, transa, b, transb);
  detail::check_view(who, "D", d, dims.m, dims.n, "op(A) x op(B)");
  detail::check_disjoint(who, detail::region("D", d), detail::region("A", a));
  detail::check_disjoint(who, detail::region("D", d), detail::region("B", b));
  detail::gemm_rows(gemm, a, transa, 0, dims.m, b, transb, dims.n, dims.k, d.data);
}

/// The overlapped GEMM with `buffer`'s collective and method (see the top of this header).
template <class Tr, class G, class T>
void comm_gemm(Tr& transport, G& gemm, CommOverlapBuffer& buffer, MatrixView<const T> a, gemm::Transpose transa,
               MatrixView<const T> b, gemm::Transpose transb, MatrixView<T> d, MatrixView<T> rs_output = {}) {
  CPDISPATCH_CHECK_COLLECTIVE_TRANSPORT(Tr);
  CPDISPATCH_CHECK_POINT_TO_POINT_TRANSPORT(Tr);
  CPDISPATCH_CHECK_GEMM_BACKEND(G, T);
  static_assert(Tr::memory_space == MemorySpace::host,
                "cpdispatch: comm_gemm exchanges host memory (CommOverlapBuffer); the transport must be a host transport");
  static_assert(G::memory_space == MemorySpace::host,
                "cpdispatch: comm_gemm needs a host GEMM backend (CommOverlapBuffer is host memory; no CUDA path yet)");
  const char* who = "comm_gemm";
  const CommOverlapType type = buffer.type();
  const CommOverlapMethod method = buffer.method();
  detail::check_combination(who, type, method);
  const std::string what = to_string(type) + " " + to_string(method);
  if (buffer.atomic_gemm()) {
    cpdispatch::detail::fail(who, ": atomic GEMM requires the CUDA backend (the buffer has atomic_gemm = true, expected false: the "
                                  "GEMM backend is a host backend, and cpdispatch has no CUDA backend implementing atomic GEMM yet)");
  }
  if (buffer.scaling_mode() != ScalingMode::NO_SCALING) {
    cpdispatch::detail::fail(who, ": scaling mode ", to_string(buffer.scaling_mode()), " is not supported (expected NO_SCALING)");
  }
  buffer.check_element_type<T>("comm_gemm");
  if (buffer.tp_size() != transport.world_size()) {
    cpdispatch::detail::fail(who, ": the buffer's tp_size = ", buffer.tp_size(), " does not match the transport's world_size() = ",
                             transport.world_size());
  }
  const auto tp = static_cast<std::size_t>(buffer.tp_size());
  const detail::Region buffer_region{"the buffer", buffer.data(),
                                     (buffer.size() + buffer.staging<T>().size()) * sizeof(T)};

  if (type == CommOverlapType::AG) {  // RING_EXCHANGE: `a` is this rank's shard
    const detail::GemmDims dims = detail::gemm_dims(who, a, transa, b, transb);
    const std::size_t ml = dims.m;
    std::size_t gathered_rows = 0;
    if (__builtin_mul_overflow(ml, tp, &gathered_rows)) {
      cpdispatch::detail::fail(who, ": tp_size x shard rows = ", tp, " x ", ml, " overflows");
    }
    detail::check_buffer_shape(who, buffer, gathered_rows, dims.k, "the all-gathered op(A) (tp_size shards of op(A))");
    detail::check_view(who, "D", d, gathered_rows, dims.n, "tp_size x shard rows by op(B) columns");
    detail::check_unused(who, "rs_output", rs_output, what);
    detail::check_disjoint(who, detail::region("D", d), buffer_region);
    detail::check_disjoint(who, detail::region("D", d), detail::region("B", b));
    detail::check_disjoint(who, detail::region("B", b), buffer_region);
    return detail::ring_exchange_ag(transport, gemm, buffer, a, transa, b, transb, ml, dims.n, dims.k, d);
  }

  const detail::GemmDims dims = detail::gemm_dims(who, a, transa, b, transb);
  const detail::Region inputs[] = {detail::region("A", a), detail::region("B", b)};
  if (method == CommOverlapMethod::BULK) {
    detail::check_view(who, "D", d, dims.m, dims.n, "op(A) x op(B)");
    detail::check_view(who, "rs_output", rs_output, buffer.rows() / tp, buffer.cols(), "the buffer's rows / tp_size by its cols");
    detail::check_disjoint(who, detail::region("D", d), buffer_region);
    detail::check_disjoint(who, detail::region("D", d), detail::region("rs_output", rs_output));
    for (const detail::Region& in : inputs) {
      detail::check_disjoint(who, detail::region("rs_output", rs_output), in);
      detail::check_disjoint(who, detail::region("D", d), in);
    }
    detail::check_disjoint(who, detail::region("rs_output", rs_output), buffer_region);
    return detail::bulk_rs(transport, gemm, buffer, a, transa, b, transb, dims, d, rs_output);
  }

  // PIPELINE and RING_EXCHANGE: the GEMM output is the buffer.
  detail::check_buffer_shape(who, buffer, dims.m, dims.n, "the GEMM output op(A) x op(B)");
  detail::check_unused(who, "D", d, what + " (the GEMM output is the buffer)");
  detail::check_view(who, "rs_output", rs_output, dims.m / tp, dims.n, "the GEMM output's rows / tp_size by its cols");
  detail::check_disjoint(who, detail::region("rs_output", rs_output), buffer_region);
  for (const detail::Region& in : inputs) {
    detail::check_disjoint(who, detail::region("rs_output", rs_output), in);
    detail::check_disjoint(who, buffer_region, in);
  }
  if (method == CommOverlapMethod::PIPELINE) {
    return detail::pipeline_rs(transport, gemm, buffer, a, transa, b, transb, dims, rs_output);
  }
  return detail::ring_exchange_rs(transport, gemm, buffer, a, transa, b, transb, dims, rs_output);
}

/// Transformer Engine's GemmFFI (the GEMM entry point of its JAX extension):
/// the buffer by id. Method and type NONE run the plain GEMM (the id is not
/// looked up); otherwise they must be the buffer's own.
template <class Tr, class G, class T>
void comm_gemm(Tr& transport, G& gemm, const CommOverlapRegistry& registry, CommOverlapType type, CommOverlapMethod method,
               std::int64_t id, MatrixView<const T> a, gemm::Transpose transa, MatrixView<const T> b, gemm::Transpose transb,
               MatrixView<T> d, MatrixView<T> rs_output = {}) {
  detail::check_combination("comm_gemm", type, method);
  if (method == CommOverlapMethod::NONE) {
    detail::check_unused("comm_gemm", "rs_output", rs_output, "NONE NONE");
    return comm_gemm(transport, gemm, a, transa, b, transb, d);
  }
  const std::shared_ptr<CommOverlapBuffer> buffer = registry.get(id);
  if (buffer->type() != type || buffer->method() != method) {
    cpdispatch::detail::fail("comm_gemm: Invalid collective type: buffer id ", id, " was created for ", to_string(buffer->type()),
                             " ", to_string(buffer->method()), ", the call asks for ", to_string(type), " ", to_string(method));
  }
  comm_gemm(transport, gemm, *buffer, a, transa, b, transb, d, rs_output);
}

/// The same with the process-wide registry (create_comm_overlap_buffer's ids).
template <class Tr, class G, class T>
void comm_gemm(Tr& transport, G& gemm, CommOverlapType type, CommOverlapMethod method, std::int64_t id,
               MatrixView<const T> a, gemm::Transpose transa, MatrixView<const T> b, gemm::Transpose transb, MatrixView<T> d,
               MatrixView<T> rs_output = {}) {
  comm_gemm(transport, gemm, default_comm_overlap_registry(), type, method, id, a, transa, b, transb, d, rs_output);
}

}  // namespace cpdispatch::overlap
