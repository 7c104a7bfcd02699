#pragma once
// Shared by the dispatcher and transport tests: plans, deterministic inputs,
// the global-simulation reference, and what travels between two ranks.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <numeric>
#include <span>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

#include "cpdispatch/cpdispatch.hpp"
#include "cpdispatch/execute/dispatcher.hpp"

namespace cptest {

using Bytes = std::vector<std::byte>;
using cpdispatch::Metadata;
using cpdispatch::RankMetadata;

/// Runs `f`, which must throw an E (or a subclass: the dispatcher nests the
/// original); returns the message.
template <class E, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw " << typeid(e).name() << " (\"" << e.what() << "\"), expected " << typeid(E).name();
    return std::string("(wrong exception type) ") + e.what();
  }
  ADD_FAILURE() << "no exception thrown";
  return "(no exception)";
}

/// n bytes that depend on `salt` (splitmix64).
inline Bytes pattern(std::size_t n, std::uint64_t salt) {
  Bytes out(n);
  std::uint64_t x = salt * 0x9E3779B97F4A7C15ull + 1;
  for (std::size_t i = 0; i < n; ++i) {
    if (i % 8 == 0) {
      x += 0x9E3779B97F4A7C15ull;
      std::uint64_t z = x;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      x ^= z ^ (z >> 31);
    }
    out[i] = static_cast<std::byte>(x >> (8 * (i % 8)));
  }
  return out;
}

/// n bytes holding small floats of type `type` (exact sums), depending on `salt`.
inline Bytes float_pattern(std::size_t n, std::uint64_t salt, cpdispatch::ElementType type) {
  using cpdispatch::ElementType;
  const std::size_t es = cpdispatch::element_size(type);
  Bytes out(n);
  for (std::size_t i = 0; i < n / es; ++i) {
    const float v = static_cast<float>(static_cast<int>((salt * 7 + i * 13) % 17) - 8) * 0.5f;
    std::byte* p = out.data() + i * es;
    switch (type) {
      case ElementType::float32: std::memcpy(p, &v, 4); break;
      case ElementType::float64: { const double d = v; std::memcpy(p, &d, 8); break; }
      case ElementType::bfloat16: { const cpdispatch::bfloat16 h(v); std::memcpy(p, &h, 2); break; }
      case ElementType::float16: { const cpdispatch::float16 h(v); std::memcpy(p, &h, 2); break; }
      case ElementType::int8:
      case ElementType::uint8:
      case ElementType::int32:
      case ElementType::int64: {
        const auto x = static_cast<std::int64_t>(v * 2.0f);  // small integers: the bytes of x, little-endian
        std::memcpy(p, &x, es);
        break;
      }
    }
  }
  return out;
}

/// A random QKV plan from the seed generator (C: the largest power of two <= min(W, 4)).
inline cpdispatch::QkvMetadata random_qkv(int W, std::uint64_t seed, std::int64_t total_len = 48, std::int64_t num_seqs = 3) {
  std::int64_t cp = 1;
  while (cp * 2 <= std::min(W, 4)) cp *= 2;
  return cpdispatch::plan_qkv(cpdispatch::create_qkv_dispatch(W, total_len, num_seqs, cp, seed));
}

/// A query plan with a 3-D dispatch (two copies per shard, the second sometimes absent).
inline cpdispatch::QueryMetadata random_query_copies(int W, std::uint64_t seed) {
  cpdispatch::Rng rng(seed);
  const auto seq_len = cpdispatch::gen_seq_lens(W, 3, 20, seed);
  cpdispatch::Tensor<std::int64_t> dispatch({static_cast<std::size_t>(W), 3, 2}, -1);
  for (std::size_t r = 0; r < static_cast<std::size_t>(W); ++r)
    for (std::size_t j = 0; j < 3; ++j) {
      dispatch(r, j, 0) = rng.between(0, W - 1);
      if (rng.below(3) != 0) dispatch(r, j, 1) = rng.between(0, W - 1);
    }
  return cpdispatch::plan_query(seq_len, dispatch);
}

/// The same exchange with each receiver taking its entries in a shuffled
/// order, so one source's pieces are no longer contiguous at the receiver:
/// exercises the staged receive (forward) and staged send (reverse).
inline std::pair<Metadata, Metadata> shuffle_arrivals(const Metadata& fwd, const Metadata& rev, std::uint64_t seed) {
  Metadata f = fwd, r = rev;
  const auto W = static_cast<std::size_t>(fwd.world_size);
  const std::size_t S = fwd.max_seqs(), C = fwd.num_copies();
  // (source, replica position) -> (j, k) of the forward copy.
  std::vector<std::int64_t> total(W, 0);
  std::vector<std::map<std::int64_t, std::pair<std::size_t, std::size_t>>> copy_at(W);
  for (std::size_t s = 0; s < W; ++s) total[s] = fwd.send_tokens(static_cast<std::int64_t>(s));
  for (std::size_t s = 0; s < W; ++s) {
    std::int64_t p = 0;
    for (std::size_t j = 0; j < S; ++j) {
      for (std::size_t k = 0; k < C; ++k) {
        const std::int64_t d = fwd.has_copies() ? fwd.dst_rank(s, j, k) : fwd.dst_rank(s, j);
        if (d >= 0) copy_at[s][static_cast<std::int64_t>(k) * (fwd.has_copies() ? total[s] : 0) + p] = {j, k};
      }
      p += fwd.seq_len(s, j);
    }
  }
  cpdispatch::Rng rng(seed);
  for (std::size_t d = 0; d < W; ++d) {
    const auto M = static_cast<std::size_t>(rev.num_seqs(d));
    std::vector<std::size_t> order(M);
    std::iota(order.begin(), order.end(), 0);
    for (std::size_t i = M; i > 1; --i) std::swap(order[i - 1], order[rng.below(i)]);
    std::int64_t at = 0;
    for (std::size_t i = 0; i < M; ++i) {
      const std::size_t m = order[i];
      r.dst_rank(d, i) = rev.dst_rank(d, m);
      r.seq_len(d, i) = rev.seq_len(d, m);
      r.dst_offset(d, i) = rev.dst_offset(d, m);
      const auto src = static_cast<std::size_t>(rev.dst_rank(d, m));
      const auto [j, k] = copy_at[src].at(rev.dst_offset(d, m));
      if (f.has_copies()) f.dst_offset(src, j, k) = at; else f.dst_offset(src, j) = at;
      at += rev.seq_len(d, m);
    }
  }
  f.validate("shuffled fwd");
  r.validate("shuffled rev");
  return {std::move(f), std::move(r)};
}

