// Every rank's token indices, run as a framework runs them (gather, an
// all-to-all by the split counts, scatter), move the same tokens as the
// reference simulation of the global metadata: forward into the attention
// layout, reverse into the [C][T] replica buffer, the combine as
// combine_copies sums, and the dedup fan-out as the plain KV exchange.

#include <gtest/gtest.h>

#include <cstdint>
#include <span>
#include <vector>

#include "cpdispatch/execute/simulate.hpp"
#include "cpdispatch/execute/token_indices.hpp"
#include "cpdispatch/plan/kv_wire.hpp"
#include "cpdispatch/workload/generate.hpp"
#include "cpdispatch/plan/plan.hpp"

namespace {

using cpdispatch::ExchangeIndices;
using cpdispatch::Metadata;
using Buffers = std::vector<std::vector<std::int64_t>>;

/// One exchange over all ranks: send = in[send_index], all-to-all by the
/// counts (peer blocks in rank order), out[recv_index] = received.
Buffers run_exchange(const std::vector<const ExchangeIndices*>& ix, const Buffers& in) {
  const std::size_t W = ix.size();
  std::vector<Buffers> to(W, Buffers(W));  // to[d][s]: what s sends d
  for (std::size_t s = 0; s < W; ++s) {
    std::size_t at = 0;
    for (std::size_t d = 0; d < W; ++d) {
      for (std::int64_t i = 0; i < ix[s]->send_counts[d]; ++i, ++at) to[d][s].push_back(in[s].at(static_cast<std::size_t>(ix[s]->send_index.at(at))));
    }
    EXPECT_EQ(at, ix[s]->send_index.size());
  }
  Buffers out(W);
  for (std::size_t d = 0; d < W; ++d) {
    out[d].assign(static_cast<std::size_t>(ix[d]->output_tokens), 0);
    std::size_t at = 0;
    for (std::size_t s = 0; s < W; ++s) {
      EXPECT_EQ(static_cast<std::int64_t>(to[d][s].size()), ix[d]->recv_counts[s]) << "rank " << d << " from " << s;
      for (std::int64_t v : to[d][s]) out[d].at(static_cast<std::size_t>(ix[d]->recv_index.at(at++))) = v;
    }
    EXPECT_EQ(at, ix[d]->recv_index.size());
  }
  return out;
}

/// Distinct values per rank and token.
Buffers tokens(const std::vector<std::int64_t>& counts, std::int64_t salt) {
  Buffers out(counts.size());
  for (std::size_t r = 0; r < counts.size(); ++r) {
    for (std::int64_t t = 0; t < counts[r]; ++t) out[r].push_back(salt + 1000 * static_cast<std::int64_t>(r) + t);
  }
  return out;
}

/// Checks both exchanges (and the combine) of one (fwd, rev) metadata pair;
/// returns the forward output.
Buffers check_pair(const Metadata& fwd, const Metadata& rev) {
  const auto W = static_cast<std::size_t>(fwd.world_size);
  std::vector<cpdispatch::DispatchIndices> ix;
  std::vector<const ExchangeIndices*> forward, reverse;
  std::vector<std::int64_t> home, attention;
  for (std::size_t r = 0; r < W; ++r) {
    ix.push_back(cpdispatch::dispatch_indices(fwd.get_slice(static_cast<std::int64_t>(r)), rev.get_slice(static_cast<std::int64_t>(r))));
    home.push_back(fwd.send_tokens(static_cast<std::int64_t>(r)));
    attention.push_back(rev.send_tokens(static_cast<std::int64_t>(r)));
  }
  for (const auto& i : ix) forward.push_back(&i.forward), reverse.push_back(&i.reverse);
  const Buffers in = tokens(home, 0);
  Buffers expected;
  cpdispatch::simulate(fwd, in, expected, 1);
  const Buffers out = run_exchange(forward, in);
  EXPECT_EQ(out, expected);

  const Buffers back_in = tokens(attention, 500000);
  Buffers back_expected;
  cpdispatch::simulate(rev, back_in, back_expected, 1);
  const Buffers replica = run_exchange(reverse, back_in);
  EXPECT_EQ(replica, back_expected);
  for (std::size_t r = 0; r < W && rev.seq_recv_mask; ++r) {
    std::vector<std::int64_t> grad(static_cast<std::size_t>(home[r]), 0), want(grad.size(), 0);
    for (std::size_t i = 0; i < ix[r].combine_source.size(); ++i) {
      grad.at(static_cast<std::size_t>(ix[r].combine_target[i])) += replica[r].at(static_cast<std::size_t>(ix[r].combine_source[i]));
    }
    cpdispatch::combine_copies<std::int64_t>(rev.get_slice(static_cast<std::int64_t>(r)), replica[r], want, 1);
    EXPECT_EQ(grad, want) << "combine on rank " << r;
  }
  return out;
}

class TokenIndices : public ::testing::TestWithParam<int> {};

TEST_P(TokenIndices, MoveTheTokensTheSimulationMoves) {
  const int seed = GetParam();
  cpdispatch::RandomDocumentsOptions options;
  options.world_size = 1 + seed % 5;
  options.num_documents = 1 + seed % 7;
  options.max_shards = 4;
  options.max_len = 6;
  const cpdispatch::QkvMetadata meta = cpdispatch::plan_qkv(cpdispatch::random_documents_plan(options, static_cast<std::uint64_t>(seed)));
  check_pair(meta.q_fwd, meta.q_rev);
  const Buffers kv = check_pair(meta.kv_fwd, meta.kv_rev);

  // Dedup: the wire exchange, then the fan-out, gives the plain KV layout.
  const cpdispatch::KvWireMetadata wire = cpdispatch::plan_kv_wire(meta);
  const Buffers wire_out = check_pair(wire.fwd, wire.rev);
  for (std::size_t d = 0; d < wire_out.size(); ++d) {
    const cpdispatch::FanIndices fan = cpdispatch::fan_indices(wire.fan[d]);
    ASSERT_EQ(fan.fan_source.size(), kv[d].size());
    for (std::size_t i = 0; i < fan.fan_source.size(); ++i) {
      EXPECT_EQ(wire_out[d].at(static_cast<std::size_t>(fan.fan_source[i])), kv[d][i]) << "rank " << d << " row " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(RandomPlans, TokenIndices, ::testing::Range(0, 40));

TEST(TokenIndices, RefuseSlicesOfDifferentPlans) {
  cpdispatch::RandomDocumentsOptions options;
  options.world_size = 2;
  const cpdispatch::QkvMetadata a = cpdispatch::plan_qkv(cpdispatch::random_documents_plan(options, 1));
  options.num_documents = 3;
  const cpdispatch::QkvMetadata b = cpdispatch::plan_qkv(cpdispatch::random_documents_plan(options, 2));
  EXPECT_THROW(cpdispatch::dispatch_indices(a.q_fwd.get_slice(0), b.q_rev.get_slice(0)), cpdispatch::invalid_input);
}

}  // namespace
