// QkvDispatch on the device sim (W = 1..5), with and without dedup, over
// steps of changing plans (replan): each step's four outputs (queries and
// key-values in the attention layout, the query and key-value gradients in
// the MLP layout) equal, byte for byte, what the host QkvDispatch computes
// on the host sim from the same inputs, and the object's scratch lives in
// device memory. Without a CUDA device every test skips ("no CUDA device").

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cpdispatch/cuda/data_path.hpp"
#include "cpdispatch/execute/qkv_dispatch.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/plan/rank.hpp"
#include "cpdispatch/transports/device_sim.hpp"
#include "cpdispatch/transports/sim.hpp"
#include "cuda_test_util.hpp"

namespace {

using cpdispatch::DeviceSimTransport;
using cpdispatch::DeviceSimWorld;
using cpdispatch::QkvDispatch;
using cpdispatch::QkvDocumentsPlan;
using cpdispatch::cuda::DeviceBuffer;
using cpdispatch::cuda::DeviceSpan;
using Floats = std::vector<float>;

constexpr std::size_t q_elems = 3, kv_elems = 4;
constexpr int steps = 3;

QkvDocumentsPlan step_plan(int W, int step, bool dedup) {
  cpdispatch::RandomDocumentsOptions o;
  o.world_size = W;
  o.num_documents = 2 + (step + W) % 4;
  o.max_shards = 3;
  o.max_len = 3 + step % 3;
  o.max_cp_degree = 3;
  QkvDocumentsPlan plan = cpdispatch::random_documents_plan(o, 500 + static_cast<std::uint64_t>(W * 10 + step));
  plan.dedup = dedup;
  return plan;
}

Floats values(std::size_t n, int rank, int salt) {
  Floats v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>((static_cast<int>(i) * 7 + rank * 13 + salt) % 61 - 30) / 8.0f;
  return v;
}

/// One rank's inputs of a step (sized from the host object) and its four outputs.
struct Step {
  Floats q, kv, dq_attn, dkv_attn;
  Floats q_attn, kv_attn, dq, dkv;
};

template <class D>
Step inputs_for(const D& qkv, int rank) {
  Step s;
  s.q = values(qkv.q_mlp_size(), rank, 1);
  s.kv = values(qkv.kv_mlp_size(), rank, 2);
  s.dq_attn = values(qkv.q_attention_size(), rank, 3);
  s.dkv_attn = values(qkv.kv_attention_size(), rank, 4);
  return s;
}

/// Every step on the host sim: the inputs and the reference outputs of each rank.
std::vector<std::vector<Step>> host_steps(int W, bool dedup) {
  std::vector<std::vector<Step>> out(steps, std::vector<Step>(static_cast<std::size_t>(W)));
  cpdispatch::SimWorld world(W);
  world.run([&](cpdispatch::SimTransport& t) {
    const int r = t.rank();
    QkvDispatch<cpdispatch::SimTransport, float> qkv(t, plan_qkv_for_rank(step_plan(W, 0, dedup), r), q_elems, kv_elems, {.dedup = dedup});
    for (int i = 0; i < steps; ++i) {
      if (i > 0) qkv.replan(plan_qkv_for_rank(step_plan(W, i, dedup), r));
      Step& s = out[static_cast<std::size_t>(i)][static_cast<std::size_t>(r)];
      s = inputs_for(qkv, r);
      s.q_attn.resize(qkv.q_attention_size());
      s.kv_attn.resize(qkv.kv_attention_size());
      s.dq.resize(qkv.q_mlp_size());
      s.dkv.resize(qkv.kv_mlp_size());
      qkv.forward_q(s.q, s.q_attn);
      qkv.forward_kv(s.kv, s.kv_attn);
      qkv.reverse_q(s.dq_attn, s.dq);
      qkv.reverse_kv(s.dkv_attn, s.dkv);
    }
  });
  return out;
}

DeviceBuffer<float> upload(const Floats& host) {
  DeviceBuffer<float> b(host.size() + 1);  // never empty: a zero-token rank still gets a valid pointer
  if (!host.empty()) CPDISPATCH_CUDA_CHECK(cudaMemcpy(b.data(), host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  return b;
}

Floats download(const DeviceBuffer<float>& b, std::size_t n) {
  Floats host(n);
  if (n) CPDISPATCH_CUDA_CHECK(cudaMemcpy(host.data(), b.data(), n * sizeof(float), cudaMemcpyDeviceToHost));
  return host;
}

/// One step of one rank on the device: inputs uploaded, outputs poisoned, then the four calls.
struct DeviceStep {
  DeviceBuffer<float> q, kv, dq_attn, dkv_attn, q_attn, kv_attn, dq, dkv;
};

DeviceStep device_buffers(const Step& s) {
  const auto poison = [](std::size_t n) { return upload(Floats(n, -777.0f)); };
  return {upload(s.q), upload(s.kv), upload(s.dq_attn), upload(s.dkv_attn),
          poison(s.q_attn.size()), poison(s.kv_attn.size()), poison(s.dq.size()), poison(s.dkv.size())};
}

template <class U>
DeviceSpan<U> first(const DeviceBuffer<float>& b, std::size_t n) {
  return DeviceSpan<U>(b.data(), n);
}

class QkvDispatchDeviceSim : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(Worlds, QkvDispatchDeviceSim, ::testing::Values(1, 2, 3, 5),
                         [](const ::testing::TestParamInfo<int>& info) { return "W" + std::to_string(info.param); });

TEST_P(QkvDispatchDeviceSim, EveryStepEqualsTheHostQkvDispatch) {
  CPDISPATCH_REQUIRE_CUDA_DEVICE();
  const int W = GetParam();
  for (const bool dedup : {false, true}) {
    SCOPED_TRACE(dedup ? "dedup" : "section 2 exchange");
    const std::vector<std::vector<Step>> ref = host_steps(W, dedup);
    std::vector<std::vector<DeviceStep>> dev(steps);
    for (int i = 0; i < steps; ++i) {
      for (const Step& s : ref[static_cast<std::size_t>(i)]) dev[static_cast<std::size_t>(i)].push_back(device_buffers(s));
    }
    DeviceSimWorld world(W);
    world.run([&](DeviceSimTransport& t) {
      const int r = t.rank();
      const auto me = static_cast<std::size_t>(r);
      QkvDispatch<DeviceSimTransport, float> qkv(t, plan_qkv_for_rank(step_plan(W, 0, dedup), r), q_elems, kv_elems, {.dedup = dedup});
      for (int i = 0; i < steps; ++i) {
        if (i > 0) qkv.replan(plan_qkv_for_rank(step_plan(W, i, dedup), r));
        const Step& s = ref[static_cast<std::size_t>(i)][me];
        DeviceStep& d = dev[static_cast<std::size_t>(i)][me];
        qkv.forward_q(first<const float>(d.q, s.q.size()), first<float>(d.q_attn, s.q_attn.size()));
        qkv.forward_kv(first<const float>(d.kv, s.kv.size()), first<float>(d.kv_attn, s.kv_attn.size()));
        qkv.reverse_q(first<const float>(d.dq_attn, s.dq_attn.size()), first<float>(d.dq, s.dq.size()));
        qkv.reverse_kv(first<const float>(d.dkv_attn, s.dkv_attn.size()), first<float>(d.dkv, s.dkv.size()));
      }
    });
    world.synchronize();
    for (int i = 0; i < steps; ++i) {
      for (std::size_t r = 0; r < static_cast<std::size_t>(W); ++r) {
        const Step& s = ref[static_cast<std::size_t>(i)][r];
        const DeviceStep& d = dev[static_cast<std::size_t>(i)][r];
        const std::string where = "step " + std::to_string(i) + ", rank " + std::to_string(r);
        EXPECT_EQ(download(d.q_attn, s.q_attn.size()), s.q_attn) << where << ": queries, attention layout";
        EXPECT_EQ(download(d.kv_attn, s.kv_attn.size()), s.kv_attn) << where << ": key-values, attention layout";
        EXPECT_EQ(download(d.dq, s.dq.size()), s.dq) << where << ": query gradients";
        EXPECT_EQ(download(d.dkv, s.dkv.size()), s.dkv) << where << ": key-value gradients";
      }
    }
  }
}

}  // namespace
