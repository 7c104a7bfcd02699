#pragma once
// The overlapped-GEMM cases every transport runs (sim, MPI): per rank, over
// the Transport concept. Each rank makes every rank's inputs from seeds, so
// it knows the exact result (products accumulated in double) without any
// communication, and it also computes the unoverlapped reference through the
// transport: the plain GEMM, then reduce_scatter (RS), or all_gather, then
// the plain GEMM (AG). The overlapped result must match both within float32
// rounding.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "cpdispatch/overlap/overlap.hpp"
#include "cpdispatch/gemm/gemm.hpp"
#include "../common/max_error.hpp"
#ifdef CPDISPATCH_TEST_HAVE_BLAS
#include "cpdispatch/gemm/gemm_cblas.hpp"
#endif

namespace overlap_cases {

namespace ov = cpdispatch::overlap;
using cpdispatch::ElementType;
using cpdispatch::ReduceOp;
using ov::CommOverlapMethod;
using ov::CommOverlapType;
using ov::HelperThread;
using cpdispatch::gemm::Transpose;

/// Deterministic values in [-1, 1) (splitmix64), the same on every rank and process.
template <class T>
std::vector<T> random_values(std::uint64_t seed, std::size_t n) {
  std::vector<T> v(n);
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
  for (auto& e : v) {
    x += 0x9E3779B97F4A7C15ull;
    std::uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    e = static_cast<T>(static_cast<double>(z >> 11) * 0x1.0p-52 - 1.0);
  }
  return v;
}

/// max |got - want| / max |want|; infinite on a NaN, an unmatched infinity
/// or, with a test failure, a size mismatch (common/max_error.hpp).
template <class A, class B>
double rel_error(const A* got, const B* want, std::size_t n) {
  return cpdispatch::testing::max_error(std::span(got, n), std::span(want, n)).relative();
}
template <class A, class B>
double rel_error(const std::vector<A>& got, const std::vector<B>& want) {
  return cpdispatch::testing::max_error(got, want).relative();
}

/// Relative error bound of the checks: float32 rounding (double: far tighter).
template <class T>
constexpr double tolerance() {
  return std::is_same_v<T, float> ? 1e-5 : 1e-12;
}

template <class T>
constexpr ElementType dtype_of() {
  return std::is_same_v<T, float> ? ElementType::float32 : ElementType::float64;
}

/// Element (i, j) of op(X) for X stored row-major with `cols` columns.
template <class T>
T op_at(const std::vector<T>& x, std::size_t cols, Transpose t, std::size_t i, std::size_t j) {
  return t == Transpose::no ? x[i * cols + j] : x[j * cols + i];
}

/// op(A) x op(B) (m x n) in double, A stored with a_cols columns, B with b_cols.
template <class T>
std::vector<double> exact_product(const std::vector<T>& a, std::size_t a_cols, Transpose ta, const std::vector<T>& b,
                                  std::size_t b_cols, Transpose tb, std::size_t m, std::size_t n, std::size_t k) {
  std::vector<double> c(m * n, 0.0);
  for (std::size_t i = 0; i < m; ++i) {
    for (std::size_t j = 0; j < n; ++j) {
      double s = 0;
      for (std::size_t p = 0; p < k; ++p) s += double(op_at(a, a_cols, ta, i, p)) * double(op_at(b, b_cols, tb, p, j));
      c[i * n + j] = s;
    }
  }
  return c;
}

/// Stored shape of an operand whose op() is rows x cols.
inline std::size_t stored_cols(Transpose t, std::size_t op_rows, std::size_t op_cols) {
  return t == Transpose::no ? op_cols : op_rows;
}
inline std::size_t stored_rows(Transpose t, std::size_t op_rows, std::size_t op_cols) {
  return t == Transpose::no ? op_rows : op_cols;
}

struct Case {
  CommOverlapType type;
  CommOverlapMethod method;
  Transpose ta;
  Transpose tb;
  int num_splits = 1;
  HelperThread helper = HelperThread::communication;

