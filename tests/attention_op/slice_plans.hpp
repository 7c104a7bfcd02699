#pragma once
// Plans whose documents carry slices (docs/plan-format.md, section 2e) for
// the op's tests: the section's worked example, a document of inverse and
// bi-causal bands, and random plans with documents of every kind.

#include <cstdint>

#include "core/random_slices.hpp"
#include "cpdispatch/plan/mask.hpp"
#include "cpdispatch/plan/plan.hpp"

namespace attention_test {

/// Section 2e's worked example (W = 2): a shared-prefix document (a prompt
/// of 3 tokens, responses of 2 and 3, each seeing the prompt and itself) in
/// shards of 3, 2, 3, and a plain causal document of two 2-token shards.
inline cpdispatch::QkvDocumentsPlan shared_prefix_example(bool dedup = false) {
  using cpdispatch::SliceType;
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = 2;
  plan.dedup = dedup;
  plan.documents = {{{{0, 3, 1}, {0, 2, 0}, {1, 3, 1}},
                     {{0, 3, 0, 3, SliceType::causal}, {3, 5, 0, 3, SliceType::full}, {3, 5, 3, 5, SliceType::causal},
                      {5, 8, 0, 3, SliceType::full}, {5, 8, 5, 8, SliceType::causal}}},
                    {{{1, 2, 1}, {1, 2, 0}}}};
  return plan;
}

/// A document of 9 tokens in two shards (4 tokens at `first`, 5 at `second`:
/// {home, dst} each) under inverse and bi-causal slices: queries 0-3 see
/// every key from their own position on, queries 4-8 keys 3 to 4 behind
/// them among keys 0-5, and keys 6-8 whole.
inline cpdispatch::PackedDocument banded_document(const std::int64_t (&first)[2], const std::int64_t (&second)[2]) {
  using cpdispatch::SliceType;
  return {{{first[0], 4, first[1]}, {second[0], 5, second[1]}},
          {{0, 4, 0, 9, SliceType::inv_causal}, {4, 9, 0, 6, SliceType::bi_causal}, {4, 9, 6, 9, SliceType::full}}};
}

/// W ranks: one document of each kind (plain ones under `mask`, shared
/// prefix, block causal, prefix-LM, a random mix of the four slice types),
/// the banded document, and W / 2 documents of random kinds, each in 1 to 5
/// shards of 1 to 5 tokens.
inline cpdispatch::QkvDocumentsPlan random_slice_plan(int W, std::uint64_t seed, bool dedup,
                                                      const cpdispatch::AttentionMask& mask = cpdispatch::AttentionMask::causal()) {
  using cptest::SliceKind;
  cptest::SliceRng rng(seed);
  cpdispatch::QkvDocumentsPlan plan;
  plan.world_size = W;
  plan.mask = mask;
  plan.dedup = dedup;
  for (const SliceKind kind : {SliceKind::plain, SliceKind::shared_prefix, SliceKind::block_causal, SliceKind::prefix_lm, SliceKind::mix}) {
    plan.documents.push_back(cptest::random_slice_document(rng, W, kind, 5));
  }
  std::int64_t first[2], second[2];  // drawn one by one: the order of a call's arguments is unspecified
  for (std::int64_t* r : {&first[0], &first[1], &second[0], &second[1]}) *r = cptest::draw(rng, 0, W - 1);
  plan.documents.push_back(banded_document(first, second));
  for (int d = 0; d < W / 2; ++d) plan.documents.push_back(cptest::random_slice_document(rng, W, SliceKind::any, 5));
  return plan;
}

}  // namespace attention_test
