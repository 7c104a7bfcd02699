// ChecksummedTransport over the sim transport (ranks as threads): a healthy
// step is unchanged and every remote segment is checked; a corrupted segment
// (FaultInjectingTransport's corrupt, underneath the checksums) is an error
// on every rank naming the source rank (the receiving rank's names the
// segment); without agreement only the receiving rank throws and the others
// complete with right output; a short delivery that the transport itself
// lets through (as MPI does) is caught the same way; posted exchanges are
// checked in their wait, point-to-point messages in the irecv's wait, the
// blocks of an all-gather and a broadcast's bytes on every rank. Prints "fault-matrix |" rows for
// docs/reliability.md.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "cpdispatch/adapters/checksummed.hpp"
#include "cpdispatch/execute/kv_wire.hpp"
#include "cpdispatch/execute/dispatcher.hpp"
#include "cpdispatch/adapters/fault_injecting.hpp"
#include "cpdispatch/transports/sim.hpp"
#include "dedup_fault_cases.hpp"
#include "fault_cases.hpp"

namespace {

using namespace std::chrono_literals;
using namespace fault_cases;
using cpdispatch::ChecksummedTransport;
using cpdispatch::SimOptions;
using cpdispatch::SimPackingTransport;
using cpdispatch::SimTransport;
using cpdispatch::SimWorld;
using testing::HasSubstr;

constexpr auto sim_timeout = 1000ms;
const FaultOptions fault_options{.error_code = 77, .stall = 1500ms, .short_bytes = 4};

/// Which rank received the bad segment, and the corruption_error's source rank (-1: none).
struct Checked : Outcome {
  int source = -1;
  std::uint64_t checked = 0;
};

/// One dispatcher step on every rank of a world of W, each over
/// ChecksummedTransport<FaultInjectingTransport<sim or packing>>.
template <bool packing>
std::vector<Checked> checked_step(int W, const std::vector<FaultRule>& rules, Step step, cpdispatch::ChecksumOptions options = {}) {
  const auto meta = ring_plan(W);
  const auto data = step_data(meta, step);
  SimWorld world(W, SimOptions{sim_timeout});
  std::vector<Checked> out(static_cast<std::size_t>(W));
  try {
    world.run([&](SimTransport& sim) {
      const auto r = static_cast<std::size_t>(sim.rank());
      auto body = [&](auto& inner) {
        FaultInjectingTransport faulty(inner, rules, fault_options);
        ChecksummedTransport t(faulty, options);
        cpdispatch::Dispatcher d(t, meta.kv_fwd, meta.kv_rev, token_bytes);
        run_step(d, step, data, r, out[r]);
        out[r].checked = t.checked_segments();
      };
      if constexpr (packing) {
        SimPackingTransport p(sim);
        body(p);
      } else {
        body(sim);
      }
      if (const auto at = out[r].what.find("from rank "); at != std::string::npos && out[r].what.find("corrupted or short") != std::string::npos) {
        out[r].source = std::stoi(out[r].what.substr(at + 10));
      }
    });
  } catch (const cpdispatch::error&) {
    // The rank that threw left the world early: expected.
  }
  return out;
}

void report(const char* component, const char* transport, const char* fault, int W, const std::vector<Checked>& out) {
  int threw = 0;
  double faulty = 0, others = 0;
  for (const Checked& o : out) {
    threw += o.threw;
    const bool detecting = o.what.find("fails its CRC32C check") != std::string::npos;
    (detecting ? faulty : others) = std::max(detecting ? faulty : others, o.ms);
  }
  std::printf("fault-matrix | %s | %s | %s | W=%d | %d/%d ranks threw | detecting rank %.0f ms | others %.0f ms\n", component, transport,
              fault, W, threw, W, faulty, others);
}

using Param = std::tuple<int, Step, bool>;  // W, step, packing path
class ChecksumFaults : public testing::TestWithParam<Param> {};

TEST_P(ChecksumFaults, HealthyStepIsUnchangedAndEveryRemoteSegmentChecked) {
  const auto [W, step, packing] = GetParam();
  const auto out = packing ? checked_step<true>(W, {}, step) : checked_step<false>(W, {}, step);
  for (std::size_t r = 0; r < out.size(); ++r) {
    EXPECT_FALSE(out[r].threw) << out[r].what;
    EXPECT_EQ(out[r].wrong_floats, 0u) << "rank " << r;
    EXPECT_EQ(out[r].checked, static_cast<std::uint64_t>(W - 1)) << "rank " << r;  // one exchange, W - 1 remote segments
  }
}

TEST_P(ChecksumFaults, CorruptedSegmentIsAnErrorOnEveryRankNamingItsSource) {
  const auto [W, step, packing] = GetParam();
  const int faulty = W - 1;
  const TransportCall call = packing ? TransportCall::all_to_all_v : TransportCall::all_to_all_pieces;
  const std::vector<FaultRule> rules = {FaultRule{call, 1, Fault::corrupt, faulty}};
  const auto out = packing ? checked_step<true>(W, rules, step) : checked_step<false>(W, rules, step);
  report((std::string("Dispatcher::") + step_name(step) + " + ChecksummedTransport").c_str(), packing ? "sim (all_to_all_v)" : "sim (pieces)",
         "corrupt", W, out);
  int detected = 0;
  for (std::size_t r = 0; r < out.size(); ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_TRUE(out[r].input_unchanged);
    EXPECT_TRUE(out[r].threw);
    // Its own corruption_error, or the world's abort quoting the first rank's: the source is named either way.
    EXPECT_EQ(out[r].source, faulty) << out[r].what;
    if (out[r].what.find("fails its CRC32C check") != std::string::npos) {
      ++detected;
      EXPECT_THAT(out[r].what, packing ? HasSubstr("of the receive buffer") : HasSubstr("pieces"));
    }
  }
  EXPECT_LE(detected, 1);  // only the receiver of the flipped byte finds a bad checksum
}

TEST_P(ChecksumFaults, WithoutAgreementOnlyTheReceiverThrows) {
  const auto [W, step, packing] = GetParam();
  const int faulty = W - 1;
  const TransportCall call = packing ? TransportCall::all_to_all_v : TransportCall::all_to_all_pieces;
  const std::vector<FaultRule> rules = {FaultRule{call, 1, Fault::corrupt, faulty}};
  const cpdispatch::ChecksumOptions alone{.agree = false};
  const auto out = packing ? checked_step<true>(W, rules, step, alone) : checked_step<false>(W, rules, step, alone);
  int detected = 0;
  for (std::size_t r = 0; r < out.size(); ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    if (out[r].what.find("fails its CRC32C check") != std::string::npos) {
      ++detected;
      EXPECT_EQ(out[r].source, faulty);
      EXPECT_THAT(out[r].what, HasSubstr("rank " + std::to_string(r) + " of " + std::to_string(W)));
    } else if (!out[r].threw) {
      EXPECT_EQ(out[r].wrong_floats, 0u);  // every rank that completed has right output
    }
  }
  EXPECT_EQ(detected, 1);
}

INSTANTIATE_TEST_SUITE_P(Sim, ChecksumFaults,
                         testing::Combine(testing::Values(2, 3, 5, 8), testing::Values(Step::forward, Step::reverse, Step::reverse_combine),
                                          testing::Bool()),
                         [](const testing::TestParamInfo<Param>& info) {
                           return "W" + std::to_string(std::get<0>(info.param)) + "_" + step_name(std::get<1>(info.param)) +
                                  (std::get<2>(info.param) ? "_packing" : "_pieces");
                         });

// The deduplicated KV exchange passes through the same adapter unchanged.
TEST(ChecksummedTransport, KvWireDispatcherCorruptionIsAnErrorOnEveryRank) {
  namespace dfc = dedup_fault_cases;
  for (const int W : {2, 3, 5}) {
    for (const dfc::Step step : {dfc::Step::forward, dfc::Step::reverse_combine, dfc::Step::reverse_combine_in_place}) {
      SCOPED_TRACE(testing::Message() << "W = " << W << ", " << dfc::step_name(step));
      const auto plan = dfc::shared_plan(W);
      const auto data = dfc::step_data(plan, step);
      for (const bool corrupt : {false, true}) {
        std::vector<dfc::DedupOutcome> out(static_cast<std::size_t>(W));
        SimWorld world(W, SimOptions{sim_timeout});
        const std::vector<FaultRule> rules = corrupt ? std::vector<FaultRule>{FaultRule{TransportCall::all_to_all_pieces, 1, Fault::corrupt, W - 1}}
                                                     : std::vector<FaultRule>{};
        try {
          world.run([&](SimTransport& sim) {
            FaultInjectingTransport faulty(sim, rules, fault_options);
            ChecksummedTransport t(faulty);
            cpdispatch::KvWireDispatcher d(t, plan.wire, token_bytes);
            dfc::run_step(d, step, data, static_cast<std::size_t>(sim.rank()), out[static_cast<std::size_t>(sim.rank())]);
          });
        } catch (const cpdispatch::error&) {
        }
        for (std::size_t r = 0; r < out.size(); ++r) {
          if (!corrupt) {
            EXPECT_FALSE(out[r].threw) << out[r].what;
            EXPECT_EQ(out[r].wrong_floats, 0u) << "rank " << r;
            continue;
          }
          EXPECT_TRUE(out[r].threw) << "rank " << r;
          EXPECT_THAT(out[r].what, HasSubstr("from rank " + std::to_string(W - 1)));
          EXPECT_THAT(out[r].what, HasSubstr("corrupted or short"));
        }
      }
    }
  }
}

/// A transport that, like MPI, lets a short delivery through: the last
/// `short_bytes` of the segment rank `from` sends rank `to` keep the
/// receiver's old contents. Posted exchanges get a flipped byte instead.
class LossyTransport {
 public:
  static constexpr cpdispatch::MemorySpace memory_space = cpdispatch::MemorySpace::host;
  LossyTransport(SimTransport& sim, int from, int to, std::size_t short_bytes) : sim_(sim), from_(from), to_(to), short_(short_bytes) {}
  int rank() const { return sim_.rank(); }
  int world_size() const { return sim_.world_size(); }

