// SimulatedLinkTransport: data passes through unchanged, and the modelled
// time is spent. The timing checks are lower bounds only: the adapter sleeps
// until a computed deadline, and sleep_until never returns before it, so they
// cannot fail on a slow or loaded machine.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "cpdispatch/adapters/simulated_link.hpp"
#include "cpdispatch/transports/sim.hpp"

using cpdispatch::ElementType;
using cpdispatch::ReduceOp;
using cpdispatch::SimOptions;
using cpdispatch::SimTransport;
using cpdispatch::SimWorld;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

static_assert(cpdispatch::Transport<cpdispatch::SimulatedLinkTransport<SimTransport>>);

TEST(SimulatedLink, PointToPointDeliversTheDataAfterLatencyPlusBytesOverBandwidth) {
  // 40 000 bytes at 20 MB/s: 2 ms on the link, then 1 ms of latency; sent twice back to back.
  const cpdispatch::LinkModel model{1ms, 20e6};
  const std::size_t count = 10000;
  Clock::time_point posted;  // written by rank 0 before it sends; read by rank 1 once the data has arrived
  SimWorld world(2, SimOptions{60s});
  world.run([&](SimTransport& sim) {
    cpdispatch::SimulatedLinkTransport link(sim, model);
    EXPECT_EQ(link.rank(), sim.rank());
    EXPECT_EQ(link.world_size(), 2);
    std::vector<float> first(count), second(count);
    if (sim.rank() == 0) {
      std::iota(first.begin(), first.end(), 0.0f);
      std::iota(second.begin(), second.end(), 1e5f);
      posted = Clock::now();
      const auto r1 = link.isend(first.data(), count * sizeof(float), 1, 5);
      const auto r2 = link.isend(second.data(), count * sizeof(float), 1, 5);
      link.wait(r1);
      EXPECT_GE(Clock::now() - posted, 2ms);  // the link transmitted the first message
      link.wait(r2);
      EXPECT_GE(Clock::now() - posted, 4ms);  // and then the second: one link per rank
    } else {
      const auto r1 = link.irecv(first.data(), count * sizeof(float), 0, 5);
      const auto r2 = link.irecv(second.data(), count * sizeof(float), 0, 5);
      link.wait(r1);
      EXPECT_GE(Clock::now() - posted, 3ms) << "first message: 2 ms on the link + 1 ms latency";
      link.wait(r2);
      EXPECT_GE(Clock::now() - posted, 5ms) << "second message: after the first on the link";
      for (std::size_t i = 0; i < count; ++i) {
        ASSERT_EQ(first[i], static_cast<float>(i));
        ASSERT_EQ(second[i], 1e5f + static_cast<float>(i));
      }
    }
  });
}

// One exchange in which rank 0 sends 2000 bytes to rank 1, then one in which
// rank 1 sends as much back, posted back to back: on a full-duplex link the
// second's bytes move on the other side of each rank's link while the first's
// are still on theirs, so both are done 10 s (2000 B at 200 B/s) after the
// second post, not 20 s after the first. (The schedule is checked, not slept:
// the requests are never waited for.)
TEST(SimulatedLink, ExchangesPostedBackToBackUseBothSidesOfTheLinkAtOnce) {
  const cpdispatch::LinkModel model{0ns, 200.0};
  SimWorld world(2, SimOptions{60s});
  world.run([&](SimTransport& sim) {
    cpdispatch::SimulatedLinkTransport link(sim, model);
    const std::size_t me = static_cast<std::size_t>(sim.rank()), peer = 1 - me;
    std::vector<char> out(2000, 'x'), in(2000);
    const std::vector<std::size_t> zero(2, 0);
    std::vector<std::size_t> all(2, 0);
    all[peer] = 2000;
    const Clock::time_point before = Clock::now();
    (void)link.post_all_to_all_v(out.data(), me == 0 ? all : zero, zero, in.data(), me == 0 ? zero : all, zero);
    (void)link.post_all_to_all_v(out.data(), me == 1 ? all : zero, zero, in.data(), me == 1 ? zero : all, zero);
    const Clock::time_point after = Clock::now();
    EXPECT_GE(link.busy_until(), before + 10s);
    EXPECT_LE(link.busy_until(), after + 10s) << "the second exchange waited for the first's side of the link";
    sim.barrier();  // both ranks have posted, so every message has moved its bytes before the buffers go
  });
}

