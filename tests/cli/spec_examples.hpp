#pragma once
// The worked examples of docs/plan-format.md (sections 2b and 4) as plan
// JSON, and every number the format gives for them, checked on the metadata JSON (what
// to_json writes and what cpdispatch-plan prints). data/spec_*.json hold the
// same plans for the CLI tests.

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace cli_test {

inline constexpr const char* spec_qkv_plan = R"({"world_size": 2, "max_cp_degree": 3, "ranks": [
  {"docs": [{"shard_len": [4, 2], "dst": [1, 0]}, {"shard_len": [3], "dst": [0]}]},
  {"docs": [{"shard_len": [5, 1, 2], "dst": [0, 1, 0]}]}]})";

inline constexpr const char* spec_query_plan = R"({"kind": "query", "world_size": 3,
  "seq_len": [[5, 3, 4], [2, 6, 1], [8, 2, 5]], "dispatch": [[0, 0, 1], [2, 2, 2], [1, 1, 0]]})";

// Section 2b: document 0 spans ranks 0 and 1.
inline constexpr const char* spec_documents_plan = R"({"kind": "qkv", "world_size": 2, "max_cp_degree": 3, "documents": [
  {"shards": [{"rank": 0, "len": 3, "dst": 1}, {"rank": 1, "len": 2, "dst": 0}, {"rank": 1, "len": 4, "dst": 1}]},
  {"shards": [{"rank": 0, "len": 5, "dst": 0}]},
  {"shards": [{"rank": 1, "len": 1, "dst": 1}]}]})";

using Expected = std::vector<std::pair<const char*, const char*>>;  // JSON pointer, value

// Section 4 verbatim, then what sections 1-3 fix for the fields section 4
// leaves out (inputs echoed, absent fields null, attention prefix sums).
inline const Expected spec_qkv_numbers = {
    {"/q_fwd/dst_rank", "[[1,0,0],[0,1,0]]"},
    {"/q_fwd/dst_offset", "[[0,0,2],[5,4,10]]"},
    {"/q_fwd/seq_len", "[[4,2,3],[5,1,2]]"},
    {"/q_fwd/num_recv_tokens", "[[5,7,12],[4,1,5]]"},
    {"/q_fwd/num_seqs", "[3,3]"},
    {"/q_rev/dst_rank", "[[0,0,1,1],[0,1,-1,-1]]"},
    {"/q_rev/dst_offset", "[[4,6,0,6],[0,5,0,0]]"},
    {"/q_rev/seq_len", "[[2,3,5,2],[4,1,0,0]]"},
    {"/q_rev/num_recv_tokens", "[[5,4,9],[7,1,8]]"},
    {"/q_rev/num_seqs", "[4,2]"},
    {"/kv_fwd/dst_rank", "[[[1,0,-1],[0,-1,-1],[0,-1,-1]],[[0,1,0],[1,0,-1],[0,-1,-1]]]"},
    {"/kv_fwd/dst_offset", "[[[0,0,0],[4,0,0],[6,0,0]],[[9,4,14],[9,19,0],[20,0,0]]]"},
    {"/kv_fwd/num_recv_tokens", "[[9,13,22],[4,6,10]]"},
    {"/kv_fwd/num_seqs", "[3,3]"},
    {"/kv_rev/dst_rank", "[[0,0,0,1,1,1,1],[0,1,1,-1,-1,-1,-1]]"},
    {"/kv_rev/dst_offset", "[[9,4,6,0,16,13,6],[0,8,5,0,0,0,0]]"},
    {"/kv_rev/seq_len", "[[4,2,3,5,5,1,2],[4,5,1,0,0,0,0]]"},
    {"/kv_rev/num_recv_tokens", "[[9,4,13],[13,6,19]]"},
    {"/kv_rev/num_seqs", "[7,3]"},
    {"/kv_rev/seq_recv_mask", "[[[1,1,0],[1,0,0],[1,0,0]],[[1,1,1],[1,1,0],[1,0,0]]]"},
    {"/kv_rev/recv_seq_lens", "[[4,2,3],[5,1,2]]"},
    {"/attn/seqlens_q", "[[2,3,5,2],[4,1]]"},
    {"/attn/seqlens_kv", "[[6,3,5,8],[4,6]]"},
    // implied by sections 1-3
    {"/kv_fwd/seq_len", "[[4,2,3],[5,1,2]]"},
    {"/q_fwd/seq_recv_mask", "null"},
    {"/q_fwd/recv_seq_lens", "null"},
    {"/q_rev/seq_recv_mask", "null"},
    {"/q_rev/recv_seq_lens", "null"},
    {"/kv_fwd/seq_recv_mask", "null"},
    {"/kv_fwd/recv_seq_lens", "null"},
    {"/attn/cu_seqlens_q", "[[0,2,5,10,12],[0,4,5]]"},
    {"/attn/cu_seqlens_kv", "[[0,6,9,14,22],[0,4,10]]"},
    {"/attn/max_seqlen_q", "[5,4]"},
    {"/attn/max_seqlen_kv", "[8,6]"},
};

