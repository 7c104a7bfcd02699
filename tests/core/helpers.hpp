#pragma once
// Shared test utilities for tests/core: conversions between the reference
// (reference.hpp) and cpdispatch types, field-by-field comparison, random
// plan generators, and printers for readable GoogleTest failures.

#include <gtest/gtest.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <vector>

#include "cpdispatch/cpdispatch.hpp"
#include "reference.hpp"

namespace cpdispatch {
// Lets GoogleTest print tensors in failure messages (found by ADL).
template <class T>
void PrintTo(const Tensor<T>& t, std::ostream* os) {
  *os << "shape [";
  const auto shape = t.shape();
  for (std::size_t i = 0; i < shape.size(); ++i) *os << (i ? ", " : "") << shape[i];
  *os << "] values {";
  for (std::size_t i = 0; i < t.numel(); ++i) *os << (i ? ", " : "") << +t.flat()[i];
  *os << "}";
}
}  // namespace cpdispatch

namespace cptest {

using I = std::int64_t;
using cpdispatch::Tensor;
using M2 = std::vector<std::vector<I>>;
using M3 = std::vector<std::vector<std::vector<I>>>;

/// Integer tensors written as literals: the worked examples' numbers.
inline Tensor<I> t1(const std::vector<I>& v) {
  Tensor<I> t({v.size()});
  for (std::size_t i = 0; i < v.size(); ++i) t(i) = v[i];
  return t;
}
inline Tensor<I> t2(const M2& m) { return cpdispatch::make_tensor<I>(m); }
inline Tensor<I> t3(const M3& m) { return cpdispatch::make_tensor<I>(m); }

// ------------------------------------------------------------------- errors

/// Runs `f`, which must throw exactly `E` (a cpdispatch::error); returns the
/// message so the caller can check that it names the culprit. A missing or
/// different exception is a test failure (and yields a message that will not
/// match any expectation).
template <class E, class F>
std::string message_of(F&& f) {
  static_assert(std::is_base_of_v<cpdispatch::error, E>);
  try {
    f();
  } catch (const cpdispatch::error& e) {
    if (typeid(e) != typeid(E)) {
      ADD_FAILURE() << "threw " << typeid(e).name() << " (\"" << e.what() << "\"), expected " << typeid(E).name();
      return std::string("(wrong exception type) ") + e.what();
    }
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a std::exception that is not a cpdispatch::error: " << e.what();
    return "(not a cpdispatch::error)";
  }
  ADD_FAILURE() << "no exception thrown";
  return "(no exception)";
}

// ---------------------------------------------------------------- conversions

inline Tensor<I> to_tensor(const ref::Mat& m, std::size_t cols) {
  Tensor<I> t({m.size(), cols});
  for (std::size_t i = 0; i < m.size(); ++i)
    for (std::size_t j = 0; j < cols; ++j) t(i, j) = m[i][j];
  return t;
}

inline Tensor<I> to_tensor(const ref::Cube& c, std::size_t s, std::size_t k) {
  Tensor<I> t({c.size(), s, k});
  for (std::size_t i = 0; i < c.size(); ++i)
    for (std::size_t j = 0; j < s; ++j)
      for (std::size_t l = 0; l < k; ++l) t(i, j, l) = c[i][j][l];
  return t;
}

inline cpdispatch::QkvPlan to_plan(const ref::Plan& p) {
  cpdispatch::QkvPlan plan;
  plan.world_size = p.W;
  plan.max_cp_degree = p.C;
  plan.ranks.resize(p.ranks.size());
  for (std::size_t r = 0; r < p.ranks.size(); ++r)
    for (const ref::Doc& d : p.ranks[r]) plan.ranks[r].docs.push_back({d.len, d.dst});
  return plan;
}

inline ref::Plan from_plan(const cpdispatch::QkvPlan& p) {
  ref::Plan plan;
  plan.W = p.world_size;
  plan.C = p.max_cp_degree;
  plan.ranks.resize(p.ranks.size());
  for (std::size_t r = 0; r < p.ranks.size(); ++r)
    for (const auto& d : p.ranks[r].docs) plan.ranks[r].push_back({d.shard_len, d.dst});
  return plan;
}

// ----------------------------------------------------------------- comparison

inline std::string multi_index(std::size_t flat, const std::vector<std::size_t>& shape) {
  std::vector<std::size_t> ix(shape.size());
  for (std::size_t a = shape.size(); a-- > 0;) {
    ix[a] = shape[a] ? flat % shape[a] : 0;
    flat = shape[a] ? flat / shape[a] : 0;
  }
  std::ostringstream s;  // (not string concatenation: GCC 12 -Wrestrict false positive at -O3)
  for (std::size_t i : ix) s << '[' << i << ']';
  return s.str();
}

inline std::string shape_text(const std::vector<std::size_t>& shape) {
  std::ostringstream s;
  s << '[';
  for (std::size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  s << ']';
  return s.str();
}

inline ::testing::AssertionResult same_array(const Tensor<I>& got, const ref::Arr& want, const std::string& field) {
  if (got.shape() != want.shape) {
    return ::testing::AssertionFailure() << field << ": shape " << shape_text(got.shape()) << ", reference "
                                         << shape_text(want.shape);
  }
  for (std::size_t i = 0; i < want.v.size(); ++i) {
    if (got.flat()[i] != want.v[i]) {
      return ::testing::AssertionFailure() << field << multi_index(i, want.shape) << " = " << got.flat()[i]
                                           << ", reference " << want.v[i];
    }
  }
  return ::testing::AssertionSuccess();
}

inline ::testing::AssertionResult same_meta(const cpdispatch::Metadata& got, const ref::Meta& want, const std::string& name) {
  const auto W = want.num_seqs.shape.at(0);
  if (got.world_size != static_cast<I>(W)) {
    return ::testing::AssertionFailure() << name << ".world_size = " << got.world_size << ", reference " << W;
  }
  for (auto [g, w, f] : {std::tuple{&got.dst_rank, &want.dst_rank, "dst_rank"},
                         std::tuple{&got.dst_offset, &want.dst_offset, "dst_offset"},
                         std::tuple{&got.seq_len, &want.seq_len, "seq_len"},
                         std::tuple{&got.num_recv_tokens, &want.num_recv_tokens, "num_recv_tokens"},
                         std::tuple{&got.num_seqs, &want.num_seqs, "num_seqs"}}) {
    auto res = same_array(*g, *w, name + "." + f);
    if (!res) return res;
  }
  for (auto [g, w, f] : {std::tuple{&got.seq_recv_mask, &want.seq_recv_mask, "seq_recv_mask"},
                         std::tuple{&got.recv_seq_lens, &want.recv_seq_lens, "recv_seq_lens"}}) {
    if (g->has_value() != w->has_value()) {
      return ::testing::AssertionFailure() << name << "." << f << (g->has_value() ? " is present" : " is absent")
                                           << ", reference " << (w->has_value() ? "present" : "absent");
    }
    if (g->has_value()) {
      auto res = same_array(**g, **w, name + "." + f);
      if (!res) return res;
    }
  }
  if (got.num_total_recv_tokens.size() != W) {
    return ::testing::AssertionFailure() << name << ".num_total_recv_tokens has " << got.num_total_recv_tokens.size()
                                         << " entries, expected " << W;
  }
  for (std::size_t d = 0; d < W; ++d) {
    const I want_total = want.num_recv_tokens.v[d * (W + 1) + W];
    if (got.num_total_recv_tokens[d] != want_total) {
      return ::testing::AssertionFailure() << name << ".num_total_recv_tokens[" << d << "] = " << got.num_total_recv_tokens[d]
                                           << ", reference " << want_total;
    }
  }
  return ::testing::AssertionSuccess();
}

inline ::testing::AssertionResult same_rows(const std::vector<std::vector<I>>& got, const ref::Mat& want, const std::string& field) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << field << " has " << got.size() << " rows, reference " << want.size();
  for (std::size_t d = 0; d < want.size(); ++d) {
    if (got[d] != want[d]) {
      ::testing::AssertionResult res = ::testing::AssertionFailure();
      res << field << "[" << d << "] = {";
      for (std::size_t i = 0; i < got[d].size(); ++i) res << (i ? "," : "") << got[d][i];
      res << "}, reference {";
      for (std::size_t i = 0; i < want[d].size(); ++i) res << (i ? "," : "") << want[d][i];
      return res << "}";
    }
  }
  return ::testing::AssertionSuccess();
}

inline ::testing::AssertionResult same_qkv(const cpdispatch::QkvMetadata& got, const ref::Qkv& want) {
  for (auto [g, w, n] : {std::tuple{&got.q_fwd, &want.q_fwd, "q_fwd"}, std::tuple{&got.q_rev, &want.q_rev, "q_rev"},
                         std::tuple{&got.kv_fwd, &want.kv_fwd, "kv_fwd"}, std::tuple{&got.kv_rev, &want.kv_rev, "kv_rev"}}) {
    auto res = same_meta(*g, *w, n);
    if (!res) return res;
  }
  const auto& a = got.attn;
  const auto& b = want.attn;
  for (auto [g, w, n] : {std::tuple{&a.seqlens_q, &b.seqlens_q, "attn.seqlens_q"},
                         std::tuple{&a.seqlens_kv, &b.seqlens_kv, "attn.seqlens_kv"},
                         std::tuple{&a.cu_seqlens_q, &b.cu_seqlens_q, "attn.cu_seqlens_q"},
                         std::tuple{&a.cu_seqlens_kv, &b.cu_seqlens_kv, "attn.cu_seqlens_kv"}}) {
    auto res = same_rows(*g, *w, n);
    if (!res) return res;
  }
  auto res = same_rows({a.max_seqlen_q, a.max_seqlen_kv}, {b.max_seqlen_q, b.max_seqlen_kv}, "attn.max_seqlen_{q,kv}");
  return res;
}

// ---------------------------------------------------------- random generators

/// A deterministic source for test inputs; mt19937_64's output sequence is
/// fixed by the standard, and ranges use plain modulo, so a printed seed
/// reproduces the same plan everywhere.
struct TestRng {
  std::mt19937_64 e;
  explicit TestRng(std::uint64_t seed) : e(seed) {}
  std::uint64_t below(std::uint64_t n) { return e() % n; }
  I between(I lo, I hi) { return lo + static_cast<I>(below(static_cast<std::uint64_t>(hi - lo + 1))); }
  bool chance(unsigned percent) { return below(100) < percent; }
};

struct QkvGenOptions {
  I max_world = 64;
  I max_docs = 3;    ///< per non-empty rank
  I max_shards = 8;  ///< per document
  I max_len = 40;    ///< per shard
};

/// A random QKV plan: world sizes 1..max_world (biased to small), empty
/// ranks, up to max_shards unequal shards per document, duplicate
/// destinations inside a document, sometimes an explicit max_cp_degree above
/// the largest shard count. Always at least one document.
inline ref::Plan random_qkv_plan(std::uint64_t seed, const QkvGenOptions& o = {}) {
  TestRng rng(seed);
  ref::Plan p;
  p.W = 1 + static_cast<I>(rng.below(static_cast<std::uint64_t>(rng.chance(35) ? o.max_world : std::min<I>(8, o.max_world))));
  p.ranks.resize(static_cast<std::size_t>(p.W));
  const unsigned empty_percent = static_cast<unsigned>(rng.below(3)) * 35;  // 0, 35 or 70 % of ranks hold nothing
  std::size_t docs = 0, most = 0;
  auto make_doc = [&]() {
    ref::Doc d;
    const auto n = static_cast<std::size_t>(1 + rng.below(static_cast<std::uint64_t>(o.max_shards)));
    const I lmax = std::array<I, 3>{1, 4, o.max_len}[rng.below(3)];
    const unsigned mode = static_cast<unsigned>(rng.below(3));  // 0: any rank, 1: all on one rank, 2: two ranks
    const I a = rng.between(0, p.W - 1), b = rng.between(0, p.W - 1);
    for (std::size_t k = 0; k < n; ++k) {
      d.len.push_back(rng.between(1, lmax));
      d.dst.push_back(mode == 0 ? rng.between(0, p.W - 1) : mode == 1 ? a : (rng.chance(50) ? a : b));
    }
    most = std::max(most, n);
    ++docs;
    return d;
  };
  for (auto& rank : p.ranks) {
    if (rng.chance(empty_percent)) continue;
    const I n = rng.between(1, o.max_docs);
    for (I i = 0; i < n; ++i) rank.push_back(make_doc());
  }
  if (docs == 0) p.ranks[rng.below(static_cast<std::uint64_t>(p.W))].push_back(make_doc());
  if (rng.chance(30)) p.C = static_cast<I>(most) + rng.between(0, 2);
  return p;
}

/// A random query-level plan (section 1).
struct QueryCase {
  ref::Mat seq_len;
  ref::Cube dispatch;  ///< [W][S][C]
  std::size_t S = 0, C = 1;
  bool three_d = false;

