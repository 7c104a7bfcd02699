// The code example of README.md, compiled and run as a test (readme.example);
// readme.example_is_in_readme checks that the README shows the block between
// the markers verbatim. Edit both together.
// README: begin
#include <cpdispatch/cpdispatch.hpp>

#include <cstdio>
#include <vector>

int main() {
  using namespace cpdispatch;

  // Two ranks. Rank 0 holds a document split into shards of 4 and 2 tokens,
  // whose queries attend on ranks 1 and 0, then a 3-token document kept at
  // home; rank 1 holds one document of 5 + 1 + 2 tokens spread over 0, 1, 0.
  QkvPlan plan;
  plan.world_size = 2;
  plan.ranks = {
      RankDocuments{{Document{{4, 2}, {1, 0}}, Document{{3}, {0}}}},
      RankDocuments{{Document{{5, 1, 2}, {0, 1, 0}}}},
  };
  const QkvMetadata meta = plan_qkv(plan);  // q_fwd, q_rev, kv_fwd, kv_rev, attn

  // What flash-attention gets on rank 0: four query shards, each with its
  // causal key-value context (cu_seqlens_kv[0] is {0, 6, 9, 14, 22}).
  std::printf("rank 0: %zu query shards, %lld key-value tokens\n", meta.attn.seqlens_q[0].size(),
              static_cast<long long>(meta.attn.cu_seqlens_kv[0].back()));

  // Forward: send every rank's key-values (one float per token here) to each
  // query shard that needs them, in the attention layout. simulate() performs
  // the exchange in memory, one buffer per rank.
  const std::size_t token_elems = 1;
  const std::vector<std::vector<float>> kv = {std::vector<float>(9, 1.0f), std::vector<float>(8, 1.0f)};
  std::vector<std::vector<float>> kv_attn;
  simulate(meta.kv_fwd, kv, kv_attn, token_elems);

  // Backward: each replica's gradient goes home into a [C][T] replica buffer
  // (copy c in slab c), and combine_copies sums the copies of every shard.
  const std::vector<std::vector<float>> grad_attn = kv_attn;  // d(loss)/d(replica) = 1
  std::vector<std::vector<float>> replica;
  simulate(meta.kv_rev, grad_attn, replica, token_elems);
  std::vector<float> grad(8);
  combine_copies<float>(meta.kv_rev, 1, replica[1], grad, token_elems);

  // On rank 1 the 5-token shard was read by 3 query shards, the next by 2, the last by 1.
  const bool ok = grad == std::vector<float>{3, 3, 3, 3, 3, 2, 1, 1};
  std::printf("rank 1 key-value gradient: %s\n", ok ? "3 3 3 3 3 2 1 1, as expected" : "WRONG");
  return ok ? 0 : 1;
}
// README: end