  void all_to_all_v(const void* send, std::span<const std::size_t> sc, std::span<const std::size_t> sd, void* recv,
                    std::span<const std::size_t> rc, std::span<const std::size_t> rd) {
    const auto from = static_cast<std::size_t>(from_);
    const bool hit = armed_ && short_ > 0 && rank() == to_ && rc[from] >= short_;
    armed_ = false;  // only the first exchange (the data; its checksums travel intact)
    std::vector<std::byte> old;
    std::byte* tail = static_cast<std::byte*>(recv) + rd[from] + (hit ? rc[from] - short_ : 0);
    if (hit) old.assign(tail, tail + short_);
    sim_.all_to_all_v(send, sc, sd, recv, rc, rd);
    if (hit) std::memcpy(tail, old.data(), short_);
  }

  cpdispatch::Request post_all_to_all_v(const void* send, std::span<const std::size_t> sc, std::span<const std::size_t> sd, void* recv,
                                        std::span<const std::size_t> rc, std::span<const std::size_t> rd) {
    if (rank() != from_ || !armed_ || sc[static_cast<std::size_t>(to_)] == 0) return sim_.post_all_to_all_v(send, sc, sd, recv, rc, rd);
    armed_ = false;
    std::size_t extent = 0;
    for (std::size_t p = 0; p < sc.size(); ++p) extent = std::max(extent, sd[p] + sc[p]);
    copy_.assign(static_cast<const std::byte*>(send), static_cast<const std::byte*>(send) + extent);
    copy_[sd[static_cast<std::size_t>(to_)]] ^= std::byte{0x01};
    return sim_.post_all_to_all_v(copy_.data(), sc, sd, recv, rc, rd);
  }
  void wait(cpdispatch::Request r) { sim_.wait(r); }