// A post is an enqueue, as on NCCL: rank 0's returns before rank 1 has
// posted its own (rank 1 waits for it first, bounded so that a post that
// waits for its peers fails instead of hanging). Rank 1 then posts 100 ms
// late; its 100 000 bytes take 50 ms on its link (2 MB/s), so rank 0 has
// them no sooner than 50 ms after rank 1's post, not 50 ms after its own.
TEST(SimulatedLink, APostReturnsBeforeItsPeersPostAndDeliversOnceTheirLinkHasSent) {
  const cpdispatch::LinkModel model{0ns, 2e6};
  const std::size_t bytes = 100000;
  std::atomic<bool> zero_posted{false};
  std::atomic<Clock::rep> one_posts_at{0};
  SimWorld world(2, SimOptions{60s});
  world.run([&](SimTransport& sim) {
    cpdispatch::SimulatedLinkTransport link(sim, model);
    const std::size_t me = static_cast<std::size_t>(sim.rank()), peer = 1 - me;
    std::vector<char> out(bytes, static_cast<char>('a' + me)), in(bytes);
    std::vector<std::size_t> counts(2, 0), displs(2, 0);
    counts[peer] = bytes;
    if (me == 1) {
      const Clock::time_point give_up = Clock::now() + 10s;
      while (!zero_posted && Clock::now() < give_up) std::this_thread::sleep_for(1ms);
      EXPECT_TRUE(zero_posted) << "rank 0's post waited for rank 1's";
      std::this_thread::sleep_for(100ms);
      one_posts_at = Clock::now().time_since_epoch().count();
    }
    const cpdispatch::Request request = link.post_all_to_all_v(out.data(), counts, displs, in.data(), counts, displs);
    if (me == 0) zero_posted = true;
    link.wait(request);
    if (me == 0) {
      EXPECT_GE(Clock::now(), Clock::time_point(Clock::duration(one_posts_at)) + 50ms) << "rank 1's link sent its bytes from its post on";
    }
    EXPECT_THAT(in, testing::Each(static_cast<char>('a' + peer)));
  });
}

TEST(SimulatedLink, APostNamesCountsThatDoNotFitTheWorld) {
  SimWorld world(2, SimOptions{60s});
  world.run([&](SimTransport& sim) {
    cpdispatch::SimulatedLinkTransport link(sim, cpdispatch::LinkModel{0ns, 1e9});
    std::vector<char> out(8), in(8);
    const std::vector<std::size_t> three(3, 0), zero(2, 0);
    std::vector<std::size_t> self(2, 0);
    self[static_cast<std::size_t>(sim.rank())] = 4;
    const auto refused = [&](std::span<const std::size_t> sc, std::span<const std::size_t> rd) -> std::string {
      try {
        (void)link.post_all_to_all_v(out.data(), sc, zero, in.data(), zero, rd);
      } catch (const cpdispatch::invalid_input& e) {
        return e.what();
      }
      return "accepted";
    };
    EXPECT_THAT(refused(zero, three), testing::HasSubstr("recv_displs has 3 entries, world_size = 2"));
    EXPECT_THAT(refused(self, zero), testing::HasSubstr(std::string("send_counts[") + std::to_string(sim.rank()) + "] = 4 bytes to itself, but recv_counts"));
  });
}

