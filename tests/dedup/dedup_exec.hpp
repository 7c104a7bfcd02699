#pragma once
// The dedup-vs-section-2 comparison every transport test runs: the same plan
// through Dispatcher(kv_fwd, kv_rev) and KvWireDispatcher on one rank.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpdispatch/execute/kv_wire.hpp"
#include "cpdispatch/execute/dispatcher.hpp"
#include "../common/max_error.hpp"
#include "dedup_cases.hpp"

namespace dedup_test {

using cpdispatch::ElementType;
using cpdispatch::KvWireDispatcher;
using Bytes = std::vector<std::byte>;

struct Case {
  std::string name;
  cpdispatch::QkvMetadata meta;
  cpdispatch::KvWireMetadata wire;
};

std::vector<Case> cases_for(int W) {
  std::vector<Case> out;
  auto add = [&](std::string name, const auto& plan) {
    auto meta = cpdispatch::plan_qkv(plan);
    auto wire = cpdispatch::plan_kv_wire(meta);
    out.push_back({std::move(name), std::move(meta), std::move(wire)});
  };
  add("zigzag", dedup_test::zigzag_plan(W, 2, 6 * W));
  cpdispatch::Rng rng(static_cast<std::uint64_t>(W) * 31 + 5);
  for (int i = 0; i < 6; ++i) add("random " + std::to_string(i), dedup_test::random_plan(rng, W, i % 2 == 0));
  add("zigzag across ranks", dedup_test::zigzag_documents_plan(W, 3));
  for (int i = 0; i < 4; ++i) add("random across ranks " + std::to_string(i), dedup_test::random_documents_plan(rng, W, i % 2 == 0));
  return out;
}

/// Per-rank element values: integers use the full range (sums wrap), floats
/// lie in [-1, 1], or are small integers when `exact` (every sum representable).
template <class E>
std::vector<E> values(std::size_t n, std::uint64_t seed, bool exact) {
  cpdispatch::Rng rng(seed);
  std::vector<E> v(n);
  for (E& x : v) {
    if constexpr (std::is_integral_v<E>) {
      x = static_cast<E>(rng.next());
    } else if (exact) {
      x = E(static_cast<float>(rng.between(-4, 4)));
    } else {
      x = E(static_cast<float>(rng.between(-1000000, 1000000)) / 1e6f);
    }
  }
  return v;
}

template <class E>
Bytes bytes_of(const std::vector<E>& v) {
  Bytes b(v.size() * sizeof(E));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

template <class E>
std::vector<E> elements_of(const Bytes& b) {
  std::vector<E> v(b.size() / sizeof(E));
  if (!b.empty()) std::memcpy(v.data(), b.data(), b.size());
  return v;
}

struct RankResult {
  Bytes attention_ref, attention, grad_ref, grad, grad_again, grad_in_place;
};

/// Both exchanges on one rank (the section 2 Dispatcher and KvWireDispatcher,
/// the latter moved once after construction); element type E, 3 per token.
/// Every rank of the world calls it.
template <class E, class Transport>
RankResult run_rank(Transport& t, const Case& c, bool exact) {
  const std::size_t tb = 3 * sizeof(E);
  const ElementType type = cpdispatch::element_type_of<E>();
  const auto r = static_cast<std::size_t>(t.rank());
  cpdispatch::Dispatcher<Transport> kv(t, c.meta.kv_fwd, c.meta.kv_rev, tb);
  KvWireDispatcher<Transport> dd_made(t, c.wire, tb);
  KvWireDispatcher<Transport> dd(std::move(dd_made));  // runs after a move: what its data path registered moves with it
  const auto& s = dd.required_bytes();
  EXPECT_EQ(s.mlp_bytes, kv.required_bytes().mlp_bytes);
  EXPECT_EQ(s.attention_bytes, kv.required_bytes().attention_bytes);
  EXPECT_EQ(s.replica_bytes, kv.required_bytes().replica_bytes);
  const Bytes mlp = bytes_of(values<E>(s.mlp_bytes / sizeof(E), 100 + r, exact));
  const Bytes dattn = bytes_of(values<E>(s.attention_bytes / sizeof(E), 200 + r, exact));
  RankResult out;
  out.attention_ref.assign(s.attention_bytes, std::byte{0x5A});
  out.attention.assign(s.attention_bytes, std::byte{0xA5});
  Bytes wire(s.wire_bytes), replica(s.replica_bytes), replica_ref(s.replica_bytes);
  out.grad_ref.assign(s.mlp_bytes, std::byte{});
  out.grad.assign(s.mlp_bytes, std::byte{});
  out.grad_again.assign(s.mlp_bytes, std::byte{});
  kv.forward(mlp, out.attention_ref);
  dd.forward(mlp, out.attention);
  kv.reverse_combine(dattn, replica_ref, out.grad_ref, type);
  dd.reverse_combine(dattn, wire, replica, out.grad, type);
  std::fill(replica.begin(), replica.end(), std::byte{0x11});
  dd.reverse_combine(dattn, wire, replica, out.grad_again, type);
  Bytes consumed = dattn;
  out.grad_in_place.assign(s.mlp_bytes, std::byte{});
  std::fill(replica.begin(), replica.end(), std::byte{0x22});
  dd.reverse_combine_in_place(consumed, replica, out.grad_in_place, type);
  return out;
}

/// The largest |a - b| of two gradients of element type E; integers must be
/// equal (0). Infinite on a NaN or a size mismatch (common/max_error.hpp).
template <class E>
double largest_difference(const Bytes& a_bytes, const Bytes& b_bytes, std::size_t r) {
  const auto a = elements_of<E>(a_bytes), b = elements_of<E>(b_bytes);
  if constexpr (std::is_integral_v<E>) {
    EXPECT_EQ(a.size(), b.size()) << "rank " << r;
    for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) EXPECT_EQ(a[i], b[i]) << "rank " << r << " element " << i;
    return 0;
  } else {
    SCOPED_TRACE("rank " + std::to_string(r));
    return cpdispatch::testing::max_error(a, b).diff;
  }
}

/// Checks the forward bytes and the run-to-run identity of rank r's result;
/// returns the largest |dedup - section 2| of its gradient (integers: must be 0).
template <class E>
double check_rank(std::size_t r, const RankResult& res) {
  EXPECT_EQ(res.attention, res.attention_ref) << "forward attention layout of rank " << r;
  EXPECT_EQ(res.grad, res.grad_again) << "the gradient of rank " << r << " changed between runs";
  EXPECT_EQ(res.grad, res.grad_in_place) << "reverse_combine_in_place differs from reverse_combine on rank " << r;
  return largest_difference<E>(res.grad, res.grad_ref, r);
}

}  // namespace dedup_test