 private:
  SimTransport& sim_;
  int from_, to_;
  std::size_t short_;
  bool armed_ = true;
  std::vector<std::byte> copy_;
};

TEST(ChecksummedTransport, ShortDeliveryLetThroughByTheTransportIsCaught) {
  for (const int W : {2, 4, 7}) {
    SimWorld world(W, SimOptions{sim_timeout});
    std::vector<std::string> what(static_cast<std::size_t>(W));
    std::vector<int> source(static_cast<std::size_t>(W), -1);
    try {
      world.run([&](SimTransport& sim) {
        LossyTransport lossy(sim, W - 1, 0, 4);
        ChecksummedTransport t(lossy, {.agree = false});
        const auto r = static_cast<std::size_t>(sim.rank());
        std::vector<std::size_t> counts(static_cast<std::size_t>(W), 64), displs(static_cast<std::size_t>(W));
        for (std::size_t p = 0; p < displs.size(); ++p) displs[p] = 64 * p;
        std::vector<unsigned char> send(64 * static_cast<std::size_t>(W), static_cast<unsigned char>(r + 1)), recv(send.size(), 0);
        try {
          t.all_to_all_v(send.data(), counts, displs, recv.data(), counts, displs);
        } catch (const cpdispatch::corruption_error& e) {
          what[r] = e.what();
          source[r] = e.source_rank();
          throw;
        }
      });
    } catch (const cpdispatch::error&) {
    }
    for (int r = 0; r < W; ++r) EXPECT_EQ(source[static_cast<std::size_t>(r)], r == 0 ? W - 1 : -1) << "rank " << r << ": " << what[static_cast<std::size_t>(r)];
    EXPECT_THAT(what[0], HasSubstr("the segment from rank " + std::to_string(W - 1) + " in exchange #1 (64 bytes at byte " +
                                   std::to_string(64 * (W - 1)) + " of the receive buffer) fails its CRC32C check"));
  }
}

TEST(ChecksummedTransport, PostedExchangeIsCheckedInItsWait) {
  const int W = 4;
  SimWorld world(W, SimOptions{sim_timeout});
  std::vector<int> source(W, -1);
  std::vector<std::uint64_t> checked(W, 0);
  std::vector<char> aborted(W, 0);
  try {
    world.run([&](SimTransport& sim) {
      LossyTransport lossy(sim, 2, 1, 0);
      ChecksummedTransport t(lossy);
      const auto r = static_cast<std::size_t>(sim.rank());
      std::vector<std::size_t> counts(W, 32), displs(W);
      for (std::size_t p = 0; p < displs.size(); ++p) displs[p] = 32 * p;
      std::vector<unsigned char> send(32 * W, static_cast<unsigned char>(r + 1)), recv(send.size(), 0);
      try {
        const cpdispatch::Request request = t.post_all_to_all_v(send.data(), counts, displs, recv.data(), counts, displs);
        t.wait(request);
        checked[r] = t.checked_segments();
      } catch (const cpdispatch::corruption_error& e) {
        source[r] = e.source_rank();
        EXPECT_THAT(e.what(), HasSubstr("rank 1 of 4: the segment from rank 2 in exchange #1"));
        throw;
      } catch (const cpdispatch::error&) {
        aborted[r] = 1;
        throw;
      }
    });
  } catch (const cpdispatch::error&) {
  }
  for (std::size_t r = 0; r < W; ++r) EXPECT_EQ(source[r], r == 1 ? 2 : -1) << "rank " << r;
  // A rank that was not hit checked its three remote segments, unless the world's abort (rank 1 left) reached its wait first.
  EXPECT_TRUE(checked[0] == 3u || aborted[0]) << checked[0];
}

/// Per rank: the corruption_error's source (-1: none), its message and the
/// segments or messages checked.
struct RingOutcome {
  std::vector<int> source;
  std::vector<std::string> what;
  std::vector<std::uint64_t> checked;
};

/// Runs `body(t, rank)` on every rank of a world of W, `t` a
/// ChecksummedTransport<FaultInjectingTransport<sim>>. `rethrow`: a rank's
/// corruption_error also ends the world (the others are released).
template <class Body>
RingOutcome checked_on_every_rank(int W, const std::vector<FaultRule>& rules, bool rethrow, Body&& body) {
  SimWorld world(W, SimOptions{sim_timeout});
  const auto ranks = static_cast<std::size_t>(W);
  RingOutcome out{std::vector<int>(ranks, -1), std::vector<std::string>(ranks), std::vector<std::uint64_t>(ranks, 0)};
  try {
    world.run([&](SimTransport& sim) {
      FaultInjectingTransport faulty(sim, rules, fault_options);
      ChecksummedTransport t(faulty);
      const auto i = static_cast<std::size_t>(sim.rank());
      try {
        body(t, sim.rank());
        out.checked[i] = t.checked_segments();
      } catch (const cpdispatch::corruption_error& e) {
        out.source[i] = e.source_rank();
        out.what[i] = e.what();
        if (rethrow) throw;
      }
    });
  } catch (const cpdispatch::error&) {
  }
  return out;
}

/// Each rank sends 64 bytes to the next rank and receives from the previous one.
RingOutcome checked_ring(int W, const std::vector<FaultRule>& rules) {
  return checked_on_every_rank(W, rules, true, [W](auto& t, int r) {
    std::vector<unsigned char> send(64, static_cast<unsigned char>(r + 1)), recv(64, 0);
    const cpdispatch::Request in = t.irecv(recv.data(), recv.size(), (r + W - 1) % W, 5);
    const cpdispatch::Request sent = t.isend(send.data(), send.size(), (r + 1) % W, 5);
    t.wait(sent);
    t.wait(in);
    EXPECT_EQ(recv, std::vector<unsigned char>(64, static_cast<unsigned char>((r + W - 1) % W + 1)));
  });
}

TEST(ChecksummedTransport, PointToPointMessagesAreChecked) {
  for (const int W : {2, 3, 5}) {
    const RingOutcome healthy = checked_ring(W, {});
    for (int r = 0; r < W; ++r) {
      EXPECT_EQ(healthy.source[static_cast<std::size_t>(r)], -1) << healthy.what[static_cast<std::size_t>(r)];
      EXPECT_EQ(healthy.checked[static_cast<std::size_t>(r)], 1u) << "rank " << r;
    }
    // Rank 0's isend is corrupted under the checksums: rank 1, its receiver, names it.
    const RingOutcome hit = checked_ring(W, {FaultRule{TransportCall::isend, 1, Fault::corrupt, 0}});
    EXPECT_EQ(hit.source[1], 0);
    EXPECT_THAT(hit.what[1], HasSubstr("rank 1 of " + std::to_string(W) + ": the message from rank 0 (tag 5, 64 bytes) fails its CRC32C check"));
    for (int r = 2; r < W; ++r) EXPECT_EQ(hit.source[static_cast<std::size_t>(r)], -1) << "rank " << r;
  }
}

/// One all_gather (`broadcast` false: 16 floats a rank) or broadcast (from rank 1) on every rank.
RingOutcome checked_collective(int W, bool broadcast, const std::vector<FaultRule>& rules) {
  return checked_on_every_rank(W, rules, false, [W, broadcast](auto& t, int r) {
    constexpr std::size_t n = 16;
    std::vector<float> mine(n, static_cast<float>(r + 1)), all(n * static_cast<std::size_t>(W), 0.0f);
    if (broadcast) {
      t.broadcast(mine.data(), n * sizeof(float), 1);
      EXPECT_EQ(mine, std::vector<float>(n, 2.0f));
      return;
    }
    t.all_gather(mine.data(), all.data(), n, cpdispatch::ElementType::float32);
    for (std::size_t k = 0; k < all.size(); ++k) EXPECT_EQ(all[k], static_cast<float>(k / n + 1)) << "rank " << r << ", element " << k;
  });
}

TEST(ChecksummedTransport, AllGatherBlocksAreCheckedOnEveryRank) {
  for (const int W : {2, 3, 5}) {
    const RingOutcome healthy = checked_collective(W, false, {});
    for (int r = 0; r < W; ++r) {
      EXPECT_EQ(healthy.source[static_cast<std::size_t>(r)], -1) << healthy.what[static_cast<std::size_t>(r)];
      EXPECT_EQ(healthy.checked[static_cast<std::size_t>(r)], static_cast<std::uint64_t>(W - 1)) << "rank " << r;
    }
    // Rank 0's block is corrupted in transit: every other rank finds it bad, and with agreement rank 0 hears of it.
    const RingOutcome hit = checked_collective(W, false, {FaultRule{TransportCall::all_gather, 1, Fault::corrupt, 0}});
    for (int r = 0; r < W; ++r) EXPECT_EQ(hit.source[static_cast<std::size_t>(r)], 0) << "rank " << r << ": " << hit.what[static_cast<std::size_t>(r)];
    EXPECT_THAT(hit.what[1], HasSubstr("rank 1 of " + std::to_string(W) + ": the segment from rank 0 in exchange #1 (block 0 of the all-gather, 64 bytes at byte 0) fails its CRC32C check"));
    EXPECT_THAT(hit.what[0], HasSubstr("the segment it received from rank 0 is corrupted or short"));
  }
}

TEST(ChecksummedTransport, BroadcastIsCheckedOnEveryRank) {
  for (const int W : {2, 3, 5}) {
    const RingOutcome healthy = checked_collective(W, true, {});
    for (int r = 0; r < W; ++r) {
      EXPECT_EQ(healthy.source[static_cast<std::size_t>(r)], -1) << healthy.what[static_cast<std::size_t>(r)];
      EXPECT_EQ(healthy.checked[static_cast<std::size_t>(r)], r == 1 ? 0u : 1u) << "rank " << r;
    }
    // The root's bytes are corrupted on their way out: every rank names the root.
    const RingOutcome hit = checked_collective(W, true, {FaultRule{TransportCall::broadcast, 1, Fault::corrupt, 1}});
    for (int r = 0; r < W; ++r) EXPECT_EQ(hit.source[static_cast<std::size_t>(r)], 1) << "rank " << r << ": " << hit.what[static_cast<std::size_t>(r)];
    EXPECT_THAT(hit.what[0], HasSubstr("rank 0 of " + std::to_string(W) + ": the broadcast from rank 1 in exchange #1 (64 bytes) fails its CRC32C check"));
  }
}

TEST(ChecksummedTransport, HasTheMembersOfItsInnerTransport) {
  static_assert(cpdispatch::Transport<ChecksummedTransport<SimTransport>>);
  static_assert(cpdispatch::PieceTransport<ChecksummedTransport<SimTransport>>);
  static_assert(cpdispatch::PostedAllToAllTransport<ChecksummedTransport<SimTransport>>);
  static_assert(!cpdispatch::PieceTransport<ChecksummedTransport<SimPackingTransport>>);
  static_assert(cpdispatch::PostedAllToAllTransport<ChecksummedTransport<SimPackingTransport>>);
  static_assert(cpdispatch::Transport<ChecksummedTransport<FaultInjectingTransport<SimTransport>>>);
  SUCCEED();
}

}  // namespace