  std::string name() const {
    return ov::to_string(type) + " " + ov::to_string(method) + " ta=" + (ta == Transpose::yes ? "T" : "N") +
           " tb=" + (tb == Transpose::yes ? "T" : "N") + " splits=" + std::to_string(num_splits) +
           (helper == HelperThread::gemm ? " gemm-on-helper" : " comm-on-helper");
  }
};

/// Every supported (type, method) pair with both transpose flags, and PIPELINE with 1, 2 and 3 splits.
inline std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (Transpose ta : {Transpose::no, Transpose::yes}) {
    for (Transpose tb : {Transpose::no, Transpose::yes}) {
      for (HelperThread h : {HelperThread::communication, HelperThread::gemm}) {
        cases.push_back({CommOverlapType::NONE, CommOverlapMethod::NONE, ta, tb, 1, h});
        cases.push_back({CommOverlapType::RS, CommOverlapMethod::BULK, ta, tb, 1, h});
        for (int s : {1, 2, 3}) cases.push_back({CommOverlapType::RS, CommOverlapMethod::PIPELINE, ta, tb, s, h});
        cases.push_back({CommOverlapType::RS, CommOverlapMethod::RING_EXCHANGE, ta, tb, 1, h});
        cases.push_back({CommOverlapType::AG, CommOverlapMethod::RING_EXCHANGE, ta, tb, 1, h});
      }
    }
  }
  return cases;
}

