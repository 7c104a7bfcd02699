#pragma once
// Shared checks for tests/balance: plan validity against its problem, an
// independent per-token count of attention cost and bytes, and the memcpy
// round trip of a plan through simulate + combine_copies.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cpdispatch/balance/balance.hpp"
#include "cpdispatch/cpdispatch.hpp"
#include "../core/helpers.hpp"

namespace baltest {

using I = std::int64_t;
using ::testing::AssertionFailure;
using ::testing::AssertionResult;
using ::testing::AssertionSuccess;

/// Runs `f`, which must throw exactly `E`; returns the message (shared with tests/core).
using cptest::message_of;

/// Sum over documents of their whole-document cost.
inline I total_cost(const cpdispatch::BalanceProblem& p) {
  I total = 0;
  for (const auto& rank : p.docs)
    for (I len : rank) total += len * (len + 1) / 2;
  return total;
}

/// The plan keeps every rank's documents in order, cuts each into at most C
/// shards of at least one token that tile it exactly, plans and validates,
/// respects the receive capacities, and conserves attention cost.
inline AssertionResult valid_plan(const cpdispatch::BalanceProblem& p, const cpdispatch::QkvPlan& plan) {
  const auto W = static_cast<std::size_t>(p.world_size);
  if (plan.world_size != p.world_size || plan.ranks.size() != W) return AssertionFailure() << "world size differs";
  if (plan.max_cp_degree != p.max_cp_degree) return AssertionFailure() << "max_cp_degree " << plan.max_cp_degree.value_or(-1);
  for (std::size_t r = 0; r < W; ++r) {
    if (plan.ranks[r].docs.size() != p.docs[r].size()) {
      return AssertionFailure() << "rank " << r << " has " << plan.ranks[r].docs.size() << " documents, input " << p.docs[r].size();
    }
    for (std::size_t i = 0; i < p.docs[r].size(); ++i) {
      const auto& d = plan.ranks[r].docs[i];
      if (d.shard_len.empty() || static_cast<I>(d.shard_len.size()) > p.max_cp_degree) {
        return AssertionFailure() << "docs[" << r << "][" << i << "] has " << d.shard_len.size() << " shards, C = " << p.max_cp_degree;
      }
      I sum = 0;
      for (I len : d.shard_len) {
        if (len < 1) return AssertionFailure() << "docs[" << r << "][" << i << "] has a shard of " << len << " tokens";
        sum += len;
      }
      if (sum != p.docs[r][i]) return AssertionFailure() << "docs[" << r << "][" << i << "] shards sum to " << sum << ", length " << p.docs[r][i];
    }
  }
  try {
    const cpdispatch::QkvMetadata m = cpdispatch::plan_qkv(plan);
    m.q_fwd.validate("q_fwd");
    m.q_rev.validate("q_rev");
    m.kv_fwd.validate("kv_fwd");
    m.kv_rev.validate("kv_rev");
  } catch (const cpdispatch::error& e) {
    return AssertionFailure() << "plan_qkv/validate: " << e.what();
  }
  const cpdispatch::PlanCost cost = cpdispatch::plan_cost(plan, p.q_bytes, p.kv_bytes);
  if (cost.total_attention() != total_cost(p)) {
    return AssertionFailure() << "attention cost " << cost.total_attention() << " differs from the documents' " << total_cost(p);
  }
  if (!p.recv_capacity.empty()) {
    for (std::size_t r = 0; r < W; ++r)
      if (cost.kv_tokens[r] > p.recv_capacity[r]) {
        return AssertionFailure() << "rank " << r << " holds " << cost.kv_tokens[r] << " KV tokens, capacity " << p.recv_capacity[r];
      }
  }
  return AssertionSuccess();
}

/// Sum over the documents of a packed batch of their whole-document cost:
/// under the mask, or a document's slices.
inline I total_packed_cost(const cpdispatch::BalanceProblem& p) {
  I total = 0;
  for (const auto& doc : p.documents) {
    I len = 0;
    for (const auto& pc : doc.pieces) len += pc.len;
    total += doc.slices.empty() ? cpdispatch::attention_pairs(p.mask, 0, len, len)  // len (len + 1) / 2 when causal
                                : cpdispatch::slice_pairs(doc.slices, 0, len, 0, len);
  }
  return total;
}

/// A documents-form plan of a packed batch: every document in order, at most
/// C shards, each shard inside one piece and on its home, the shards tiling
/// every piece in order, its slices unchanged; attention cost conserved;
/// capacities respected.
inline AssertionResult valid_packed_plan(const cpdispatch::BalanceProblem& p, const cpdispatch::QkvDocumentsPlan& plan,
                                         bool check_cp_degree = true) {
  if (plan.world_size != p.world_size) return AssertionFailure() << "world size differs";
  if (check_cp_degree && plan.max_cp_degree != p.max_cp_degree) return AssertionFailure() << "max_cp_degree " << plan.max_cp_degree.value_or(-1);
  if (plan.documents.size() != p.documents.size()) return AssertionFailure() << plan.documents.size() << " documents, input " << p.documents.size();
  for (std::size_t i = 0; i < p.documents.size(); ++i) {
    const auto& shards = plan.documents[i].shards;
    if (shards.empty() || (check_cp_degree && static_cast<I>(shards.size()) > p.max_cp_degree)) {
      return AssertionFailure() << "documents[" << i << "] has " << shards.size() << " shards, C = " << p.max_cp_degree;
    }
    if (plan.documents[i].slices != p.documents[i].slices) return AssertionFailure() << "documents[" << i << "]: its slices changed";
    std::size_t k = 0;
    for (std::size_t j = 0; j < p.documents[i].pieces.size(); ++j) {
      const auto& pc = p.documents[i].pieces[j];
      I covered = 0;
      while (covered < pc.len) {
        if (k == shards.size()) return AssertionFailure() << "documents[" << i << "]: shards end inside piece " << j;
        const auto& s = shards[k++];
        if (s.rank != pc.rank) return AssertionFailure() << "documents[" << i << "].shards[" << k - 1 << "] is on rank " << s.rank << ", its piece on " << pc.rank;
        if (s.len < 1) return AssertionFailure() << "documents[" << i << "].shards[" << k - 1 << "] has " << s.len << " tokens";
        if (s.dst < 0 || s.dst >= p.world_size) return AssertionFailure() << "documents[" << i << "].shards[" << k - 1 << "].dst = " << s.dst;
        covered += s.len;
      }
      if (covered != pc.len) return AssertionFailure() << "documents[" << i << "]: a shard crosses the end of piece " << j;
    }
    if (k != shards.size()) return AssertionFailure() << "documents[" << i << "] has shards beyond its pieces";
  }
  try {
    const cpdispatch::QkvMetadata m = cpdispatch::plan_qkv(plan);
    m.q_fwd.validate("q_fwd");
    m.q_rev.validate("q_rev");
    m.kv_fwd.validate("kv_fwd");
    m.kv_rev.validate("kv_rev");
  } catch (const cpdispatch::error& e) {
    return AssertionFailure() << "plan_qkv/validate: " << e.what();
  }
  const cpdispatch::PlanCost cost = cpdispatch::plan_cost(plan, p.q_bytes, p.kv_bytes);
  if (cost.total_attention() != total_packed_cost(p)) {
    return AssertionFailure() << "attention cost " << cost.total_attention() << " differs from the documents' " << total_packed_cost(p);
  }
  for (std::size_t r = 0; r < p.recv_capacity.size(); ++r)
    if (cost.kv_tokens[r] > p.recv_capacity[r]) {
      return AssertionFailure() << "rank " << r << " holds " << cost.kv_tokens[r] << " KV tokens, capacity " << p.recv_capacity[r];
    }
  return AssertionSuccess();
}

/// Every cut the balancer made in `plan` (a boundary between two shards of a
/// document that is not a boundary between two of its pieces in `p`) lies on
/// a multiple of `grid` in the packed coordinate: rank 0's MLP tokens, then
/// rank 1's, ..., each rank's shards by (document, shard). Counted here from
/// the shards, not by the library's first_off_grid. A per-rank problem's
/// documents are whole: each is one piece (the plan lists rank 0's first).
inline AssertionResult cuts_on_grid(const cpdispatch::BalanceProblem& p, const cpdispatch::QkvDocumentsPlan& plan, I grid) {
  const auto W = static_cast<std::size_t>(plan.world_size);
  std::vector<I> at(W + 1, 0);
  for (const auto& doc : plan.documents)
    for (const auto& s : doc.shards) at[static_cast<std::size_t>(s.rank) + 1] += s.len;
  for (std::size_t r = 0; r < W; ++r) at[r + 1] += at[r];  // at[r]: where rank r's next shard starts
  std::size_t cuts = 0;
  for (std::size_t d = 0; d < plan.documents.size(); ++d) {
    std::vector<I> piece_ends;  // the input's own cuts
    I end = 0;
    if (!p.documents.empty())
      for (const auto& pc : p.documents[d].pieces) piece_ends.push_back(end += pc.len);
    const auto& shards = plan.documents[d].shards;
    I offset = 0;
    for (std::size_t k = 0; k < shards.size(); ++k) {
      I& packed = at[static_cast<std::size_t>(shards[k].rank)];
      packed += shards[k].len;
      offset += shards[k].len;
      if (k + 1 == shards.size() || std::find(piece_ends.begin(), piece_ends.end(), offset) != piece_ends.end()) continue;
      ++cuts;
      if (packed % grid != 0) {
        return AssertionFailure() << "documents[" << d << "] is cut after shards[" << k << "] at offset " << offset << ", packed position "
                                  << packed << ": not a multiple of the grid " << grid;
      }
    }
  }
  return AssertionSuccess() << cuts << " cuts on the grid";
}

/// Attention cost per rank and bytes per (source, destination), counted token
/// by token from the spec's rules, independently of plan_cost.
struct Count {
  std::vector<I> attention;
  std::vector<I> bytes;  // [src * W + dst]
};

inline Count count_by_token(const cpdispatch::QkvPlan& plan, I q_bytes, I kv_bytes) {
  const auto W = static_cast<std::size_t>(plan.world_size);
  Count c{std::vector<I>(W, 0), std::vector<I>(W * W, 0)};
  for (std::size_t r = 0; r < W; ++r) {
    for (const auto& doc : plan.ranks[r].docs) {
      std::vector<I> start{0};
      for (I len : doc.shard_len) start.push_back(start.back() + len);
      for (std::size_t i = 0; i < doc.shard_len.size(); ++i) {
        const auto d = static_cast<std::size_t>(doc.dst[i]);
        for (I t = start[i]; t < start[i + 1]; ++t)  // query token t sees keys 0..t
          for (I key = 0; key <= t; ++key) ++c.attention[d];
        if (d == r) continue;
        c.bytes[r * W + d] += q_bytes * doc.shard_len[i];
        for (std::size_t k = 0; k <= i; ++k) c.bytes[r * W + d] += kv_bytes * doc.shard_len[k];  // KV shard k's copy
      }
    }
  }
  return c;
}

/// The same for a documents-form plan: a KV token is sent to a query
/// shard's destination unless that is its own home rank.
inline Count count_by_token(const cpdispatch::QkvDocumentsPlan& plan, I q_bytes, I kv_bytes) {
  const auto W = static_cast<std::size_t>(plan.world_size);
  Count c{std::vector<I>(W, 0), std::vector<I>(W * W, 0)};
  for (const auto& doc : plan.documents) {
    std::vector<std::size_t> home_of;  // per token of the document
    for (const auto& s : doc.shards) home_of.insert(home_of.end(), static_cast<std::size_t>(s.len), static_cast<std::size_t>(s.rank));
    I start = 0;
    for (const auto& s : doc.shards) {
      const auto d = static_cast<std::size_t>(s.dst), home = static_cast<std::size_t>(s.rank);
      for (I t = start; t < start + s.len; ++t)
        for (I key = 0; key <= t; ++key) ++c.attention[d];
      if (d != home) c.bytes[home * W + d] += q_bytes * s.len;
      for (I key = 0; key < start + s.len; ++key)  // this shard's KV group: every token up to its end
        if (home_of[static_cast<std::size_t>(key)] != d) c.bytes[home_of[static_cast<std::size_t>(key)] * W + d] += kv_bytes;
      start += s.len;
    }
  }
  return c;
}

/// Forward and back through the memcpy simulation: queries and KV groups
/// arrive where the spec puts them, queries return unchanged, and each KV
/// shard's gradient is the sum of its copies.
inline AssertionResult round_trip(const cpdispatch::QkvPlan& plan) {
  using cpdispatch::simulate;
  const auto W = static_cast<std::size_t>(plan.world_size);
  const cpdispatch::QkvMetadata m = cpdispatch::plan_qkv(plan);
  struct Arrival {
    std::size_t src;
    I doc_start, start, len;
  };
  std::vector<std::vector<Arrival>> arrivals(W);
  std::vector<std::vector<double>> src(W);
  std::vector<std::vector<double>> copies(W);  // expected gradient multiplier per token
  for (std::size_t r = 0; r < W; ++r) {
    I pos = 0;
    for (const auto& doc : plan.ranks[r].docs) {
      const I doc_start = pos;
      for (std::size_t i = 0; i < doc.shard_len.size(); ++i) {
        arrivals[static_cast<std::size_t>(doc.dst[i])].push_back({r, doc_start, pos, doc.shard_len[i]});
        for (I t = 0; t < doc.shard_len[i]; ++t) {
          src[r].push_back(static_cast<double>(r) * 1048576.0 + static_cast<double>(pos + t));
          copies[r].push_back(static_cast<double>(doc.shard_len.size() - i));
        }
        pos += doc.shard_len[i];
      }
    }
  }
  auto segment = [](const std::vector<double>& v, I from, I n) {
    return std::vector<double>(v.begin() + from, v.begin() + from + n);
  };
  std::vector<std::vector<double>> attn_q, back, attn_kv, replica;
  simulate(m.q_fwd, src, attn_q, 1);
  simulate(m.kv_fwd, src, attn_kv, 1);
  for (std::size_t d = 0; d < W; ++d) {
    const auto& cq = m.attn.cu_seqlens_q[d];
    const auto& ckv = m.attn.cu_seqlens_kv[d];
    if (cq.size() != arrivals[d].size() + 1) return AssertionFailure() << "rank " << d << " receives " << cq.size() - 1 << " query shards";
    for (std::size_t a = 0; a < arrivals[d].size(); ++a) {
      const Arrival& x = arrivals[d][a];
      if (segment(attn_q[d], cq[a], cq[a + 1] - cq[a]) != segment(src[x.src], x.start, x.len)) {
        return AssertionFailure() << "rank " << d << ": query shard " << a << " differs";
      }
      if (segment(attn_kv[d], ckv[a], ckv[a + 1] - ckv[a]) != segment(src[x.src], x.doc_start, x.start + x.len - x.doc_start)) {
        return AssertionFailure() << "rank " << d << ": KV group " << a << " differs";
      }
    }
  }
  simulate(m.q_rev, attn_q, back, 1);
  if (back != src) return AssertionFailure() << "queries do not return unchanged";
  simulate(m.kv_rev, attn_kv, replica, 1);
  for (std::size_t r = 0; r < W; ++r) {
    std::vector<double> grad(src[r].size(), -1.0);
    cpdispatch::combine_copies<double>(m.kv_rev, static_cast<I>(r), std::span<const double>(replica[r]), std::span<double>(grad), 1);
    for (std::size_t t = 0; t < grad.size(); ++t)
      if (grad[t] != src[r][t] * copies[r][t]) {
        return AssertionFailure() << "rank " << r << " token " << t << ": combined " << grad[t] << ", expected " << src[r][t] << " x "
                                  << copies[r][t];
      }
  }
  return AssertionSuccess();
}

/// A small XML well-formedness check: one root element, every tag closed in
/// order, attribute values quoted, no stray '<' or '&' in text.
inline AssertionResult well_formed_xml(const std::string& s) {
  std::vector<std::string> open;
  std::size_t i = 0, roots = 0;
  auto name_at = [&](std::size_t& k) {
    const std::size_t from = k;
    while (k < s.size() && (std::isalnum(static_cast<unsigned char>(s[k])) || s[k] == '-' || s[k] == ':' || s[k] == '_')) ++k;
    return s.substr(from, k - from);
  };
  while (i < s.size()) {
    if (s[i] == '&') {
      const std::size_t semi = s.find(';', i);
      const std::string ent = semi == std::string::npos ? "" : s.substr(i, semi - i + 1);
      if (ent != "&amp;" && ent != "&lt;" && ent != "&gt;" && ent != "&quot;" && ent != "&apos;") {
        return AssertionFailure() << "bad entity at " << i;
      }
      i = semi + 1;
      continue;
    }
    if (s[i] != '<') {
      if (open.empty() && !std::isspace(static_cast<unsigned char>(s[i]))) return AssertionFailure() << "text outside the root at " << i;
      ++i;
      continue;
    }
    if (s.compare(i, 5, "<?xml") == 0) {
      if (i != 0) return AssertionFailure() << "XML declaration not at the start";
      i = s.find("?>", i);
      if (i == std::string::npos) return AssertionFailure() << "unterminated declaration";
      i += 2;
      continue;
    }
    if (s.compare(i, 2, "</") == 0) {
      std::size_t k = i + 2;
      const std::string name = name_at(k);
      if (open.empty() || open.back() != name) return AssertionFailure() << "</" << name << "> at " << i << " closes nothing open";
      if (k >= s.size() || s[k] != '>') return AssertionFailure() << "bad closing tag at " << i;
      open.pop_back();
      i = k + 1;
      continue;
    }
    std::size_t k = i + 1;
    const std::string name = name_at(k);
    if (name.empty()) return AssertionFailure() << "stray '<' at " << i;
    if (open.empty() && roots++ > 0) return AssertionFailure() << "a second root element <" << name << ">";
    for (;;) {  // attributes
      while (k < s.size() && std::isspace(static_cast<unsigned char>(s[k]))) ++k;
      if (k >= s.size()) return AssertionFailure() << "unterminated <" << name << ">";
      if (s[k] == '>' || s.compare(k, 2, "/>") == 0) break;
      const std::string attr = name_at(k);
      if (attr.empty() || k + 1 >= s.size() || s[k] != '=' || s[k + 1] != '"') return AssertionFailure() << "bad attribute in <" << name << "> at " << k;
      const std::size_t end = s.find('"', k + 2);
      if (end == std::string::npos) return AssertionFailure() << "unterminated attribute value at " << k;
      if (s.substr(k + 2, end - k - 2).find('<') != std::string::npos) return AssertionFailure() << "'<' in an attribute at " << k;
      k = end + 1;
    }
    if (s[k] == '>') {
      open.push_back(name);
      i = k + 1;
    } else {
      i = k + 2;
    }
  }
  if (!open.empty()) return AssertionFailure() << "<" << open.back() << "> is never closed";
  if (roots != 1) return AssertionFailure() << roots << " root elements";
  return AssertionSuccess();
}

}  // namespace baltest
