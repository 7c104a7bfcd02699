#pragma once
// Field-by-field equality of two RankMetadata slices, naming the first field
// that differs (shared by the per-rank planning and dedup suites).

#include <gtest/gtest.h>

#include <string>

#include "cpdispatch/plan/metadata.hpp"

namespace cptest {

inline ::testing::AssertionResult same_slice(const cpdispatch::RankMetadata& got, const cpdispatch::RankMetadata& want,
                                             const std::string& name) {
  auto differs = [&](const char* field) { return ::testing::AssertionFailure() << name << "." << field << " differs"; };
  if (got.rank != want.rank || got.world_size != want.world_size) return differs("rank/world_size");
  if (got.has_copies != want.has_copies || got.num_copies != want.num_copies) return differs("copies");
  if (got.dst_rank != want.dst_rank) return differs("dst_rank");
  if (got.dst_offset != want.dst_offset) return differs("dst_offset");
  if (got.seq_len != want.seq_len) return differs("seq_len");
  if (got.num_recv_tokens != want.num_recv_tokens) return differs("num_recv_tokens");
  if (got.num_seqs != want.num_seqs || got.num_total_recv_tokens != want.num_total_recv_tokens) return differs("num_seqs/total");
  if (got.seq_recv_mask != want.seq_recv_mask || got.mask_copies != want.mask_copies) return differs("seq_recv_mask");
  if (got.recv_seq_lens != want.recv_seq_lens) return differs("recv_seq_lens");
  return ::testing::AssertionSuccess();
}

}  // namespace cptest