  Tensor<I> seq_len_tensor() const { return to_tensor(seq_len, S); }
  Tensor<I> dispatch_tensor() const {
    if (three_d) return to_tensor(dispatch, S, C);
    ref::Mat d2(dispatch.size(), ref::Vec(S));
    for (std::size_t r = 0; r < dispatch.size(); ++r)
      for (std::size_t j = 0; j < S; ++j) d2[r][j] = dispatch[r][j][0];
    return to_tensor(d2, S);
  }
  ref::Query reference() const { return ref::plan_query(seq_len, dispatch, C, three_d); }
};

inline QueryCase random_query_plan(std::uint64_t seed, I max_world = 64, I max_len = 40) {
  TestRng rng(seed);
  QueryCase q;
  const I W = 1 + static_cast<I>(rng.below(static_cast<std::uint64_t>(rng.chance(35) ? max_world : std::min<I>(8, max_world))));
  q.three_d = rng.chance(50);
  q.C = q.three_d ? static_cast<std::size_t>(rng.between(1, 4)) : 1;
  q.S = static_cast<std::size_t>(rng.between(0, 8));
  const unsigned hole_percent = static_cast<unsigned>(rng.below(4)) * 25;
  q.seq_len.assign(static_cast<std::size_t>(W), ref::Vec(q.S, 0));
  q.dispatch.assign(static_cast<std::size_t>(W), ref::Mat(q.S, ref::Vec(q.C, -1)));
  for (std::size_t r = 0; r < static_cast<std::size_t>(W); ++r) {
    const auto n = static_cast<std::size_t>(rng.between(0, static_cast<I>(q.S)));
    const I lmax = std::array<I, 3>{1, 4, max_len}[rng.below(3)];
    for (std::size_t j = 0; j < n; ++j) {
      q.seq_len[r][j] = rng.between(1, lmax);
      bool any = false;
      for (std::size_t k = 0; k < q.C; ++k) {
        if (q.three_d && rng.chance(hole_percent)) continue;
        q.dispatch[r][j][k] = rng.between(0, W - 1);
        any = true;
      }
      if (!any) q.dispatch[r][j][rng.below(q.C)] = rng.between(0, W - 1);
    }
  }
  return q;
}

// ------------------------------------------------------------ plan inspection

/// P_r(j) for every rank: the start of each shard in the MLP-layout buffer.
inline std::vector<std::vector<I>> shard_starts(const Tensor<I>& seq_len) {
  std::vector<std::vector<I>> p(seq_len.size(0));
  for (std::size_t r = 0; r < seq_len.size(0); ++r) {
    I acc = 0;
    for (std::size_t j = 0; j < seq_len.size(1); ++j) {
      p[r].push_back(acc);
      acc += seq_len(r, j);
    }
    p[r].push_back(acc);  // T_r last
  }
  return p;
}

}  // namespace cptest
