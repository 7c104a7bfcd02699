// One attention layer's communication, as a training loop writes it: each
// rank knows only its own documents; gather_plan makes the global plan,
// plan_qkv_for_rank this rank's share of it, and QkvDispatch moves typed queries and key-values there and back.
// Runs W ranks as threads (the sim transport); with MPI or NCCL only the
// transport changes.  qkv_step [world size]   (exit status 0: every check passed)

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cpdispatch/execute/gather_plan.hpp"
#include "cpdispatch/execute/qkv_dispatch.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/plan/rank.hpp"
#include "cpdispatch/transports/sim.hpp"

using cpdispatch::bfloat16;

int main(int argc, char** argv) {
  const int W = argc > 1 ? std::atoi(argv[1]) : 4;
  if (W < 1) return std::fprintf(stderr, "qkv_step: world size must be at least 1\n"), 2;
  const auto batch = cpdispatch::create_qkv_dispatch(W, 1024, 4, W >= 4 ? 4 : 1, 7);  // stands in for a data loader
  constexpr std::size_t q_token_elems = 8 * 64, kv_token_elems = 2 * 2 * 64;                        // 8 query heads, 2 KV heads
  std::vector<int> ok(static_cast<std::size_t>(W), 0);

  cpdispatch::SimWorld world(W);
  world.run([&](cpdispatch::SimTransport& t) {
    const auto& mine = batch.ranks[static_cast<std::size_t>(t.rank())].docs;  // this rank's documents only
    const auto plan = cpdispatch::gather_plan(t, std::span<const cpdispatch::Document>(mine), batch.max_cp_degree);
    const auto share = cpdispatch::plan_qkv_for_rank(plan, t.rank());  // this rank's metadata only
    cpdispatch::QkvDispatch<cpdispatch::SimTransport, bfloat16> qkv(t, share, q_token_elems, kv_token_elems);

    std::vector<bfloat16> q(qkv.q_mlp_size(), bfloat16(1.0f)), kv(qkv.kv_mlp_size(), bfloat16(1.0f));
    std::vector<bfloat16> q_attn(qkv.q_attention_size()), kv_attn(qkv.kv_attention_size());
    qkv.forward_q(q, q_attn);
    qkv.forward_kv(kv, kv_attn);
    const cpdispatch::RankAttentionLayout& a = qkv.attention();  // cu_seqlens_q/kv, max_seqlen_q/kv for varlen attention
    // ... attention forward and backward; here the gradients are the inputs themselves ...
    std::vector<bfloat16> dq(q.size()), dkv(kv.size());
    qkv.reverse_q(q_attn, dq);
    qkv.reverse_kv(kv_attn, dkv);  // each KV token: 1 per query shard that attended to it

    ok[static_cast<std::size_t>(t.rank())] = dq == q;
    std::printf("rank %d: %zu query shards, %lld query / %lld KV tokens in attention (max %lld / %lld)\n", t.rank(),
                a.seqlens_q.size(), static_cast<long long>(a.q_tokens()), static_cast<long long>(a.kv_tokens()),
                static_cast<long long>(a.max_seqlen_q), static_cast<long long>(a.max_seqlen_kv));
  });
  for (int v : ok)
    if (!v) return std::puts("FAIL: the query round trip changed a value"), 1;
  std::puts("OK: queries round-tripped on every rank");
  return 0;
}