// Section 2b verbatim, then what the format fixes for the other fields.
inline const Expected spec_documents_numbers = {
    {"/q_fwd/dst_rank", "[[1,0,-1],[0,1,1]]"},
    {"/q_fwd/dst_offset", "[[0,0,0],[5,3,7]]"},
    {"/q_fwd/seq_len", "[[3,5,0],[2,4,1]]"},
    {"/q_fwd/num_recv_tokens", "[[5,2,7],[3,5,8]]"},
    {"/q_fwd/num_seqs", "[2,3]"},
    {"/q_rev/dst_rank", "[[0,1,-1],[0,1,1]]"},
    {"/q_rev/dst_offset", "[[3,0,0],[0,2,6]]"},
    {"/q_rev/seq_len", "[[5,2,0],[3,4,1]]"},
    {"/q_rev/num_recv_tokens", "[[5,3,8],[2,5,7]]"},
    {"/q_rev/num_seqs", "[2,3]"},
    {"/kv_fwd/dst_rank", "[[[1,0,1],[0,-1,-1],[-1,-1,-1]],[[0,1,-1],[1,-1,-1],[1,-1,-1]]]"},
    {"/kv_fwd/dst_offset", "[[[0,5,3],[0,0,0],[0,0,0]],[[8,6,0],[8,0,0],[12,0,0]]]"},
    {"/kv_fwd/num_recv_tokens", "[[8,2,10],[6,7,13]]"},
    {"/kv_fwd/num_seqs", "[2,3]"},
    {"/kv_rev/dst_rank", "[[0,0,1,-1,-1],[0,0,1,1,1]]"},
    {"/kv_rev/dst_offset", "[[3,8,0,0,0],[0,16,7,2,6]]"},
    {"/kv_rev/seq_len", "[[5,3,2,0,0],[3,3,2,4,1]]"},
    {"/kv_rev/num_recv_tokens", "[[8,6,14],[2,7,9]]"},
    {"/kv_rev/num_seqs", "[3,5]"},
    {"/kv_rev/seq_recv_mask", "[[[1,1,1],[1,0,0],[0,0,0]],[[1,1,0],[1,0,0],[1,0,0]]]"},
    {"/attn/seqlens_q", "[[5,2],[3,4,1]]"},
    {"/attn/seqlens_kv", "[[5,5],[3,9,1]]"},
    // implied by sections 1-2b
    {"/kv_fwd/seq_len", "[[3,5,0],[2,4,1]]"},
    {"/kv_rev/recv_seq_lens", "[[3,5,0],[2,4,1]]"},
    {"/q_fwd/seq_recv_mask", "null"},
    {"/kv_fwd/seq_recv_mask", "null"},
    {"/attn/cu_seqlens_q", "[[0,5,7],[0,3,7,8]]"},
    {"/attn/cu_seqlens_kv", "[[0,5,10],[0,3,12,13]]"},
    {"/attn/max_seqlen_q", "[5,4]"},
    {"/attn/max_seqlen_kv", "[5,9]"},
};

inline const Expected spec_query_numbers = {
    {"/fwd/dst_offset", "[[0,5,0],[0,2,8],[4,12,8]]"},
    {"/fwd/num_recv_tokens", "[[8,0,5,13],[4,0,10,14],[0,9,0,9]]"},
    {"/fwd/num_seqs", "[3,3,3]"},
    {"/rev/dst_rank", "[[0,0,2],[0,2,2],[1,1,1]]"},
    {"/rev/dst_offset", "[[0,5,10],[8,0,8],[0,2,8]]"},
    {"/rev/seq_len", "[[5,3,5],[4,8,2],[2,6,1]]"},
    {"/rev/num_recv_tokens", "[[8,4,0,12],[0,0,9,9],[5,10,0,15]]"},
    // implied by section 1 (2-D dispatch)
    {"/fwd/dst_rank", "[[0,0,1],[2,2,2],[1,1,0]]"},
    {"/fwd/seq_len", "[[5,3,4],[2,6,1],[8,2,5]]"},
    {"/rev/num_seqs", "[3,3,3]"},
    {"/fwd/seq_recv_mask", "null"},
    {"/fwd/recv_seq_lens", "null"},
    {"/rev/seq_recv_mask", "null"},
    {"/rev/recv_seq_lens", "null"},
};

/// Every expected value, each failure naming its JSON pointer.
inline void expect_numbers(const nlohmann::json& metadata, const Expected& expected) {
  for (const auto& [pointer, value] : expected) {
    const nlohmann::json::json_pointer p(pointer);
    ASSERT_TRUE(metadata.contains(p)) << pointer << " is missing";
    EXPECT_EQ(metadata.at(p), nlohmann::json::parse(value)) << pointer;
  }
}

}  // namespace cli_test