/// One case on this rank: the overlapped call against the exact result and
/// against the unoverlapped reference through `t`. `round` varies the data
/// (a buffer is reused across rounds).
template <class T, class Tr, class G>
void run_case(Tr& t, G& gemm, const Case& c, ov::CommOverlapBuffer* buffer, int round) {
  SCOPED_TRACE(c.name() + " rank " + std::to_string(t.rank()) + " of " + std::to_string(t.world_size()) + " round " +
               std::to_string(round));
  const int W = t.world_size();
  const auto tp = static_cast<std::size_t>(W);
  const auto me = static_cast<std::size_t>(t.rank());
  const std::size_t k = 5, n = 4;
  const std::uint64_t seed = 1000 * static_cast<std::uint64_t>(round + 1);
  auto seed_of = [&](std::size_t rank, int what) { return seed + 10 * rank + static_cast<std::uint64_t>(what); };
  const ov::MatrixView<T> none{};

  if (c.type == CommOverlapType::AG) {
    const std::size_t ml = 3, m = ml * tp;  // shard rows, gathered rows
    const std::size_t a_cols = stored_cols(c.ta, ml, k), b_cols = stored_cols(c.tb, k, n);
    std::vector<std::vector<T>> shards(tp);
    for (std::size_t q = 0; q < tp; ++q) shards[q] = random_values<T>(seed_of(q, 1), ml * k);
    const auto b = random_values<T>(seed_of(me, 2), k * n);
    // The exact result: the explicit gathered op(A) (m x k), times op(B).
    std::vector<T> full(m * k);
    for (std::size_t q = 0; q < tp; ++q) {
      for (std::size_t i = 0; i < ml; ++i) {
        for (std::size_t j = 0; j < k; ++j) full[(q * ml + i) * k + j] = op_at(shards[q], a_cols, c.ta, i, j);
      }
    }
    const auto exact = exact_product(full, k, Transpose::no, b, b_cols, c.tb, m, n, k);
    // The unoverlapped reference: all_gather, then the plain GEMM.
    std::vector<T> stacked(m * k), gathered(m * k), reference(m * n);
    t.all_gather(shards[me].data(), stacked.data(), ml * k, dtype_of<T>());
    for (std::size_t q = 0; q < tp; ++q) {
      const std::vector<T> shard(stacked.begin() + static_cast<std::ptrdiff_t>(q * ml * k),
                                 stacked.begin() + static_cast<std::ptrdiff_t>((q + 1) * ml * k));
      for (std::size_t i = 0; i < ml; ++i) {
        for (std::size_t j = 0; j < k; ++j) gathered[(q * ml + i) * k + j] = op_at(shard, a_cols, c.ta, i, j);
      }
    }
    ov::comm_gemm(t, gemm, ov::matrix_view<const T>(gathered.data(), m, k), Transpose::no,
                  ov::matrix_view<const T>(b.data(), stored_rows(c.tb, k, n), b_cols), c.tb,
                  ov::matrix_view(reference.data(), m, n));
    // The overlapped call.
    std::vector<T> d(m * n, T(-7));
    ov::comm_gemm(t, gemm, *buffer, ov::matrix_view<const T>(shards[me].data(), stored_rows(c.ta, ml, k), a_cols), c.ta,
                  ov::matrix_view<const T>(b.data(), stored_rows(c.tb, k, n), b_cols), c.tb, ov::matrix_view(d.data(), m, n),
                  none);
    EXPECT_LT(rel_error(d.data(), exact.data(), d.size()), tolerance<T>());
    EXPECT_LT(rel_error(d, reference), tolerance<T>());
    // The buffer now holds every rank's shard, as all_gather stacks them.
    std::vector<T> held(buffer->size());
    buffer->copy_out(std::span<T>(held));
    EXPECT_EQ(held, stacked);
    return;
  }

  // NONE and RS: each rank multiplies its own op(A) (m x k) by its own op(B).
  const int splits = c.method == CommOverlapMethod::PIPELINE ? c.num_splits : 1;
  const std::size_t m = tp * 2 * static_cast<std::size_t>(splits);
  const std::size_t block = m / tp;
  const std::size_t a_rows = stored_rows(c.ta, m, k), a_cols = stored_cols(c.ta, m, k);
  const std::size_t b_rows = stored_rows(c.tb, k, n), b_cols = stored_cols(c.tb, k, n);
  std::vector<std::vector<T>> as(tp), bs(tp);
  std::vector<std::vector<double>> products(tp);
  for (std::size_t q = 0; q < tp; ++q) {
    as[q] = random_values<T>(seed_of(q, 1), m * k);
    bs[q] = random_values<T>(seed_of(q, 2), k * n);
    products[q] = exact_product(as[q], a_cols, c.ta, bs[q], b_cols, c.tb, m, n, k);
  }
  const auto a = ov::matrix_view<const T>(as[me].data(), a_rows, a_cols);
  const auto b = ov::matrix_view<const T>(bs[me].data(), b_rows, b_cols);
  std::vector<T> d(m * n, T(-7));

  if (c.type == CommOverlapType::NONE) {
    ov::comm_gemm(t, gemm, a, c.ta, b, c.tb, ov::matrix_view(d.data(), m, n));
    EXPECT_LT(rel_error(d.data(), products[me].data(), d.size()), tolerance<T>());
    return;
  }

  if (c.method == CommOverlapMethod::BULK) {
    // The buffer holds independent data (its own shape); the GEMM output goes to d.
    const std::size_t rows = buffer->rows(), cols = buffer->cols(), per_rank = rows / tp * cols;
    std::vector<std::vector<T>> fills(tp);
    for (std::size_t q = 0; q < tp; ++q) fills[q] = random_values<T>(seed_of(q, 3), rows * cols);
    buffer->copy_into(std::span<const T>(fills[me]));
    std::vector<T> reference(per_rank), rs(per_rank, T(-7));
    t.reduce_scatter(fills[me].data(), reference.data(), per_rank, dtype_of<T>(), ReduceOp::sum);
    ov::comm_gemm(t, gemm, *buffer, a, c.ta, b, c.tb, ov::matrix_view(d.data(), m, n), ov::matrix_view(rs.data(), rows / tp, cols));
    std::vector<double> exact(per_rank, 0.0);
    for (std::size_t q = 0; q < tp; ++q) {
      for (std::size_t i = 0; i < per_rank; ++i) exact[i] += double(fills[q][me * per_rank + i]);
    }
    EXPECT_LT(rel_error(rs, exact), tolerance<T>());
    EXPECT_LT(rel_error(rs, reference), tolerance<T>());
    EXPECT_LT(rel_error(d.data(), products[me].data(), d.size()), tolerance<T>());
    return;
  }

  // PIPELINE, RING_EXCHANGE: the reference is the plain GEMM, then reduce_scatter.
  std::vector<T> full(m * n), reference(block * n), rs(block * n, T(-7));
  ov::comm_gemm(t, gemm, a, c.ta, b, c.tb, ov::matrix_view(full.data(), m, n));
  t.reduce_scatter(full.data(), reference.data(), block * n, dtype_of<T>(), ReduceOp::sum);
  ov::comm_gemm(t, gemm, *buffer, a, c.ta, b, c.tb, none, ov::matrix_view(rs.data(), block, n));
  std::vector<double> exact(block * n, 0.0);
  for (std::size_t q = 0; q < tp; ++q) {
    for (std::size_t i = 0; i < block * n; ++i) exact[i] += products[q][me * block * n + i];
  }
  EXPECT_LT(rel_error(rs, exact), tolerance<T>());
  EXPECT_LT(rel_error(rs, reference), tolerance<T>());
  // The buffer holds this rank's GEMM output: in row order (RING_EXCHANGE) or chunk-major (PIPELINE).
  const auto held = buffer->view<T>();
  std::vector<T> rows_in_order(held.begin(), held.end());
  if (c.method == CommOverlapMethod::PIPELINE) {
    const std::size_t h = block / static_cast<std::size_t>(splits);
    for (std::size_t i = 0; i < static_cast<std::size_t>(splits); ++i) {
      for (std::size_t p = 0; p < tp; ++p) {
        for (std::size_t r = 0; r < h * n; ++r) {
          rows_in_order[(p * block + i * h) * n + r] = held[(i * tp + p) * h * n + r];
        }
      }
    }
  }
  EXPECT_LT(rel_error(rows_in_order.data(), products[me].data(), rows_in_order.size()), tolerance<T>());
}