TEST(SimulatedLink, CollectivesPassTheDataAndTakeTheRingTime) {
  const cpdispatch::LinkModel model{500us, 10e6};  // 4 000 bytes per block: 0.4 ms + 0.5 ms per ring step
  SimWorld world(3, SimOptions{60s});
  world.run([&](SimTransport& sim) {
    cpdispatch::SimulatedLinkTransport link(sim, model);
    const auto r = static_cast<float>(sim.rank());
    const std::size_t block = 1000;
    std::vector<float> send(3 * block, r + 1), recv(block), gathered(3 * block);
    auto t0 = Clock::now();
    link.reduce_scatter(send.data(), recv.data(), block, ElementType::float32, ReduceOp::sum);
    EXPECT_GE(Clock::now() - t0, 2 * (500us + 400us));
    EXPECT_THAT(recv, testing::Each(6.0f));
    t0 = Clock::now();
    link.all_gather(recv.data(), gathered.data(), block, ElementType::float32);
    EXPECT_GE(Clock::now() - t0, 2 * (500us + 400us));
    EXPECT_THAT(gathered, testing::Each(6.0f));
    std::vector<double> sum(6, r);
    link.all_reduce(sum.data(), sum.size(), ElementType::float64, ReduceOp::sum);
    EXPECT_THAT(sum, testing::Each(3.0));
    std::vector<char> bytes(16, static_cast<char>(sim.rank() == 2 ? 'x' : '-'));
    link.broadcast(bytes.data(), bytes.size(), 2);
    EXPECT_THAT(bytes, testing::Each('x'));
    link.barrier();
    // all_to_all_v: rank r sends r + 1 bytes to every rank.
    const std::vector<std::size_t> send_counts(3, sim.rank() + 1u), send_displs{0, sim.rank() + 1u, 2 * (sim.rank() + 1u)};
    const std::vector<std::size_t> recv_counts{1, 2, 3}, recv_displs{0, 1, 3};
    std::vector<char> out(3 * (sim.rank() + 1u), static_cast<char>('a' + sim.rank())), in(6);
    link.all_to_all_v(out.data(), send_counts, send_displs, in.data(), recv_counts, recv_displs);
    EXPECT_EQ(std::string(in.begin(), in.end()), "abbccc");
  });
}

TEST(SimulatedLink, CountsTheBytesEachRankSendsAndReceives) {
  SimWorld world(3, SimOptions{60s});
  std::vector<std::uint64_t> sent(3), received(3);
  world.run([&](cpdispatch::SimTransport& sim) {
    cpdispatch::SimulatedLinkTransport link(sim, cpdispatch::LinkModel{0ns, 1e12});
    const auto me = static_cast<std::size_t>(link.rank());
    // all_to_all_v: rank r sends 10 * (p + 1) bytes to each peer p, and 100 to itself (not counted).
    std::vector<std::size_t> counts(3), displs(3), recv_counts(3, 10 * (me + 1)), recv_displs(3);
    std::size_t total = 0;
    for (std::size_t p = 0; p < 3; ++p) {
      counts[p] = p == me ? 100 : 10 * (p + 1);
      displs[p] = total;
      total += counts[p];
    }
    recv_counts[me] = 100;
    for (std::size_t p = 1; p < 3; ++p) recv_displs[p] = recv_displs[p - 1] + recv_counts[p - 1];
    std::vector<std::byte> out(total), in(recv_displs[2] + recv_counts[2]);
    link.all_to_all_v(out.data(), counts, displs, in.data(), recv_counts, recv_displs);
    // A ring of 7-byte messages, and an all_gather of 4 floats per rank (2 ring steps of 16 bytes).
    const std::byte msg[7] = {};
    std::byte got[7];
    const int next = (link.rank() + 1) % 3, prev = (link.rank() + 2) % 3;
    const auto r = link.irecv(got, 7, prev, 0);
    const auto s = link.isend(msg, 7, next, 0);
    link.wait(r);
    link.wait(s);
    const float mine[4] = {};
    float all[12];
    link.all_gather(mine, all, 4, cpdispatch::ElementType::float32);
    sent[me] = link.bytes_sent();
    received[me] = link.bytes_received();
  });
  for (std::size_t r = 0; r < 3; ++r) {
    std::uint64_t expected = 7 + 2 * 16;
    for (std::size_t p = 0; p < 3; ++p) expected += p == r ? 0 : 10 * (p + 1);
    EXPECT_EQ(sent[r], expected) << "rank " << r;
    EXPECT_EQ(received[r], 7 + 2 * 16 + 2 * 10 * (r + 1)) << "rank " << r;  // each peer sends it 10 * (r + 1)
  }
}

