#pragma once
// Random documents with slices (docs/plan-format.md, section 2e) for the
// tests: shared prefix with responses, block causal, prefix-LM, and random
// mixes of the four slice types (inverse and bi-causal bands among them),
// each document cut into random shards packed over consecutive ranks.

#include <cstdint>
#include <random>
#include <vector>

#include "cpdispatch/plan/plan.hpp"

namespace cptest {

using I = std::int64_t;
using SliceRng = std::mt19937_64;

inline I draw(SliceRng& rng, I lo, I hi) { return std::uniform_int_distribution<I>(lo, hi)(rng); }

/// Whether slice s lets query p see key t: section 2e's table, written out here.
inline bool slice_sees(const cpdispatch::AttentionSlice& s, I p, I t) {
  using cpdispatch::SliceType;
  if (p < s.q_begin || p >= s.q_end || t < s.k_begin || t >= s.k_end) return false;
  switch (s.type) {
    case SliceType::full: return true;
    case SliceType::causal: return t - p <= s.k_end - s.q_end;
    case SliceType::inv_causal: return t - p >= s.k_begin - s.q_begin;
    case SliceType::bi_causal: return t - p >= s.k_begin - s.q_begin && t - p <= s.k_end - s.q_end;
  }
  return false;
}

inline I length_of(const cpdispatch::PackedDocument& doc) {
  I total = 0;
  for (const auto& s : doc.shards) total += s.len;
  return total;
}

/// [0, L) cut at random into runs of at least one position: their starts, then L.
inline std::vector<I> random_cuts(SliceRng& rng, I L) {
  std::vector<I> cuts{0};
  for (I p = 1; p < L; ++p) {
    if (draw(rng, 0, 2) == 0) cuts.push_back(p);
  }
  cuts.push_back(L);
  return cuts;
}

/// A prompt, then responses that each see the prompt and themselves.
inline std::vector<cpdispatch::AttentionSlice> shared_prefix(SliceRng& rng, I L) {
  using cpdispatch::SliceType;
  if (L == 1) return {{0, 1, 0, 1, SliceType::causal}};
  const I prompt = draw(rng, 1, L - 1);
  std::vector<cpdispatch::AttentionSlice> out{{0, prompt, 0, prompt, SliceType::causal}};
  const std::vector<I> cuts = random_cuts(rng, L - prompt);
  for (std::size_t r = 0; r + 1 < cuts.size(); ++r) {
    const I a = prompt + cuts[r], b = prompt + cuts[r + 1];
    out.push_back({a, b, 0, prompt, SliceType::full});
    out.push_back({a, b, a, b, SliceType::causal});
  }
  return out;
}

/// Frames that see every earlier frame and themselves whole.
inline std::vector<cpdispatch::AttentionSlice> block_causal(SliceRng& rng, I L) {
  std::vector<cpdispatch::AttentionSlice> out;
  const std::vector<I> cuts = random_cuts(rng, L);
  for (std::size_t f = 0; f + 1 < cuts.size(); ++f) out.push_back({cuts[f], cuts[f + 1], 0, cuts[f + 1], cpdispatch::SliceType::full});
  return out;
}

/// A bidirectional prefix, then causal text that sees the prefix.
inline std::vector<cpdispatch::AttentionSlice> prefix_lm(SliceRng& rng, I L) {
  using cpdispatch::SliceType;
  const I prefix = draw(rng, 1, L);
  std::vector<cpdispatch::AttentionSlice> out{{0, prefix, 0, prefix, SliceType::full}};
  if (prefix == L) return out;
  out.push_back({prefix, L, 0, prefix, SliceType::full});
  out.push_back({prefix, L, prefix, L, SliceType::causal});
  return out;
}

inline cpdispatch::AttentionSlice random_slice(SliceRng& rng, I L) {
  const I qa = draw(rng, 0, L - 1), qb = draw(rng, qa + 1, L), ka = draw(rng, 0, L - 1), kb = draw(rng, ka + 1, L);
  return {qa, qb, ka, kb, static_cast<cpdispatch::SliceType>(draw(rng, 0, 3))};
}

/// Calls f(p, t) for every pair (query p, key t) slice s allows in a document of length L.
template <class F>
void for_each_pair(const cpdispatch::AttentionSlice& s, I L, F&& f) {
  for (I p = 0; p < L; ++p)
    for (I t = 0; t < L; ++t)
      if (slice_sees(s, p, t)) f(p, t);
}

/// Random slices of all four types, each kept only when it has a pair and
/// shares none with those kept before (checked on a grid of every pair).
inline std::vector<cpdispatch::AttentionSlice> random_mix(SliceRng& rng, I L) {
  std::vector<cpdispatch::AttentionSlice> out;
  std::vector<char> taken(static_cast<std::size_t>(L * L), 0);
  const auto at = [L](I p, I t) { return static_cast<std::size_t>(p * L + t); };
  const I tries = draw(rng, 1, 8);
  for (I n = 0; n < tries; ++n) {
    const cpdispatch::AttentionSlice s = random_slice(rng, L);
    bool any = false, clash = false;
    for_each_pair(s, L, [&](I p, I t) {
      any = true;
      clash = clash || taken[at(p, t)];
    });
    if (!any || clash) continue;
    for_each_pair(s, L, [&](I p, I t) { taken[at(p, t)] = 1; });
    out.push_back(s);
  }
  if (out.empty()) out.push_back({0, 1, 0, 1, cpdispatch::SliceType::full});
  return out;
}

/// The kinds of document: plain (the plan's mask holds), slices of one
/// kind, or any (one of the others, drawn).
enum class SliceKind { plain, shared_prefix, block_causal, prefix_lm, mix, any };

inline std::vector<cpdispatch::AttentionSlice> random_slices(SliceRng& rng, I L, SliceKind kind) {
  switch (kind) {
    case SliceKind::shared_prefix: return shared_prefix(rng, L);
    case SliceKind::block_causal: return block_causal(rng, L);
    case SliceKind::prefix_lm: return prefix_lm(rng, L);
    case SliceKind::mix: return random_mix(rng, L);
    case SliceKind::plain:
    case SliceKind::any: break;
  }
  return {};
}

/// A document in 1 to 5 shards of 1 to max_len tokens over W ranks: homes
/// packed over consecutive ranks, destinations anywhere; no slices yet.
inline cpdispatch::PackedDocument random_shards(SliceRng& rng, I W, I max_len = 8) {
  cpdispatch::PackedDocument doc;
  I home = draw(rng, 0, W - 1), dst = draw(rng, 0, W - 1);
  const I shards = draw(rng, 1, 5);
  for (I k = 0; k < shards; ++k) {
    if (k > 0 && draw(rng, 0, 2) == 0) home = (home + 1) % W;  // packed across ranks
    if (draw(rng, 0, 1) == 0) dst = draw(rng, 0, W - 1);
    doc.shards.push_back({home, draw(rng, 1, max_len), dst});
  }
  return doc;
}

/// A document of the given kind in random shards (the kind drawn after the shards where it is any).
inline cpdispatch::PackedDocument random_slice_document(SliceRng& rng, I W, SliceKind kind = SliceKind::any, I max_len = 8) {
  cpdispatch::PackedDocument doc = random_shards(rng, W, max_len);
  if (kind == SliceKind::any) kind = static_cast<SliceKind>(draw(rng, 0, static_cast<I>(SliceKind::mix)));
  doc.slices = random_slices(rng, length_of(doc), kind);
  return doc;
}

}  // namespace cptest