struct PairCase {
  std::string name;
  Metadata fwd, rev;
  bool kv = false;  // reverse metadata with copies (combine applies)
};

/// The forward/reverse pairs the dispatcher tests run on, for world size W.
inline std::vector<PairCase> pair_cases(int W, std::uint64_t seed) {
  std::vector<PairCase> cases;
  auto qkv = random_qkv(W, seed);
  auto query = random_query_copies(W, seed);
  auto [qf, qr] = shuffle_arrivals(qkv.q_fwd, qkv.q_rev, seed + 100);
  auto [kf, kr] = shuffle_arrivals(qkv.kv_fwd, qkv.kv_rev, seed + 200);
  cases.push_back({"q", qkv.q_fwd, qkv.q_rev, false});
  cases.push_back({"kv", qkv.kv_fwd, qkv.kv_rev, true});
  cases.push_back({"query_copies", query.fwd, query.rev, true});
  cases.push_back({"q_shuffled", std::move(qf), std::move(qr), false});
  cases.push_back({"kv_shuffled", std::move(kf), std::move(kr), true});
  return cases;
}

/// The global simulation of `meta` over per-rank inputs; outputs start as `fill`.
inline std::vector<Bytes> simulate_bytes(const Metadata& meta, const std::vector<Bytes>& inputs, std::size_t token_bytes,
                                         std::byte fill = std::byte{0xA5}) {
  const auto W = static_cast<std::size_t>(meta.world_size);
  std::vector<Bytes> outputs(W);
  std::vector<cpdispatch::ConstBytes> in;
  std::vector<cpdispatch::MutableBytes> out;
  for (std::size_t r = 0; r < W; ++r) {
    outputs[r].assign(static_cast<std::size_t>(meta.output_tokens(static_cast<std::int64_t>(r))) * token_bytes, fill);
    in.emplace_back(inputs[r]);
    out.emplace_back(outputs[r]);
  }
  cpdispatch::simulate(meta, std::span<const cpdispatch::ConstBytes>(in), std::span<const cpdispatch::MutableBytes>(out), token_bytes);
  return outputs;
}

/// Per-rank inputs of `tokens(r) * token_bytes` bytes.
template <class Tokens>
std::vector<Bytes> inputs_for(int W, std::size_t token_bytes, std::uint64_t salt, Tokens tokens) {
  std::vector<Bytes> in;
  for (int r = 0; r < W; ++r) in.push_back(pattern(static_cast<std::size_t>(tokens(r)) * token_bytes, salt * 1000 + static_cast<std::uint64_t>(r)));
  return in;
}

/// The bytes of `owner`'s reverse entries that go to / came from `peer`, in
/// entry order, read from `buf` (owner's attention layout, where entries lie
/// back to back). Forward: what `peer` sends `owner` (buf = owner's expected
/// forward output). Reverse: what `owner` sends `peer` (buf = owner's attention input).
inline Bytes entries_bytes(const Metadata& rev, int owner, int peer, const Bytes& buf, std::size_t token_bytes) {
  const RankMetadata s = rev.get_slice(owner);
  Bytes out;
  std::size_t pos = 0;
  for (std::size_t m = 0; m < s.seq_len.size(); ++m) {
    const auto len = static_cast<std::size_t>(s.seq_len[m]) * token_bytes;
    if (s.dst_rank[m] == peer) out.insert(out.end(), buf.begin() + static_cast<std::ptrdiff_t>(pos), buf.begin() + static_cast<std::ptrdiff_t>(pos + len));
    pos += len;
  }
  return out;
}

/// Byte counts of rank r's forward exchange: what it sends to / receives from each peer (self: 0).
inline std::vector<std::size_t> forward_send_counts(const Metadata& fwd, int r, std::size_t token_bytes) {
  std::vector<std::size_t> c;
  for (int d = 0; d < fwd.world_size; ++d) {
    c.push_back(d == r ? 0 : static_cast<std::size_t>(fwd.num_recv_tokens(static_cast<std::size_t>(d), static_cast<std::size_t>(r))) * token_bytes);
  }
  return c;
}
inline std::vector<std::size_t> forward_recv_counts(const Metadata& fwd, int r, std::size_t token_bytes) {
  std::vector<std::size_t> c;
  for (int s = 0; s < fwd.world_size; ++s) {
    c.push_back(s == r ? 0 : static_cast<std::size_t>(fwd.num_recv_tokens(static_cast<std::size_t>(r), static_cast<std::size_t>(s))) * token_bytes);
  }
  return c;
}

}  // namespace cptest