TEST(SimulatedLink, BadModelsAndRequestsAreRejected) {
  SimWorld world(1);
  world.run([&](SimTransport& sim) {
    EXPECT_THROW(cpdispatch::SimulatedLinkTransport(sim, cpdispatch::LinkModel{0ns, 0.0}), cpdispatch::invalid_input);
    EXPECT_THROW(cpdispatch::SimulatedLinkTransport(sim, cpdispatch::LinkModel{-1ns, 1e9}), cpdispatch::invalid_input);
    cpdispatch::SimulatedLinkTransport link(sim, cpdispatch::LinkModel{});
    try {
      link.wait(cpdispatch::Request{99});
      ADD_FAILURE() << "an unknown request was waited for";
    } catch (const cpdispatch::invalid_input& e) {
      EXPECT_THAT(e.what(), testing::HasSubstr("request 99 is not pending on rank 0"));
    }
    // One rank: a message to itself, and collectives that cost nothing.
    int x = 5, y = 0;
    const auto rr = link.irecv(&y, sizeof y, 0, 1);
    const auto sr = link.isend(&x, sizeof x, 0, 1);
    link.wait(sr);
    link.wait(rr);
    EXPECT_EQ(y, 5);
  });
}

// Two tiers: ranks 0, 1 on node 0 and 2, 3 on node 1; the inter-node link is
// slower in both latency and bandwidth, so a bound that only the right tier
// meets shows which tier a transfer used.
namespace {
const cpdispatch::LinkModel kIntra{1ms, 100e6};  // 20 000 bytes: 0.2 ms + 1 ms
const cpdispatch::LinkModel kInter{4ms, 10e6};   // 20 000 bytes: 2 ms + 4 ms
constexpr std::size_t kMessage = 20000;

cpdispatch::SimulatedLinkTransport<SimTransport> two_tiers(SimTransport& sim) {
  return {sim, cpdispatch::Topology::uniform(4, 2), kIntra, kInter};
}

/// An all_to_all_v in which rank r sends `kMessage` bytes of value r to `peer(r)` only; checks the bytes and returns the time it took.
template <class Peer>
Clock::duration exchange_with(cpdispatch::SimulatedLinkTransport<SimTransport>& link, Peer peer) {
  const int me = link.rank();
  std::vector<std::size_t> send_counts(4, 0), recv_counts(4, 0), displs(4, 0);
  send_counts[static_cast<std::size_t>(peer(me))] = kMessage;
  for (int p = 0; p < 4; ++p) {
    if (peer(p) == me) recv_counts[static_cast<std::size_t>(p)] = kMessage;
  }
  std::vector<char> out(kMessage, static_cast<char>('a' + me)), in(kMessage, '-');
  const auto t0 = Clock::now();
  link.all_to_all_v(out.data(), send_counts, displs, in.data(), recv_counts, displs);
  const auto took = Clock::now() - t0;
  // The peers below pair ranks up (peer(peer(r)) = r): r receives from the rank it sends to.
  EXPECT_THAT(in, testing::Each(static_cast<char>('a' + peer(me))));
  return took;
}
}  // namespace

TEST(SimulatedLink, TwoTiersMessagesTakeTheTimeOfTheirTier) {
  Clock::time_point posted[3];  // written by rank 0 before each send; read by the receiver once the data has arrived
  SimWorld world(4, SimOptions{60s});
  world.run([&](SimTransport& sim) {
    auto link = two_tiers(sim);
    EXPECT_EQ(link.inter_model().latency, kInter.latency);
    ASSERT_NE(link.topology(), nullptr);
    std::vector<int> data(kMessage / sizeof(int));
    if (sim.rank() == 0) {  // to rank 1 inside node 0, then to rank 2 on node 1
      std::iota(data.begin(), data.end(), 7);
      for (const int peer : {1, 2}) {
        posted[peer] = Clock::now();
        link.wait(link.isend(data.data(), kMessage, peer, 3));
        EXPECT_GE(Clock::now() - posted[peer], peer == 1 ? 200us : 2ms) << "transmitting to rank " << peer;
      }
    } else if (sim.rank() == 1 || sim.rank() == 2) {
      link.wait(link.irecv(data.data(), kMessage, 0, 3));
      EXPECT_GE(Clock::now() - posted[sim.rank()], sim.rank() == 1 ? 1200us : 6ms) << "transmission + latency of the tier";
      for (std::size_t i = 0; i < data.size(); ++i) ASSERT_EQ(data[i], static_cast<int>(i) + 7);
    }
    EXPECT_EQ(link.bytes_sent(), sim.rank() == 0 ? 2 * kMessage : 0u);
    EXPECT_EQ(link.bytes_received(), sim.rank() == 1 || sim.rank() == 2 ? kMessage : 0u);
  });
}