/// The buffer a case needs (none for NONE).
template <class T>
std::unique_ptr<ov::CommOverlapBuffer> buffer_for(const Case& c, int W) {
  if (c.method == CommOverlapMethod::NONE) return nullptr;
  const auto tp = static_cast<std::size_t>(W);
  ov::CommOverlapOptions options;
  options.num_splits = c.num_splits;
  options.helper_thread = c.helper;
  std::vector<std::size_t> shape;
  if (c.type == CommOverlapType::AG) {
    shape = {3 * tp, 5};
  } else if (c.method == CommOverlapMethod::BULK) {
    shape = {2 * tp, 6};
  } else {
    shape = {tp * 2 * static_cast<std::size_t>(c.method == CommOverlapMethod::PIPELINE ? c.num_splits : 1), 4};
  }
  return std::make_unique<ov::CommOverlapBuffer>(c.type, c.method, shape, dtype_of<T>(), W, options);
}

/// Every case (or those with helper thread `only`), twice on the same buffer.
template <class T, class Tr, class G>
void every_case_matches_reference(Tr& t, G& gemm, std::optional<HelperThread> only = std::nullopt) {
  for (const Case& c : all_cases()) {
    if (only && c.helper != *only) continue;
    const auto buffer = buffer_for<T>(c, t.world_size());
    for (int round = 0; round < 2; ++round) run_case<T>(t, gemm, c, buffer.get(), round);
  }
}

/// The same, through the id-based API (the registry is this rank's).
template <class T, class Tr, class G>
void by_id_matches_reference(Tr& t, G& gemm) {
  ov::CommOverlapRegistry registry;
  const int W = t.world_size();
  const auto tp = static_cast<std::size_t>(W);
  const std::size_t m = 2 * tp, k = 3, n = 2;
  const auto id = registry.create(CommOverlapType::RS, CommOverlapMethod::RING_EXCHANGE, {m, n}, dtype_of<T>(), W);
  const auto a = random_values<T>(7 + t.rank(), m * k), b = random_values<T>(9 + t.rank(), k * n);
  std::vector<T> full(m * n), reference(2 * n), rs(2 * n);
  ov::comm_gemm(t, gemm, registry, CommOverlapType::NONE, CommOverlapMethod::NONE, 0,
                ov::matrix_view<const T>(a.data(), m, k), Transpose::no, ov::matrix_view<const T>(b.data(), k, n),
                Transpose::no, ov::matrix_view(full.data(), m, n));
  t.reduce_scatter(full.data(), reference.data(), 2 * n, dtype_of<T>(), ReduceOp::sum);
  ov::comm_gemm(t, gemm, registry, CommOverlapType::RS, CommOverlapMethod::RING_EXCHANGE, id,
                ov::matrix_view<const T>(a.data(), m, k), Transpose::no, ov::matrix_view<const T>(b.data(), k, n),
                Transpose::no, ov::MatrixView<T>{}, ov::matrix_view(rs.data(), 2, n));
  EXPECT_LT(rel_error(rs, reference), tolerance<T>());
  registry.destroy(id);
  EXPECT_FALSE(registry.contains(id));
}

