#pragma once
// Building the global plan collectively: every rank knows only its own
// documents (what its data loader packed into its MLP layout); one call
// gathers them over the transport so every rank holds the identical plan.
//
//   std::vector<cpdispatch::Document> mine = ...;              // this rank's documents, MLP-layout order
//   cpdispatch::QkvPlan plan = cpdispatch::gather_plan(transport, mine);
//
//   std::vector<cpdispatch::LocalShard> shards = ...;          // documents that span ranks
//   cpdispatch::QkvDocumentsPlan plan = cpdispatch::gather_documents_plan(transport, shards);
//
// Both are collectives (two all_gathers of int64): every rank calls them in
// the same order. Every rank validates the gathered whole, so a bad input on
// one rank makes every rank throw the same invalid_input, never a hang. The
// attention mask (causal unless given) travels with the words, so ranks that
// disagree on it all throw too.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "cpdispatch/element_type.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/plan.hpp"

namespace cpdispatch {

/// One shard of a document on this rank, for gather_documents_plan: `document`
/// is a key the ranks agree on (e.g. the sample's index in the global batch),
/// `index` the shard's position in that document's causal order.
struct LocalShard {
  std::int64_t document = 0;
  std::int64_t index = 0;
  std::int64_t len = 0;  ///< tokens, > 0
  std::int64_t dst = 0;  ///< attention rank
  friend bool operator==(const LocalShard&, const LocalShard&) = default;
};

namespace detail {

/// Every rank's int64 words, gathered: result[r] is rank r's `mine`.
template <class T>
std::vector<std::vector<std::int64_t>> all_gather_words(T& transport, const std::vector<std::int64_t>& mine) {
  const auto W = static_cast<std::size_t>(transport.world_size());
  std::int64_t count = static_cast<std::int64_t>(mine.size());
  std::vector<std::int64_t> counts(W, 0);
  transport.all_gather(&count, counts.data(), 1, ElementType::int64);
  std::int64_t widest = 0;
  for (std::size_t r = 0; r < W; ++r) {
    if (counts[r] < 0) fail("gather_plan: rank ", r, " announced ", counts[r], " words");
    widest = std::max(widest, counts[r]);
  }
  const auto width = static_cast<std::size_t>(widest);
  std::vector<std::int64_t> padded(mine);
  padded.resize(width, 0);
  std::vector<std::int64_t> all(W * width, 0);
  if (width > 0) transport.all_gather(padded.data(), all.data(), width, ElementType::int64);
  std::vector<std::vector<std::int64_t>> out(W);
  for (std::size_t r = 0; r < W; ++r) {
    const auto first = all.begin() + static_cast<std::ptrdiff_t>(r * width);
    out[r].assign(first, first + counts[r]);
  }
  return out;
}

/// A rank's documents as words: per document its shard count, then the
/// lengths, then the destinations.
inline std::vector<std::int64_t> document_words(std::span<const Document> docs) {
  std::vector<std::int64_t> words;
  for (std::size_t i = 0; i < docs.size(); ++i) {
    if (docs[i].dst.size() != docs[i].shard_len.size()) {
      fail("gather_plan: local document ", i, " has ", docs[i].shard_len.size(), " shard lengths but ", docs[i].dst.size(),
           " destinations");
    }
    words.push_back(static_cast<std::int64_t>(docs[i].shard_len.size()));
    words.insert(words.end(), docs[i].shard_len.begin(), docs[i].shard_len.end());
    words.insert(words.end(), docs[i].dst.begin(), docs[i].dst.end());
  }
  return words;
}

inline std::vector<Document> documents_of_words(const std::vector<std::int64_t>& words, std::size_t rank) {
  std::vector<Document> docs;
  std::size_t at = 0;
  while (at < words.size()) {
    const std::int64_t n = words[at++];
    if (n < 0 || static_cast<std::uint64_t>(n) > (words.size() - at) / 2) {
      fail("gather_plan: rank ", rank, " sent a malformed document list (document ", docs.size(), ")");
    }
    const auto un = static_cast<std::ptrdiff_t>(n);
    Document doc;
    const auto first = words.begin() + static_cast<std::ptrdiff_t>(at);
    doc.shard_len.assign(first, first + un);
    doc.dst.assign(first + un, first + 2 * un);
    at += 2 * static_cast<std::size_t>(n);
    docs.push_back(std::move(doc));
  }
  return docs;
}

/// The two words that lead every rank's list: its mask.
inline std::vector<std::int64_t> mask_words(const AttentionMask& mask) {
  return {static_cast<std::int64_t>(mask.type), mask.window};
}

/// The mask every rank sent (its first two words), the same on all of them;
/// removes those words.
inline AttentionMask agreed_mask(std::vector<std::vector<std::int64_t>>& gathered, const char* who) {
  AttentionMask mask;
  for (std::size_t r = 0; r < gathered.size(); ++r) {
    auto& w = gathered[r];
    if (w.size() < 2) fail(who, ": rank ", r, " sent no mask");
    AttentionMask m;
    m.type = static_cast<MaskType>(w[0]);
    m.window = w[1];
    if (r == 0) mask = m;
    if (!(m == mask)) fail(who, ": rank ", r, " plans with the ", to_string(m), " mask but rank 0 with the ", to_string(mask), " mask");
    w.erase(w.begin(), w.begin() + 2);
  }
  return mask;
}

/// Shards of documents that span ranks, checked: keys in (document, index)
/// order (the MLP layout's order) and every document's shards numbered
/// 0..n-1 exactly once across the ranks.
struct KeyedShard {
  LocalShard shard;
  std::int64_t rank = 0;
  std::size_t position = 0;  ///< index into that rank's local list
};

inline void check_local_order(std::span<const LocalShard> local) {
  for (std::size_t i = 1; i < local.size(); ++i) {
    const auto prev = std::pair(local[i - 1].document, local[i - 1].index);
    const auto here = std::pair(local[i].document, local[i].index);
    if (!(prev < here)) {
      fail("gather_documents_plan: local[", i, "] = (document ", here.first, ", shard ", here.second, ") does not come after (document ",
           prev.first, ", shard ", prev.second, "): list this rank's shards in (document, shard) order, as they lie in its MLP layout");
    }
  }
}

inline std::vector<PackedDocument> assemble_documents(std::vector<KeyedShard>& all) {
  std::stable_sort(all.begin(), all.end(), [](const KeyedShard& a, const KeyedShard& b) {
    return std::pair(a.shard.document, a.shard.index) < std::pair(b.shard.document, b.shard.index);
  });
  std::vector<PackedDocument> docs;
  for (std::size_t i = 0; i < all.size(); ++i) {
    const KeyedShard& k = all[i];
    const bool starts = i == 0 || all[i - 1].shard.document != k.shard.document;
    const std::int64_t expected = starts ? 0 : all[i - 1].shard.index + 1;
    if (!starts && k.shard.index == all[i - 1].shard.index) {
      fail("gather_documents_plan: document ", k.shard.document, " shard ", k.shard.index, " is given twice: by rank ", all[i - 1].rank,
           " (local[", all[i - 1].position, "]) and rank ", k.rank, " (local[", k.position, "])");
    }
    if (k.shard.index != expected) {
      fail("gather_documents_plan: document ", k.shard.document, " has no shard ", expected, " (shards are numbered 0..n-1); rank ",
           k.rank, "'s local[", k.position, "] is its shard ", k.shard.index);
    }
    if (starts) docs.emplace_back();
    docs.back().shards.push_back(DocumentShard{k.rank, k.shard.len, k.shard.dst});
  }
  return docs;
}

}  // namespace detail

/// The global per-rank plan from every rank's own documents (a collective).
template <class T>
QkvPlan gather_plan(T& transport, std::span<const Document> local, std::optional<std::int64_t> max_cp_degree = std::nullopt,
                    const AttentionMask& mask = AttentionMask::causal()) {
  std::vector<std::int64_t> words = detail::mask_words(mask);
  const std::vector<std::int64_t> docs = detail::document_words(local);
  words.insert(words.end(), docs.begin(), docs.end());
  auto gathered = detail::all_gather_words(transport, words);
  QkvPlan plan;
  plan.world_size = transport.world_size();
  plan.max_cp_degree = max_cp_degree;
  plan.mask = detail::agreed_mask(gathered, "gather_plan");
  for (std::size_t r = 0; r < gathered.size(); ++r) plan.ranks.push_back(RankDocuments{detail::documents_of_words(gathered[r], r)});
  return plan;
}

/// The global documents-form plan from every rank's own shards (a
/// collective). Documents are numbered in ascending order of their keys.
template <class T>
QkvDocumentsPlan gather_documents_plan(T& transport, std::span<const LocalShard> local,
                                       std::optional<std::int64_t> max_cp_degree = std::nullopt,
                                       const AttentionMask& mask = AttentionMask::causal()) {
  std::vector<std::int64_t> words = detail::mask_words(mask);
  words.reserve(2 + local.size() * 4);
  for (const LocalShard& s : local) words.insert(words.end(), {s.document, s.index, s.len, s.dst});
  auto gathered = detail::all_gather_words(transport, words);
  const AttentionMask agreed = detail::agreed_mask(gathered, "gather_documents_plan");
  // Every rank checks every rank's order, so all of them agree on the verdict.
  std::vector<detail::KeyedShard> all;
  for (std::size_t r = 0; r < gathered.size(); ++r) {
    const auto& w = gathered[r];
    std::vector<LocalShard> shards;
    for (std::size_t i = 0; i + 3 < w.size(); i += 4) shards.push_back(LocalShard{w[i], w[i + 1], w[i + 2], w[i + 3]});
    try {
      detail::check_local_order(shards);
    } catch (const invalid_input& e) {
      detail::fail("rank ", r, ": ", e.what());
    }
    for (std::size_t i = 0; i < shards.size(); ++i) all.push_back(detail::KeyedShard{shards[i], static_cast<std::int64_t>(r), i});
  }
  QkvDocumentsPlan plan;
  plan.world_size = transport.world_size();
  plan.max_cp_degree = max_cp_degree;
  plan.mask = agreed;
  plan.documents = detail::assemble_documents(all);
  return plan;
}

}  // namespace cpdispatch
