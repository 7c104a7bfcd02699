#pragma once
// The cuDNN operation graphs of CudnnAttentionKernel, as plain data (no cuDNN
// call): tensors (uid, dims, strides, type, virtual / by value, ragged
// offset) and operations (matmul, pointwise, reduction, reshape) in the order
// they are handed to cuDNN. cudnn/detail/backend.hpp turns a GraphSpec into
// backend descriptors; the tests check the specs and what reaches cuDNN.
//
// cuDNN 9.19's native SDPA operations (CUDNN_BACKEND_OPERATION_SDPA_FWD/BWD
// _DESCRIPTOR) take sequence lengths but no diagonal band (no causal offset,
// no window), so the graphs are the composite ones cuDNN's runtime fusion
// engine recognises as flash attention, laid out as cuDNN's frontend lays out
// its SDPA node for cuDNN < 9.21: Q K^T (matmul), scale, padding mask,
// right/left diagonal-band masks (GEN_INDEX, ADD/SUB of the sequence lengths
// and the by-value bounds, CMP, BINARY_SELECT with -inf), softmax (max,
// sub, exp, sum, log: the statistics), P V (matmul); backward as the
// frontend's SDPA backward node (dO.O row sums, recomputed P, dV, dP, dS, dK,
// dQ). Layouts (each 4-d, [batch][heads][seq][dim], strides per dimension):
//   Q, O, dO, dQ   dims {B, Hq, Sq, D},  strides {Sq*Hq*D, D, Hq*D, 1}, ragged offset RAGGED_Q
//   K, V, dK, dV   dims {B, Hk, Skv, D}, strides {Skv*Hk*D, D, Hk*D, 1}, ragged offset RAGGED_KV
//   statistics     dims {B, Hq, Sq, 1},  strides {Sq, T, 1, 1}, ragged offset RAGGED_STATS (rows):
//                  the log-sum-exp of query row r, head h at h * T + r, our lse layout
//                  with pitch T (the call's bucketed query rows; see the kernel)
// B, Sq, Skv, T are capacity buckets (mapping.hpp); the real lengths are the
// int32 tensors SEQ_Q and SEQ_KV, dims {B, 1, 1, 1}.

#include <cudnn_graph.h>

#include <array>
#include <cstdint>
#include <vector>

#include "cpdispatch/cudnn/mapping.hpp"
#include "cpdispatch/error.hpp"

namespace cpdispatch::cudnn::detail {

/// Unique ids of the tensors the variant pack fills (virtual ones from 100).
namespace uid {
inline constexpr std::int64_t q = 1, k = 2, v = 3, o = 4, stats = 5, d_o = 6, dq = 7, dk = 8, dv = 9;
inline constexpr std::int64_t seq_q = 10, seq_kv = 11, ragged_q = 12, ragged_kv = 13, ragged_stats = 14;
inline constexpr std::int64_t scale = 15, right_bound = 16, left_bound = 17, neg_inf = 18, one = 19;
inline constexpr std::int64_t softmax_sum = 20, dq_accum = 21;
inline constexpr std::int64_t first_virtual = 100;
}  // namespace uid

enum class Direction : std::uint8_t { forward, backward };

using Dims = std::array<std::int64_t, 4>;

struct TensorSpec {
  std::int64_t uid = 0;
  Dims dims{}, strides{};
  cudnnDataType_t type = CUDNN_DATA_FLOAT;
  bool is_virtual = false;
  bool by_value = false;    ///< a host scalar in the variant pack
  std::int64_t ragged = 0;  ///< uid of the ragged offset tensor, 0 if none
  const char* name = "";
};

enum class OpKind : std::uint8_t { matmul, pointwise, reduction, reshape };

struct OpSpec {
  OpKind kind = OpKind::pointwise;
  const char* name = "";
  // pointwise: x, b, t -> y; matmul: a, b -> c (in[0], in[1]); reduction, reshape: x -> y
  std::array<std::int64_t, 3> in{0, 0, 0};
  std::int64_t out = 0;
  cudnnPointwiseMode_t mode = CUDNN_POINTWISE_IDENTITY;
  cudnnDataType_t compute = CUDNN_DATA_FLOAT;  ///< pointwise math precision, matmul / reduction compute type
  std::int64_t axis = -1;                      ///< pointwise axis: GEN_INDEX only (the frontend sends it for no other mode)
  cudnnReduceTensorOp_t reduce = CUDNN_REDUCE_TENSOR_ADD;
  bool has_padding = false;                    ///< matmul: CUDNN_ATTR_MATMUL_PADDING_VALUE = 0.0
  std::int64_t m_override = 0, n_override = 0, k_override = 0;  ///< matmul: uids of the int32 length tensors
};

/// What selects a graph (and keys the plan cache, with the device).
struct GraphKey {
  Direction direction = Direction::forward;
  cudnnDataType_t io_type = CUDNN_DATA_BFLOAT16;
  std::int64_t heads_q = 1, heads_kv = 1, head_dim = 0;
  Band band = Band::full;
  bool deterministic = true;  ///< backward: dQ by the dP-workspace path, no fp32 atomics
  std::int64_t batch = 1, max_q = 1, max_kv = 1;  ///< capacity buckets
  std::int64_t stats_pitch = 1;                    ///< T: capacity bucket of the call's query rows
  friend auto operator<=>(const GraphKey&, const GraphKey&) = default;
};

struct GraphSpec {
  std::vector<TensorSpec> tensors;  ///< ragged offset tensors before the tensors that use them
  std::vector<OpSpec> ops;