/// Shapes that do not divide: rejected at creation, on every rank alike, before any transport call.
template <class Tr, class G>
void indivisible_shapes_are_rejected(Tr& t, G& gemm) {
  const int W = t.world_size();
  const auto tp = static_cast<std::size_t>(W);
  ov::CommOverlapOptions three;
  three.num_splits = 3;
  try {
    ov::CommOverlapBuffer(CommOverlapType::RS, CommOverlapMethod::PIPELINE, {3 * tp + 1, 4}, ElementType::float32, W, three);
    ADD_FAILURE() << "a PIPELINE buffer of " << 3 * tp + 1 << " rows was accepted";
  } catch (const cpdispatch::invalid_input& e) {
    EXPECT_NE(std::string(e.what()).find("is not divisible by tp_size * num_splits = " + std::to_string(W) + " * 3"),
              std::string::npos)
        << e.what();
  }
  if (W > 1) {
    for (auto [type, method] : {std::pair{CommOverlapType::RS, CommOverlapMethod::BULK},
                                std::pair{CommOverlapType::RS, CommOverlapMethod::RING_EXCHANGE},
                                std::pair{CommOverlapType::AG, CommOverlapMethod::RING_EXCHANGE}}) {
      try {
        ov::CommOverlapBuffer(type, method, {2 * tp + 1, 4}, ElementType::float32, W);
        ADD_FAILURE() << ov::to_string(type) << " " << ov::to_string(method) << " accepted " << 2 * tp + 1 << " rows";
      } catch (const cpdispatch::invalid_input& e) {
        EXPECT_NE(std::string(e.what()).find("buffer_shape[0] = " + std::to_string(2 * tp + 1) +
                                             " is not divisible by tp_size = " + std::to_string(W)),
                  std::string::npos)
            << e.what();
      }
    }
  }
  // A GEMM whose output does not fit the buffer: the seed's "Buffer size is incorrect".
  ov::CommOverlapBuffer buffer(CommOverlapType::RS, CommOverlapMethod::PIPELINE, {2 * tp, 4}, ElementType::float32, W,
                               ov::CommOverlapOptions{.num_splits = 2});
  std::vector<float> a(4 * tp * 3), b(3 * 4), rs(4 * 4);
  try {
    ov::comm_gemm(t, gemm, buffer, ov::matrix_view<const float>(a.data(), 4 * tp, 3), Transpose::no,
                  ov::matrix_view<const float>(b.data(), 3, 4), Transpose::no, ov::MatrixView<float>{},
                  ov::matrix_view(rs.data(), 4, 4));
    ADD_FAILURE() << "a GEMM of " << 4 * tp << " rows ran on a buffer of " << 2 * tp;
  } catch (const cpdispatch::invalid_input& e) {
    EXPECT_NE(std::string(e.what()).find("Buffer size is incorrect"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("expected " + std::to_string(4 * tp) + " x 4 = " + std::to_string(16 * tp) +
                                         " elements, got " + std::to_string(2 * tp) + " x 4 = " + std::to_string(8 * tp)),
              std::string::npos)
        << e.what();
  }
}

/// Every check of this file, for float and double, with the reference backend and (when built) CBLAS.
template <class Tr>
void all_checks(Tr& t, std::optional<HelperThread> only = std::nullopt) {
  cpdispatch::gemm::ReferenceGemm reference;
  every_case_matches_reference<float>(t, reference, only);
  every_case_matches_reference<double>(t, reference, only);
  by_id_matches_reference<float>(t, reference);
  indivisible_shapes_are_rejected(t, reference);
#ifdef CPDISPATCH_TEST_HAVE_BLAS
  cpdispatch::gemm::CblasGemm blas;
  every_case_matches_reference<float>(t, blas, only);
  every_case_matches_reference<double>(t, blas, only);
  by_id_matches_reference<double>(t, blas);
#endif
}

}  // namespace overlap_cases
