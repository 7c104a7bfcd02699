// One attention layer's training step with context parallelism: every rank
// holds the shards of a packed batch in its MLP layout, ContextParallelAttention
// attends each query to its whole document wherever the keys live (forward),
// and brings the gradients home (backward). The loss is 0.5 * sum(out^2), so
// dout = out. The same step on one rank holding every document whole must
// give the same loss and gradient norms.
//   cp_attention [world size] [stages]   (exit status 0: the two agree)

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "cpdispatch/attention.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/plan/rank.hpp"
#include "cpdispatch/transports/sim.hpp"

namespace {

using cpdispatch::QkvDocumentsPlan;

const cpdispatch::AttentionShape shape{.heads_q = 4, .heads_kv = 2, .head_dim = 16, .softmax_scale = 0.25f};

/// A token's values depend only on (document, position, head, channel): a stand-in for the layer's projections.
std::vector<float> layer_input(const QkvDocumentsPlan& plan, int rank, std::int64_t heads, unsigned salt) {
  std::vector<float> x;
  for (std::size_t d = 0; d < plan.documents.size(); ++d) {
    std::int64_t pos = 0;
    for (const cpdispatch::DocumentShard& s : plan.documents[d].shards) {
      for (std::int64_t p = pos; p < pos + s.len && s.rank == rank; ++p) {
        for (std::int64_t i = 0; i < heads * shape.head_dim; ++i) x.push_back(std::sin(0.37f * float(d + 1) * float(p + 3 + salt) + 0.11f * float(i)));
      }
      pos += s.len;
    }
  }
  return x;
}

struct Totals {
  std::mutex m;
  double loss = 0, dq = 0, dk = 0, dv = 0;
  void add(const std::vector<float>& out, const std::vector<float>& dq_, const std::vector<float>& dk_, const std::vector<float>& dv_) {
    const auto sq = [](const std::vector<float>& x) { double s = 0; for (float f : x) s += double(f) * f; return s; };
    std::lock_guard lock(m);
    loss += 0.5 * sq(out), dq += sq(dq_), dk += sq(dk_), dv += sq(dv_);
  }
};

/// The step every rank runs: this is all a training loop writes per layer.
void train_step(const QkvDocumentsPlan& plan, int world_size, int stages, Totals& totals) {
  cpdispatch::SimWorld world(world_size);
  world.run([&](cpdispatch::SimTransport& t) {
    const cpdispatch::RankQkvMetadata share = cpdispatch::plan_qkv_for_rank(plan, t.rank());  // this rank's part of the plan
    cpdispatch::ContextParallelAttention<cpdispatch::SimTransport, float> attn(
        t, share, shape, cpdispatch::CpAttentionOptions{.dedup = false, .stages = stages}, cpdispatch::HostAttentionKernel({1, 64, 64}));
    const std::vector<float> q = layer_input(plan, t.rank(), shape.heads_q, 0), k = layer_input(plan, t.rank(), shape.heads_kv, 1),
                             v = layer_input(plan, t.rank(), shape.heads_kv, 2);
    std::vector<float> out(q.size()), dq(q.size()), dk(k.size()), dv(v.size());
    attn.forward(q, k, v, out);         // MLP layout in, MLP layout out
    attn.backward(out, dq, dk, dv);     // dout = out; dk, dv summed over every copy
    totals.add(out, dq, dk, dv);
  });
}

/// The same documents, each whole on one rank.
QkvDocumentsPlan unsharded(const QkvDocumentsPlan& plan) {
  QkvDocumentsPlan one;
  one.world_size = 1;
  one.mask = plan.mask;
  for (const auto& doc : plan.documents) {
    std::int64_t len = 0;
    for (const auto& s : doc.shards) len += s.len;
    one.documents.push_back({{{0, len, 0}}});
  }
  return one;
}

}  // namespace

int main(int argc, char** argv) {
  const int W = argc > 1 ? std::atoi(argv[1]) : 4, stages = argc > 2 ? std::atoi(argv[2]) : 2;
  if (W < 1 || stages < 1) return std::fprintf(stderr, "cp_attention: world size and stages must be at least 1\n"), 2;
  const QkvDocumentsPlan plan = cpdispatch::random_documents_plan({W, 2 * W, 4, 48, {}}, 5);
  Totals sharded, whole;
  train_step(plan, W, stages, sharded);
  train_step(unsharded(plan), 1, 1, whole);
  std::printf("loss %.6f (one rank: %.6f); |dq|^2 %.6f (%.6f), |dk|^2 %.6f (%.6f), |dv|^2 %.6f (%.6f)\n", sharded.loss, whole.loss,
              sharded.dq, whole.dq, sharded.dk, whole.dk, sharded.dv, whole.dv);
  const auto close = [](double a, double b) { return std::abs(a - b) <= 1e-4 * std::max(1.0, std::abs(b)); };
  if (!close(sharded.loss, whole.loss) || !close(sharded.dq, whole.dq) || !close(sharded.dk, whole.dk) || !close(sharded.dv, whole.dv)) {
    return std::puts("FAIL: the context-parallel step differs from the one-rank step"), 1;
  }
  std::printf("OK: %d ranks, %d stages: the context-parallel step equals the one-rank step\n", W, stages);
  return 0;
}