  const TensorSpec* find(std::int64_t id) const {
    for (const TensorSpec& t : tensors) {
      if (t.uid == id) return &t;
    }
    return nullptr;
  }
  const TensorSpec& tensor(std::int64_t id) const {
    const TensorSpec* t = find(id);
    if (!t) cpdispatch::detail::fail("GraphSpec: no tensor with uid ", id);
    return *t;
  }
};

/// Builds a GraphSpec: named tensors, fresh virtual ones, ops.
class GraphWriter {
 public:
  GraphWriter() = default;

  GraphSpec take() { return std::move(spec_); }

  std::int64_t tensor(std::int64_t id, const Dims& dims, const Dims& strides, cudnnDataType_t type, const char* name,
                      std::int64_t ragged = 0) {
    spec_.tensors.push_back({id, dims, strides, type, false, false, ragged, name});
    return id;
  }
  std::int64_t scalar(std::int64_t id, cudnnDataType_t type, const char* name) {
    spec_.tensors.push_back({id, {1, 1, 1, 1}, {1, 1, 1, 1}, type, false, true, 0, name});
    return id;
  }
  std::int64_t virt(const Dims& dims, const Dims& strides, cudnnDataType_t type, const char* name) {
    spec_.tensors.push_back({next_++, dims, strides, type, true, false, 0, name});
    return next_ - 1;
  }
  /// A virtual tensor shaped like tensor `like`.
  std::int64_t virt_like(std::int64_t like, cudnnDataType_t type, const char* name) {
    const TensorSpec& t = spec_.tensor(like);
    const Dims dims = t.dims, strides = t.strides;
    return virt(dims, strides, type, name);
  }

  std::int64_t pointwise(const char* name, cudnnPointwiseMode_t mode, std::int64_t x, std::int64_t b, std::int64_t t,
                         std::int64_t y, cudnnDataType_t compute = CUDNN_DATA_FLOAT, std::int64_t axis = -1) {
    OpSpec op;
    op.kind = OpKind::pointwise;
    op.name = name;
    op.mode = mode;
    op.in = {x, b, t};
    op.out = y;
    op.compute = compute;
    op.axis = axis;
    spec_.ops.push_back(op);
    return y;
  }
  std::int64_t matmul(const char* name, std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t m, std::int64_t n,
                      std::int64_t k, bool padding = false) {
    OpSpec op;
    op.kind = OpKind::matmul;
    op.name = name;
    op.in = {a, b, 0};
    op.out = c;
    op.m_override = m;
    op.n_override = n;
    op.k_override = k;
    op.has_padding = padding;
    spec_.ops.push_back(op);
    return c;
  }
  std::int64_t reduction(const char* name, cudnnReduceTensorOp_t reduce, std::int64_t x, std::int64_t y) {
    OpSpec op;
    op.kind = OpKind::reduction;
    op.name = name;
    op.reduce = reduce;
    op.in = {x, 0, 0};
    op.out = y;
    spec_.ops.push_back(op);
    return y;
  }
  std::int64_t reshape(const char* name, std::int64_t x, std::int64_t y) {
    OpSpec op;
    op.kind = OpKind::reshape;
    op.name = name;
    op.in = {x, 0, 0};
    op.out = y;
    spec_.ops.push_back(op);
    return y;
  }