TEST(SimulatedLink, TwoTiersAllToAllTakesTheTimeOfTheTiersItUses) {
  SimWorld world(4, SimOptions{60s});
  world.run([&](SimTransport& sim) {
    auto link = two_tiers(sim);
    const Clock::duration inside = exchange_with(link, [](int r) { return r ^ 1; });  // the other rank of the node
    EXPECT_GE(inside, 1200us);
    const Clock::duration across = exchange_with(link, [](int r) { return (r + 2) % 4; });  // the same place on the other node
    EXPECT_GE(across, 6ms);
    const auto t0 = Clock::now();
    std::vector<char> out(kMessage), in(kMessage);  // the caller's until the wait: the post only enqueues
    const cpdispatch::Request posted = [&] {
      std::vector<std::size_t> counts(4, 0), displs(4, 0);
      counts[static_cast<std::size_t>((sim.rank() + 2) % 4)] = kMessage;
      return link.post_all_to_all_v(out.data(), counts, displs, in.data(), counts, displs);
    }();
    link.wait(posted);
    EXPECT_GE(Clock::now() - t0, 6ms) << "a posted all-to-all across nodes";
    EXPECT_EQ(link.bytes_sent(), 3 * kMessage);
    EXPECT_EQ(link.bytes_received(), 3 * kMessage);
  });
}

TEST(SimulatedLink, TwoTiersCollectivesRunAtTheSlowerTier) {
  SimWorld world(4, SimOptions{60s});
  world.run([&](SimTransport& sim) {
    auto link = two_tiers(sim);
    const float mine[1000] = {static_cast<float>(sim.rank())};
    std::vector<float> all(4000);
    const auto t0 = Clock::now();
    link.all_gather(mine, all.data(), 1000, ElementType::float32);
    EXPECT_GE(Clock::now() - t0, 3 * (4ms + 400us)) << "three ring steps of 4 000 bytes over the inter-node link";
    for (int r = 0; r < 4; ++r) EXPECT_EQ(all[static_cast<std::size_t>(r) * 1000], static_cast<float>(r));
  });
}

TEST(SimulatedLink, TwoTiersRejectBadTopologiesAndLinks) {
  SimWorld world(4, SimOptions{60s});
  world.run([&](SimTransport& sim) {
    const auto refused = [&](const cpdispatch::Topology& t, cpdispatch::LinkModel intra, cpdispatch::LinkModel inter) -> std::string {
      try {
        cpdispatch::SimulatedLinkTransport link(sim, t, intra, inter);
      } catch (const cpdispatch::invalid_input& e) {
        return e.what();
      }
      return "accepted";
    };
    const auto pairs = cpdispatch::Topology::uniform(4, 2);
    EXPECT_THAT(refused(cpdispatch::Topology::uniform(3, 2), kIntra, kInter), testing::HasSubstr("topology describes 3 ranks, but world_size = 4"));
    EXPECT_THAT(refused(cpdispatch::Topology::from_nodes({0, 1, 0, 1, 2}), kIntra, kInter), testing::HasSubstr("topology describes 5 ranks"));
    EXPECT_THAT(refused(pairs, {1ms, 0.0}, kInter), testing::HasSubstr("intra bandwidth = 0"));
    EXPECT_THAT(refused(pairs, kIntra, {1ms, -5.0}), testing::HasSubstr("inter bandwidth = -5"));
    EXPECT_THAT(refused(pairs, {-1ns, 1e9}, kInter), testing::HasSubstr("intra latency = -1 ns"));
    EXPECT_THAT(refused(pairs, kIntra, {-2ns, 1e9}), testing::HasSubstr("inter latency = -2 ns"));
    EXPECT_EQ(refused(pairs, kIntra, kInter), "accepted");
  });
}
