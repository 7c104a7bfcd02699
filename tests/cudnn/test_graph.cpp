// cudnn/detail/graph.hpp: the forward and backward graphs as data.

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "cpdispatch/cudnn/detail/graph.hpp"
#include "cpdispatch/cudnn/mapping.hpp"

namespace {

using namespace cpdispatch::cudnn;
using namespace cpdispatch::cudnn::detail;

GraphKey key(Direction dir, Band band, std::int64_t hq = 8, std::int64_t hk = 8, bool deterministic = true) {
  GraphKey k;
  k.direction = dir;
  k.io_type = CUDNN_DATA_BFLOAT16;
  k.heads_q = hq;
  k.heads_kv = hk;
  k.head_dim = 128;
  k.band = band;
  k.deterministic = deterministic;
  k.batch = 4;
  k.max_q = 256;
  k.max_kv = 512;
  k.stats_pitch = 1024;
  return k;
}

std::vector<std::string> names(const GraphSpec& g) {
  std::vector<std::string> out;
  for (const OpSpec& op : g.ops) out.emplace_back(op.name);
  return out;
}

int count(const GraphSpec& g, cudnnPointwiseMode_t mode) {
  int n = 0;
  for (const OpSpec& op : g.ops) n += op.kind == OpKind::pointwise && op.mode == mode;
  return n;
}

const OpSpec& op_named(const GraphSpec& g, const std::string& name) {
  for (const OpSpec& op : g.ops) {
    if (name == op.name) return op;
  }
  ADD_FAILURE() << "no op " << name;
  return g.ops.front();
}

// Every tensor an op reads is an input of the graph or written by an earlier
// op; every virtual tensor is written exactly once; every non-virtual
// non-input output is written; uids are unique; ragged offsets exist.
void check_well_formed(const GraphSpec& g, const std::set<std::int64_t>& inputs) {
  std::set<std::int64_t> uids, written;
  for (const TensorSpec& t : g.tensors) {
    EXPECT_TRUE(uids.insert(t.uid).second) << "uid " << t.uid << " twice";
    if (t.ragged) {
      const TensorSpec* r = g.find(t.ragged);
      ASSERT_NE(r, nullptr);
      EXPECT_EQ(r->type, CUDNN_DATA_INT32);
    }
    if (t.is_virtual) { EXPECT_GE(t.uid, uid::first_virtual); }
    if (t.by_value) { EXPECT_EQ(t.dims, (Dims{1, 1, 1, 1})); }
  }
  for (const OpSpec& op : g.ops) {
    for (std::int64_t in : op.in) {
      if (in == 0) continue;
      ASSERT_NE(g.find(in), nullptr) << op.name;
      EXPECT_TRUE(inputs.count(in) || written.count(in)) << op.name << " reads " << in << " before it is written";
    }
    for (std::int64_t o : {op.m_override, op.n_override, op.k_override}) {
      if (o) { EXPECT_TRUE(o == uid::seq_q || o == uid::seq_kv) << op.name; }
    }
    ASSERT_NE(g.find(op.out), nullptr) << op.name;
    EXPECT_TRUE(written.insert(op.out).second) << op.name << " writes " << op.out << " again";
    EXPECT_FALSE(inputs.count(op.out)) << op.name << " writes an input";
  }
  for (const TensorSpec& t : g.tensors) {
    if (t.is_virtual || inputs.count(t.uid)) continue;
    EXPECT_TRUE(written.count(t.uid)) << t.name << " is never written";
  }
}

const std::set<std::int64_t> forward_inputs{uid::q, uid::k, uid::v, uid::seq_q, uid::seq_kv, uid::ragged_q,
                                            uid::ragged_kv, uid::ragged_stats, uid::scale, uid::neg_inf,
                                            uid::right_bound, uid::left_bound};
std::set<std::int64_t> backward_inputs() {
  auto s = forward_inputs;
  s.insert({uid::o, uid::d_o, uid::stats, uid::one});
  return s;
}

TEST(CudnnGraph, ForwardCausalIsTheFrontendsCompositeSdpa) {
  const GraphSpec g = forward_graph(key(Direction::forward, Band::causal));
  check_well_formed(g, forward_inputs);
  EXPECT_EQ(names(g), (std::vector<std::string>{
                          "bmm1", "attn_scale",
                          "gen_row_idx_padding", "gen_col_idx_padding", "lt_row_sq_padding", "lt_col_skv_padding",
                          "and_row_col_padding", "select_padding",
                          "gen_row_index", "gen_col_index", "row+skv", "row+skv-sq", "row+skv-sq+right", "row>=col",
                          "select_right_bound",
                          "Max", "sub", "exp", "sum", "log", "add", "div", "bmm2"}));
  const OpSpec& bmm1 = g.ops.front();
  EXPECT_EQ(bmm1.kind, OpKind::matmul);
  EXPECT_EQ(bmm1.in[0], uid::q);
  EXPECT_EQ(bmm1.in[1], uid::k);
  EXPECT_EQ(bmm1.m_override, uid::seq_q);
  EXPECT_EQ(bmm1.n_override, uid::seq_kv);
  EXPECT_TRUE(bmm1.has_padding);
  const OpSpec& bmm2 = g.ops.back();
  EXPECT_EQ(bmm2.in[1], uid::v);
  EXPECT_EQ(bmm2.out, uid::o);
  EXPECT_EQ(bmm2.m_override, uid::seq_q);
  EXPECT_EQ(bmm2.k_override, uid::seq_kv);
  EXPECT_EQ(g.tensor(bmm2.in[0]).type, CUDNN_DATA_BFLOAT16);  // P in the I/O type
  EXPECT_EQ(op_named(g, "add").out, uid::stats);
  EXPECT_EQ(op_named(g, "row+skv-sq+right").in[1], uid::right_bound);
  EXPECT_EQ(op_named(g, "row>=col").mode, CUDNN_POINTWISE_CMP_GE);
  EXPECT_EQ(op_named(g, "select_right_bound").in[1], uid::neg_inf);
  EXPECT_EQ(op_named(g, "gen_row_index").axis, 2);
  EXPECT_EQ(op_named(g, "gen_col_index").axis, 3);
  EXPECT_EQ(g.find(uid::left_bound), nullptr);
}

TEST(CudnnGraph, OnlyIndexGeneratorsCarryAnAxis) {
  // cuDNN's pointwise AXIS belongs to GEN_INDEX; the frontend sends it for no other mode.
  for (Direction d : {Direction::forward, Direction::backward}) {
    for (Band b : {Band::causal, Band::window, Band::full}) {
      const GraphKey k = key(d, b, 8, 2);
      const GraphSpec g = d == Direction::forward ? forward_graph(k) : backward_graph(k);
      for (const OpSpec& op : g.ops) {
        if (op.kind == OpKind::pointwise && op.mode != CUDNN_POINTWISE_GEN_INDEX) {
          EXPECT_EQ(op.axis, -1) << op.name;
        }
      }
    }
  }
}

TEST(CudnnGraph, LayoutsAreThdWithRaggedOffsetsAndOurLse) {
  const GraphSpec g = forward_graph(key(Direction::forward, Band::causal, 8, 2));
  const TensorSpec& q = g.tensor(uid::q);
  EXPECT_EQ(q.dims, (Dims{4, 8, 256, 128}));
  EXPECT_EQ(q.strides, (Dims{256 * 8 * 128, 128, 8 * 128, 1}));
  EXPECT_EQ(q.ragged, uid::ragged_q);
  const TensorSpec& kt = g.tensor(uid::k);  // K^T of a [tokens][2][128] buffer
  EXPECT_EQ(kt.dims, (Dims{4, 2, 128, 512}));
  EXPECT_EQ(kt.strides, (Dims{512 * 2 * 128, 128, 1, 2 * 128}));
  EXPECT_EQ(kt.ragged, uid::ragged_kv);
  EXPECT_EQ(g.tensor(uid::v).dims, (Dims{4, 2, 512, 128}));
  EXPECT_EQ(g.tensor(uid::o).strides, q.strides);
  const TensorSpec& stats = g.tensor(uid::stats);
  EXPECT_EQ(stats.dims, (Dims{4, 8, 256, 1}));
  EXPECT_EQ(stats.strides, (Dims{256, 1024, 1, 1}));  // [heads][pitch]: our lse layout
  EXPECT_EQ(stats.type, CUDNN_DATA_FLOAT);
  EXPECT_EQ(stats.ragged, uid::ragged_stats);
  EXPECT_EQ(g.tensor(uid::seq_q).dims, (Dims{4, 1, 1, 1}));
  EXPECT_EQ(g.tensor(uid::ragged_q).dims, (Dims{5, 1, 1, 1}));
  EXPECT_TRUE(g.tensor(uid::scale).by_value);
  EXPECT_TRUE(g.tensor(uid::right_bound).by_value);
  EXPECT_EQ(g.tensor(uid::right_bound).type, CUDNN_DATA_INT32);
  // ragged offset tensors come before the tensors that use them
  std::set<std::int64_t> seen;
  for (const TensorSpec& t : g.tensors) {
    if (t.ragged) { EXPECT_TRUE(seen.count(t.ragged)) << t.name; }
    seen.insert(t.uid);
  }
}

TEST(CudnnGraph, WindowAddsTheLeftBoundAndFullOnlyPadding) {
  const GraphSpec w = forward_graph(key(Direction::forward, Band::window));
  check_well_formed(w, forward_inputs);
  EXPECT_EQ(count(w, CUDNN_POINTWISE_BINARY_SELECT), 3);
  EXPECT_EQ(op_named(w, "col+left").in[1], uid::left_bound);
  EXPECT_EQ(op_named(w, "col>row").mode, CUDNN_POINTWISE_CMP_GT);
  EXPECT_TRUE(w.tensor(uid::left_bound).by_value);
  const GraphSpec f = forward_graph(key(Direction::forward, Band::full));
  check_well_formed(f, forward_inputs);
  EXPECT_EQ(count(f, CUDNN_POINTWISE_BINARY_SELECT), 1);
  EXPECT_EQ(count(f, CUDNN_POINTWISE_GEN_INDEX), 2);
  EXPECT_EQ(f.find(uid::right_bound), nullptr);
}

TEST(CudnnGraph, BackwardMhaDeterministic) {
  const GraphSpec g = backward_graph(key(Direction::backward, Band::causal));
  check_well_formed(g, backward_inputs());
  const auto n = names(g);
  EXPECT_EQ(n.front(), "mul_dO_O");
  EXPECT_EQ(op_named(g, "scale_dropout_inv").out, uid::softmax_sum);
  EXPECT_EQ(op_named(g, "matmul_pT_dO").out, uid::dv);
  EXPECT_EQ(op_named(g, "matmul_dST_Q").out, uid::dk);
  EXPECT_EQ(op_named(g, "matmul_dS_K").out, uid::dq);  // no fp32 accumulator: deterministic
  EXPECT_EQ(g.find(uid::dq_accum), nullptr);
  EXPECT_EQ(op_named(g, "sub_s_m").in[1], uid::stats);
  EXPECT_EQ(g.tensor(uid::v).dims, (Dims{4, 8, 128, 512}));  // V^T
  EXPECT_EQ(g.tensor(uid::softmax_sum).strides, g.tensor(uid::stats).strides);
  // the band comes after S - stats, before exp
  const auto at = [&](const std::string& s) { return std::find(n.begin(), n.end(), s) - n.begin(); };
  EXPECT_LT(at("select_padding"), at("sub_s_m"));
  EXPECT_LT(at("sub_s_m"), at("select_right_bound"));
  EXPECT_LT(at("select_right_bound"), at("exp_s"));
  const TensorSpec& kk = g.tensor(op_named(g, "reshape_k").out);
  EXPECT_EQ(kk.dims, (Dims{4, 8, 512, 128}));
  EXPECT_EQ(kk.ragged, uid::ragged_kv);
  EXPECT_EQ(op_named(g, "matmul_dO_VT").m_override, uid::seq_q);
  EXPECT_EQ(op_named(g, "matmul_pT_dO").m_override, uid::seq_kv);
  EXPECT_EQ(op_named(g, "matmul_pT_dO").k_override, uid::seq_q);
}

TEST(CudnnGraph, BackwardGqaSumsOverTheGroupAndNonDeterministicAccumulates) {
  const GraphSpec g = backward_graph(key(Direction::backward, Band::window, 8, 2, /*deterministic=*/false));
  check_well_formed(g, backward_inputs());
  EXPECT_EQ(op_named(g, "red_dV_head").out, uid::dv);
  EXPECT_EQ(op_named(g, "red_dK_head").out, uid::dk);
  EXPECT_EQ(g.tensor(op_named(g, "matmul_pT_dO").out).dims, (Dims{4, 8, 512, 128}));
  EXPECT_EQ(op_named(g, "matmul_dS_K").out, uid::dq_accum);
  EXPECT_EQ(op_named(g, "identity_dQ").out, uid::dq);
  EXPECT_EQ(g.tensor(uid::dq_accum).type, CUDNN_DATA_FLOAT);
  EXPECT_EQ(g.tensor(uid::dq_accum).ragged, uid::ragged_q);
  EXPECT_EQ(count(g, CUDNN_POINTWISE_BINARY_SELECT), 3);
}

// ---- the graphs against a statement of what each node must compute ---------

/// What every pointwise node of the graphs computes, by name, written down from
/// the attention it implements (not from the graph code): the scores scaled,
/// index generators, the bounds' arithmetic and comparisons, the selects with
/// -inf, the softmax and its statistics, and backward's dO.O, P, dP - sum, dS.
const std::map<std::string, cudnnPointwiseMode_t> pointwise_modes{
    {"attn_scale", CUDNN_POINTWISE_MUL},
    {"gen_row_idx_padding", CUDNN_POINTWISE_GEN_INDEX},
    {"gen_col_idx_padding", CUDNN_POINTWISE_GEN_INDEX},
    {"lt_row_sq_padding", CUDNN_POINTWISE_CMP_LT},
    {"lt_col_skv_padding", CUDNN_POINTWISE_CMP_LT},
    {"and_row_col_padding", CUDNN_POINTWISE_LOGICAL_AND},
    {"select_padding", CUDNN_POINTWISE_BINARY_SELECT},
    {"gen_row_index", CUDNN_POINTWISE_GEN_INDEX},
    {"gen_col_index", CUDNN_POINTWISE_GEN_INDEX},
    {"row+skv", CUDNN_POINTWISE_ADD},
    {"row+skv-sq", CUDNN_POINTWISE_SUB},
    {"row+skv-sq+right", CUDNN_POINTWISE_ADD},
    {"row>=col", CUDNN_POINTWISE_CMP_GE},
    {"select_right_bound", CUDNN_POINTWISE_BINARY_SELECT},
    {"col+left", CUDNN_POINTWISE_ADD},
    {"col+left-skv", CUDNN_POINTWISE_SUB},
    {"col+left-skv+sq", CUDNN_POINTWISE_ADD},
    {"col>row", CUDNN_POINTWISE_CMP_GT},
    {"select_left_bound", CUDNN_POINTWISE_BINARY_SELECT},
    {"sub", CUDNN_POINTWISE_SUB},
    {"exp", CUDNN_POINTWISE_EXP},
    {"log", CUDNN_POINTWISE_LOG},
    {"add", CUDNN_POINTWISE_ADD},
    {"div", CUDNN_POINTWISE_DIV},
    {"mul_dO_O", CUDNN_POINTWISE_MUL},
    {"scale_dropout_inv", CUDNN_POINTWISE_MUL},
    {"mul_s_attn_scale", CUDNN_POINTWISE_MUL},
    {"sub_s_m", CUDNN_POINTWISE_SUB},
    {"exp_s", CUDNN_POINTWISE_EXP},
    {"sub_dP_softmax_sum", CUDNN_POINTWISE_SUB},
    {"mul_dP_exp_s", CUDNN_POINTWISE_MUL},
    {"mul_dS_attn_scale", CUDNN_POINTWISE_MUL},
    {"identity_dQ", CUDNN_POINTWISE_IDENTITY},
};
/// And every reduction: the row maximum, the row sums, and grouped-query
/// attention's gradients summed over the query heads of a key-value head.
const std::map<std::string, cudnnReduceTensorOp_t> reductions{
    {"Max", CUDNN_REDUCE_TENSOR_MAX},        {"sum", CUDNN_REDUCE_TENSOR_ADD},        {"reduce_dO_o", CUDNN_REDUCE_TENSOR_ADD},
    {"red_dV_head", CUDNN_REDUCE_TENSOR_ADD}, {"red_dK_head", CUDNN_REDUCE_TENSOR_ADD},
};

TEST(CudnnGraph, EveryNodeComputesWhatItsPlaceInAttentionNeeds) {
  for (const Direction d : {Direction::forward, Direction::backward}) {
    for (const Band b : {Band::full, Band::causal, Band::window}) {
      for (const auto& [hq, hk] : {std::pair<std::int64_t, std::int64_t>{8, 8}, {8, 2}}) {
        for (const bool deterministic : {true, false}) {
          const GraphKey k = key(d, b, hq, hk, deterministic);
          const GraphSpec g = d == Direction::forward ? forward_graph(k) : backward_graph(k);
          SCOPED_TRACE(::testing::Message() << (d == Direction::forward ? "forward" : "backward") << ", band " << static_cast<int>(b) << ", heads "
                                            << hq << "/" << hk << (deterministic ? "" : ", atomic dQ"));
          int reduced = 0;
          for (const OpSpec& op : g.ops) {
            if (op.kind == OpKind::pointwise) {
              const auto it = pointwise_modes.find(op.name);
              ASSERT_NE(it, pointwise_modes.end()) << "a pointwise node nobody stated: " << op.name;
              EXPECT_EQ(op.mode, it->second) << op.name;
            } else if (op.kind == OpKind::reduction) {
              const auto it = reductions.find(op.name);
              ASSERT_NE(it, reductions.end()) << "a reduction nobody stated: " << op.name;
              EXPECT_EQ(op.reduce, it->second) << op.name;
              ++reduced;
            }
          }
          // Forward: the row maximum and sum; backward: rowsum(dO O), and dV, dK summed over a group (GQA only).
          EXPECT_EQ(reduced, d == Direction::forward ? 2 : (hq == hk ? 1 : 3));
        }
      }
    }
  }
}

/// One score element through the graph's elementwise nodes, as the nodes'
/// modes define them: query row i and key c of a sequence of sq queries and
/// skv keys, the scores 1 and the statistics 0. The nodes whose inputs are
/// not known (the softmax after its reduction, backward's dO.O) are left out.
/// Returns what reaches `consumer`'s first input: a finite score where the
/// masks let (i, c) through, -inf where they do not.
double masked_score(const GraphSpec& g, const std::string& consumer, std::int64_t i, std::int64_t c, std::int64_t sq, std::int64_t skv,
                    const BandBounds& bounds) {
  const double inf = std::numeric_limits<double>::infinity();
  std::map<std::int64_t, double> v{{uid::seq_q, static_cast<double>(sq)}, {uid::seq_kv, static_cast<double>(skv)},
                                   {uid::right_bound, bounds.right},      {uid::left_bound, bounds.left},
                                   {uid::scale, 0.5},                    {uid::neg_inf, -inf},
                                   {uid::stats, 0.0}};
  for (const OpSpec& op : g.ops) {
    if (op.kind == OpKind::matmul && op.in[0] == uid::q && op.in[1] == uid::k) v[op.out] = 1.0;  // S = Q K^T
    if (op.kind != OpKind::pointwise) continue;
    const auto known = [&](std::int64_t id) { return id == 0 || v.count(id) != 0; };
    if (op.mode != CUDNN_POINTWISE_GEN_INDEX && !(known(op.in[0]) && known(op.in[1]) && known(op.in[2]))) continue;
    const double x = op.in[0] ? v[op.in[0]] : 0, y = op.in[1] ? v[op.in[1]] : 0, t = op.in[2] ? v[op.in[2]] : 0;
    double r = 0;
    switch (op.mode) {
      case CUDNN_POINTWISE_GEN_INDEX: r = op.axis == 2 ? static_cast<double>(i) : static_cast<double>(c); break;
      case CUDNN_POINTWISE_ADD: r = x + y; break;
      case CUDNN_POINTWISE_SUB: r = x - y; break;
      case CUDNN_POINTWISE_MUL: r = x * y; break;
      case CUDNN_POINTWISE_CMP_LT: r = x < y; break;
      case CUDNN_POINTWISE_CMP_GE: r = x >= y; break;
      case CUDNN_POINTWISE_CMP_GT: r = x > y; break;
      case CUDNN_POINTWISE_LOGICAL_AND: r = x != 0 && y != 0; break;
      case CUDNN_POINTWISE_BINARY_SELECT: r = t != 0 ? x : y; break;
      default: continue;  // the softmax's own nodes: not masks
    }
    v[op.out] = r;
  }
  return v[op_named(g, consumer).in[0]];
}

/// Entries of every kind the mapping makes (full, causal, window, and the
/// inverse band), each trimmed and grouped; through the graph of its group,
/// forward and backward, a sequence's (row, key) gets a score exactly where
/// the entry allows the pair, and padding rows and keys get none.
TEST(CudnnGraph, TheMasksLetThroughExactlyWhatEachEntryAllows) {
  using cpdispatch::AttentionEntry;
  const auto band = [](std::int64_t lo, std::int64_t hi) { return cpdispatch::Band{lo, hi}; };
  const std::int64_t open_lo = cpdispatch::Band::unbounded_lo, open_hi = cpdispatch::Band::unbounded_hi;
  const std::vector<AttentionEntry> entries{
      {0, 6, 0, 6, band(open_lo, 0)},    // causal, square
      {0, 4, 0, 9, band(open_lo, 5)},    // causal, bottom-right: rows see up to 5 keys ahead
      {2, 5, 0, 7, band(-2, 0)},         // a window of 3 keys, shifted
      {0, 5, 0, 5, band(-1, 1)},         // a band of width 3
      {0, 6, 0, 6, band(0, open_hi)},    // inverse causal: each row sees itself and the keys after it
      {0, 3, 0, 4, band(open_lo, open_hi)},  // full
      {3, 7, 1, 8, band(-3, -1)},        // strictly below the diagonal, window
  };
  for (const AttentionEntry& e : entries) {
    SCOPED_TRACE(::testing::Message() << "entry q[" << e.q_start << ", +" << e.q_len << ") kv[" << e.kv_start << ", +" << e.kv_len << ") band ["
                                      << e.band.lo << ", " << e.band.hi << "]");
    const EntryMap m = map_entries(std::vector<AttentionEntry>{e});
    ASSERT_EQ(m.groups.size(), 1u);
    const Group& group = m.groups[0];
    ASSERT_EQ(group.sequences.size(), 1u);
    const Sequence& s = group.sequences[0];
    const BandBounds bounds = band_bounds(group);
    for (const Direction d : {Direction::forward, Direction::backward}) {
      GraphKey k = key(d, group.band, 8, 2);
      k.max_q = 8;
      k.max_kv = 16;
      const GraphSpec g = d == Direction::forward ? forward_graph(k) : backward_graph(k);
      const std::string consumer = d == Direction::forward ? "Max" : "exp_s";
      for (std::int64_t i = 0; i < k.max_q; ++i) {
        for (std::int64_t c = 0; c < k.max_kv; ++c) {
          const bool inside = i < s.q_len && c < s.kv_len;
          const bool want = inside && e.allows(s.q_start + i, s.kv_start + c);
          const double got = masked_score(g, consumer, i, c, s.q_len, s.kv_len, bounds);
          ASSERT_FALSE(std::isnan(got)) << "row " << i << " key " << c;
          EXPECT_EQ(std::isfinite(got), want) << (d == Direction::forward ? "forward" : "backward") << ", row " << i << " key " << c << ": " << got;
        }
      }
    }
  }
}

TEST(CudnnGraph, RefusesFloatAndBadKeys) {
  GraphKey k = key(Direction::forward, Band::full);
  k.io_type = CUDNN_DATA_FLOAT;
  EXPECT_THROW(forward_graph(k), cpdispatch::invalid_input);
  k = key(Direction::forward, Band::full, 6, 4);
  EXPECT_THROW(forward_graph(k), cpdispatch::invalid_input);
}

}  // namespace