  const GraphSpec& spec() const { return spec_; }
  void set_ragged(std::int64_t id, std::int64_t ragged) {
    for (TensorSpec& t : spec_.tensors) {
      if (t.uid == id) t.ragged = ragged;
    }
  }

 private:
  GraphSpec spec_;
  std::int64_t next_ = uid::first_virtual;
};

// ---- shared pieces of both directions --------------------------------------

inline Dims score_dims(const GraphKey& k) { return {k.batch, k.heads_q, k.max_q, k.max_kv}; }
inline Dims score_strides(const GraphKey& k) {
  return {k.heads_q * k.max_q * k.max_kv, k.max_q * k.max_kv, k.max_kv, 1};
}
inline Dims row_dims(const GraphKey& k) { return {k.batch, k.heads_q, k.max_q, 1}; }
inline Dims row_strides(const GraphKey& k) { return {k.heads_q * k.max_q, k.max_q, 1, 1}; }
/// Our lse layout [heads_q][T] seen per sequence (file comment).
inline Dims stats_strides(const GraphKey& k) { return {k.max_q, k.stats_pitch, 1, 1}; }

/// The tensors every graph has: ragged offsets, lengths, Q, K (as K^T), V,
/// the by-value scalars. V is transposed too for backward (V^T).
inline void common_tensors(GraphWriter& w, const GraphKey& k) {
  const std::int64_t B = k.batch, D = k.head_dim, Hq = k.heads_q, Hk = k.heads_kv, Sq = k.max_q, Skv = k.max_kv;
  w.tensor(uid::ragged_q, {B + 1, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_INT32, "ragged_q");
  w.tensor(uid::ragged_kv, {B + 1, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_INT32, "ragged_kv");
  w.tensor(uid::ragged_stats, {B + 1, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_INT32, "ragged_stats");
  w.tensor(uid::seq_q, {B, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_INT32, "seq_len_q");
  w.tensor(uid::seq_kv, {B, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_INT32, "seq_len_kv");
  w.tensor(uid::q, {B, Hq, Sq, D}, {Sq * Hq * D, D, Hq * D, 1}, k.io_type, "Q", uid::ragged_q);
  // K^T: K's [B][Hk][Skv][D] with the last two dimensions swapped
  w.tensor(uid::k, {B, Hk, D, Skv}, {Skv * Hk * D, D, 1, Hk * D}, k.io_type, "K^T", uid::ragged_kv);
  if (k.direction == Direction::forward) {
    w.tensor(uid::v, {B, Hk, Skv, D}, {Skv * Hk * D, D, Hk * D, 1}, k.io_type, "V", uid::ragged_kv);
  } else {
    w.tensor(uid::v, {B, Hk, D, Skv}, {Skv * Hk * D, D, 1, Hk * D}, k.io_type, "V^T", uid::ragged_kv);
  }
  w.scalar(uid::scale, CUDNN_DATA_FLOAT, "attn_scale");
  w.scalar(uid::neg_inf, CUDNN_DATA_FLOAT, "-inf");
  if (k.band != Band::full) w.scalar(uid::right_bound, CUDNN_DATA_INT32, "right_bound");
  if (k.band == Band::window) w.scalar(uid::left_bound, CUDNN_DATA_INT32, "left_bound");
}

/// The padding mask on the scores `s`: row < seq_len_q && col < seq_len_kv.
inline std::int64_t padding_mask(GraphWriter& w, const GraphKey& k, std::int64_t s) {
  const Dims sd = score_dims(k), ss = score_strides(k);
  // padding: row < seq_len_q && col < seq_len_kv
  std::int64_t row = w.pointwise("gen_row_idx_padding", CUDNN_POINTWISE_GEN_INDEX, s, 0, 0,
                                 w.virt(sd, ss, CUDNN_DATA_INT32, "row"), CUDNN_DATA_INT32, 2);
  std::int64_t col = w.pointwise("gen_col_idx_padding", CUDNN_POINTWISE_GEN_INDEX, s, 0, 0,
                                 w.virt(sd, ss, CUDNN_DATA_INT32, "col"), CUDNN_DATA_INT32, 3);
  const std::int64_t row_ok = w.pointwise("lt_row_sq_padding", CUDNN_POINTWISE_CMP_LT, row, uid::seq_q, 0,
                                          w.virt(sd, ss, CUDNN_DATA_BOOLEAN, "row<sq"), CUDNN_DATA_BOOLEAN);
  const std::int64_t col_ok = w.pointwise("lt_col_skv_padding", CUDNN_POINTWISE_CMP_LT, col, uid::seq_kv, 0,
                                          w.virt(sd, ss, CUDNN_DATA_BOOLEAN, "col<skv"), CUDNN_DATA_BOOLEAN);
  const std::int64_t both = w.pointwise("and_row_col_padding", CUDNN_POINTWISE_LOGICAL_AND, row_ok, col_ok, 0,
                                        w.virt(sd, ss, CUDNN_DATA_BOOLEAN, "padding"), CUDNN_DATA_BOOLEAN);
  return w.pointwise("select_padding", CUDNN_POINTWISE_BINARY_SELECT, s, uid::neg_inf, both,
                     w.virt(sd, ss, CUDNN_DATA_FLOAT, "S padded"));
}

/// The band's right bound (causal, window) and left bound (window) on `s`.
inline std::int64_t band_masks(GraphWriter& w, const GraphKey& k, std::int64_t s) {
  if (k.band == Band::full) return s;
  const Dims sd = score_dims(k), ss = score_strides(k);
  // right bound: row + seq_len_kv - seq_len_q + R >= col
  std::int64_t row = w.pointwise("gen_row_index", CUDNN_POINTWISE_GEN_INDEX, s, 0, 0,
                                 w.virt(sd, ss, CUDNN_DATA_INT32, "row"), CUDNN_DATA_FLOAT, 2);
  std::int64_t col = w.pointwise("gen_col_index", CUDNN_POINTWISE_GEN_INDEX, s, 0, 0,
                                 w.virt(sd, ss, CUDNN_DATA_INT32, "col"), CUDNN_DATA_FLOAT, 3);
  row = w.pointwise("row+skv", CUDNN_POINTWISE_ADD, row, uid::seq_kv, 0, w.virt(sd, ss, CUDNN_DATA_INT32, "row+skv"),
                    CUDNN_DATA_INT32);
  row = w.pointwise("row+skv-sq", CUDNN_POINTWISE_SUB, row, uid::seq_q, 0,
                    w.virt(sd, ss, CUDNN_DATA_INT32, "row+skv-sq"), CUDNN_DATA_INT32);
  row = w.pointwise("row+skv-sq+right", CUDNN_POINTWISE_ADD, row, uid::right_bound, 0,
                    w.virt(sd, ss, CUDNN_DATA_INT32, "row+skv-sq+R"), CUDNN_DATA_INT32);
  const std::int64_t right = w.pointwise("row>=col", CUDNN_POINTWISE_CMP_GE, row, col, 0,
                                         w.virt(sd, ss, CUDNN_DATA_BOOLEAN, "right"), CUDNN_DATA_BOOLEAN);
  s = w.pointwise("select_right_bound", CUDNN_POINTWISE_BINARY_SELECT, s, uid::neg_inf, right,
                  w.virt(sd, ss, CUDNN_DATA_FLOAT, "S right"));
  if (k.band != Band::window) return s;
  // left bound: col + L - seq_len_kv + seq_len_q > row
  row = w.pointwise("gen_row_index", CUDNN_POINTWISE_GEN_INDEX, s, 0, 0, w.virt(sd, ss, CUDNN_DATA_INT32, "row"),
                    CUDNN_DATA_FLOAT, 2);
  col = w.pointwise("gen_col_index", CUDNN_POINTWISE_GEN_INDEX, s, 0, 0, w.virt(sd, ss, CUDNN_DATA_INT32, "col"),
                    CUDNN_DATA_FLOAT, 3);
  col = w.pointwise("col+left", CUDNN_POINTWISE_ADD, col, uid::left_bound, 0,
                    w.virt(sd, ss, CUDNN_DATA_INT32, "col+L"), CUDNN_DATA_INT32);
  col = w.pointwise("col+left-skv", CUDNN_POINTWISE_SUB, col, uid::seq_kv, 0,
                    w.virt(sd, ss, CUDNN_DATA_INT32, "col+L-skv"), CUDNN_DATA_INT32);
  col = w.pointwise("col+left-skv+sq", CUDNN_POINTWISE_ADD, col, uid::seq_q, 0,
                    w.virt(sd, ss, CUDNN_DATA_INT32, "col+L-skv+sq"), CUDNN_DATA_INT32);
  const std::int64_t left = w.pointwise("col>row", CUDNN_POINTWISE_CMP_GT, col, row, 0,
                                        w.virt(sd, ss, CUDNN_DATA_BOOLEAN, "left"), CUDNN_DATA_BOOLEAN);
  return w.pointwise("select_left_bound", CUDNN_POINTWISE_BINARY_SELECT, s, uid::neg_inf, left,
                     w.virt(sd, ss, CUDNN_DATA_FLOAT, "S left"));
}

inline void check_key(const GraphKey& k) {
  if (k.io_type != CUDNN_DATA_BFLOAT16 && k.io_type != CUDNN_DATA_HALF) {
    cpdispatch::detail::fail("cuDNN attention graph: the data type must be bfloat16 or float16");
  }
  if (k.heads_q < 1 || k.heads_kv < 1 || k.heads_q % k.heads_kv != 0 || k.head_dim < 1 || k.batch < 1 ||
      k.max_q < 1 || k.max_kv < 1 || k.stats_pitch < 1) {
    cpdispatch::detail::fail("cuDNN attention graph: bad key (heads ", k.heads_q, "/", k.heads_kv, ", head_dim ",
                             k.head_dim, ", batch ", k.batch, ", max ", k.max_q, "/", k.max_kv, ")");
  }
}

/// Forward: O = softmax(mask(scale * Q K^T)) V and the statistics (natural-log
/// log-sum-exp per query row and head).
inline GraphSpec forward_graph(const GraphKey& k) {
  check_key(k);
  GraphWriter w;
  common_tensors(w, k);
  const std::int64_t B = k.batch, D = k.head_dim, Hq = k.heads_q, Sq = k.max_q;
  w.tensor(uid::o, {B, Hq, Sq, D}, {Sq * Hq * D, D, Hq * D, 1}, k.io_type, "O", uid::ragged_q);
  w.tensor(uid::stats, row_dims(k), stats_strides(k), CUDNN_DATA_FLOAT, "Stats", uid::ragged_stats);
  const Dims sd = score_dims(k), ss = score_strides(k), rd = row_dims(k), rs = row_strides(k);

  std::int64_t s = w.matmul("bmm1", uid::q, uid::k, w.virt(sd, ss, CUDNN_DATA_FLOAT, "S"), uid::seq_q, uid::seq_kv, 0,
                            /*padding=*/true);
  s = w.pointwise("attn_scale", CUDNN_POINTWISE_MUL, s, uid::scale, 0, w.virt(sd, ss, CUDNN_DATA_FLOAT, "S scaled"));
  s = band_masks(w, k, padding_mask(w, k, s));
  // softmax, its statistics = max + log(sum exp(s - max))
  const std::int64_t max = w.reduction("Max", CUDNN_REDUCE_TENSOR_MAX, s, w.virt(rd, rs, CUDNN_DATA_FLOAT, "M"));
  const std::int64_t sub = w.pointwise("sub", CUDNN_POINTWISE_SUB, s, max, 0, w.virt(sd, ss, CUDNN_DATA_FLOAT, "S-M"));
  const std::int64_t e = w.pointwise("exp", CUDNN_POINTWISE_EXP, sub, 0, 0, w.virt(sd, ss, CUDNN_DATA_FLOAT, "exp(S-M)"));
  const std::int64_t sum = w.reduction("sum", CUDNN_REDUCE_TENSOR_ADD, e, w.virt(rd, rs, CUDNN_DATA_FLOAT, "SumExp"));
  const std::int64_t log = w.pointwise("log", CUDNN_POINTWISE_LOG, sum, 0, 0, w.virt(rd, rs, CUDNN_DATA_FLOAT, "log"));
  w.pointwise("add", CUDNN_POINTWISE_ADD, max, log, 0, uid::stats);
  // P in the I/O type, the second matmul's A operand
  const std::int64_t p = w.pointwise("div", CUDNN_POINTWISE_DIV, e, sum, 0, w.virt(sd, ss, k.io_type, "P"));
  w.matmul("bmm2", p, uid::v, uid::o, uid::seq_q, 0, uid::seq_kv);
  return w.take();
}

/// Backward: dQ, dK, dV from Q, K, V, O, dO and the statistics. Deterministic
/// (GraphKey::deterministic): dQ is the dS K matmul's output itself (cuDNN's
/// dP-workspace kernels, the path cuDNN's frontend forces for
/// is_deterministic_algorithm on Hopper); otherwise dQ accumulates in an fp32
/// workspace tensor (DQ_ACCUM, atomics: fastest, not bitwise reproducible)
/// copied into dQ by an identity op. Both need SOFTMAX_SUM (rowsum(dO * O),
/// fp32, the statistics' layout) in the workspace.
inline GraphSpec backward_graph(const GraphKey& k) {
  check_key(k);
  GraphWriter w;
  common_tensors(w, k);
  const std::int64_t B = k.batch, D = k.head_dim, Hq = k.heads_q, Hk = k.heads_kv, Sq = k.max_q, Skv = k.max_kv;
  const Dims q_strides{Sq * Hq * D, D, Hq * D, 1}, kv_strides{Skv * Hk * D, D, Hk * D, 1};
  w.tensor(uid::o, {B, Hq, Sq, D}, q_strides, k.io_type, "O", uid::ragged_q);
  w.tensor(uid::d_o, {B, Hq, Sq, D}, q_strides, k.io_type, "dO", uid::ragged_q);
  w.tensor(uid::stats, row_dims(k), stats_strides(k), CUDNN_DATA_FLOAT, "Stats", uid::ragged_stats);
  w.tensor(uid::dq, {B, Hq, Sq, D}, q_strides, k.io_type, "dQ", uid::ragged_q);
  w.tensor(uid::dk, {B, Hk, Skv, D}, kv_strides, k.io_type, "dK", uid::ragged_kv);
  w.tensor(uid::dv, {B, Hk, Skv, D}, kv_strides, k.io_type, "dV", uid::ragged_kv);
  w.scalar(uid::one, CUDNN_DATA_FLOAT, "one");
  w.tensor(uid::softmax_sum, row_dims(k), stats_strides(k), CUDNN_DATA_FLOAT, "softmax_sum", uid::ragged_stats);
  if (!k.deterministic) w.tensor(uid::dq_accum, {B, Hq, Sq, D}, q_strides, CUDNN_DATA_FLOAT, "dQ_accum", uid::ragged_q);
  const Dims sd = score_dims(k), ss = score_strides(k), rd = row_dims(k), rs = row_strides(k);
  const Dims td{B, Hq, Skv, Sq}, ts{Hq * Sq * Skv, Sq * Skv, 1, Skv};  // a score matrix transposed

  // softmax_sum = rowsum(dO * O) * 1
  std::int64_t x = w.pointwise("mul_dO_O", CUDNN_POINTWISE_MUL, uid::d_o, uid::o, 0,
                               w.virt({B, Hq, Sq, D}, {Hq * Sq * D, Sq * D, Hq * D, 1}, CUDNN_DATA_FLOAT, "dO*O"));
  x = w.reduction("reduce_dO_o", CUDNN_REDUCE_TENSOR_ADD, x, w.virt(rd, rs, CUDNN_DATA_FLOAT, "rowsum(dO*O)"));
  w.pointwise("scale_dropout_inv", CUDNN_POINTWISE_MUL, x, uid::one, 0, uid::softmax_sum);

  // P = exp(mask(scale * Q K^T) - stats)
  std::int64_t s = w.matmul("matmul_Q_KT", uid::q, uid::k, w.virt(sd, ss, CUDNN_DATA_FLOAT, "S"), uid::seq_q,
                            uid::seq_kv, 0);
  s = w.pointwise("mul_s_attn_scale", CUDNN_POINTWISE_MUL, s, uid::scale, 0, w.virt(sd, ss, CUDNN_DATA_FLOAT, "S scaled"));
  s = padding_mask(w, k, s);
  s = w.pointwise("sub_s_m", CUDNN_POINTWISE_SUB, s, uid::stats, 0, w.virt(sd, ss, CUDNN_DATA_FLOAT, "S-stats"));
  s = band_masks(w, k, s);  // on S - stats, where the frontend places them
  const std::int64_t p = w.pointwise("exp_s", CUDNN_POINTWISE_EXP, s, 0, 0, w.virt(sd, ss, CUDNN_DATA_FLOAT, "P"));

  // dV = P^T dO (GQA: per query head, then summed over the group)
  const std::int64_t pt = w.reshape("reshape_p", p, w.virt(td, ts, k.io_type, "P^T"));
  if (Hq == Hk) {
    w.matmul("matmul_pT_dO", pt, uid::d_o, uid::dv, uid::seq_kv, 0, uid::seq_q);
  } else {
    const std::int64_t full = w.matmul("matmul_pT_dO", pt, uid::d_o,
                                       w.virt({B, Hq, Skv, D}, {Hq * Skv * D, Skv * D, D, 1}, k.io_type, "dV per query head"),
                                       uid::seq_kv, 0, uid::seq_q);
    w.reduction("red_dV_head", CUDNN_REDUCE_TENSOR_ADD, full, uid::dv);
  }

  // dS = scale * P * (dO V^T - softmax_sum)
  std::int64_t ds = w.matmul("matmul_dO_VT", uid::d_o, uid::v, w.virt(sd, ss, CUDNN_DATA_FLOAT, "dP"), uid::seq_q,
                             uid::seq_kv, 0);
  ds = w.pointwise("sub_dP_softmax_sum", CUDNN_POINTWISE_SUB, ds, uid::softmax_sum, 0,
                   w.virt(sd, ss, CUDNN_DATA_FLOAT, "dP-sum"));
  ds = w.pointwise("mul_dP_exp_s", CUDNN_POINTWISE_MUL, ds, p, 0, w.virt(sd, ss, CUDNN_DATA_FLOAT, "P*(dP-sum)"));
  ds = w.pointwise("mul_dS_attn_scale", CUDNN_POINTWISE_MUL, ds, uid::scale, 0, w.virt(sd, ss, CUDNN_DATA_FLOAT, "dS"));

  // dK = dS^T Q (GQA: summed over the group)
  const std::int64_t dst = w.reshape("reshape_dS", ds, w.virt(td, ts, k.io_type, "dS^T"));
  if (Hq == Hk) {
    w.matmul("matmul_dST_Q", dst, uid::q, uid::dk, uid::seq_kv, 0, uid::seq_q);
  } else {
    const std::int64_t full = w.matmul("matmul_dST_Q", dst, uid::q,
                                       w.virt({B, Hq, Skv, D}, {Hq * Skv * D, Skv * D, D, 1}, k.io_type, "dK per query head"),
                                       uid::seq_kv, 0, uid::seq_q);
    w.reduction("red_dK_head", CUDNN_REDUCE_TENSOR_ADD, full, uid::dk);
  }

  // dQ = dS K (K^T reshaped back to K, keeping its ragged offsets)
  const std::int64_t kk = w.virt({B, Hk, Skv, D}, kv_strides, k.io_type, "K");
  w.set_ragged(kk, uid::ragged_kv);
  w.reshape("reshape_k", uid::k, kk);
  if (k.deterministic) {
    w.matmul("matmul_dS_K", ds, kk, uid::dq, uid::seq_q, 0, uid::seq_kv);
  } else {
    w.matmul("matmul_dS_K", ds, kk, uid::dq_accum, uid::seq_q, 0, uid::seq_kv);
    w.pointwise("identity_dQ", CUDNN_POINTWISE_IDENTITY, uid::dq_accum, 0, 0, uid::dq);
  }
  return w.take();
}

}  // namespace cpdispatch::cudnn::detail
