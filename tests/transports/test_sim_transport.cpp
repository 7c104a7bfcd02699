// The in-process transport: every member of the Transport concept, the
// failure handling (abort, rank named, no hang), and the timeout.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cpdispatch/transports/sim.hpp"
#include "dispatch_helpers.hpp"

namespace {

using cpdispatch::ElementType;
using cpdispatch::ReduceOp;
using cpdispatch::Request;
using cpdispatch::SimOptions;
using cpdispatch::SimTransport;
using cpdispatch::SimWorld;
using cptest::Bytes;
using ::testing::HasSubstr;

// A safety net: a bug must fail a test, not hang it.
SimOptions guarded() { return SimOptions{std::chrono::milliseconds(60000)}; }

class SimWorldSizes : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(Ranks, SimWorldSizes, ::testing::Values(1, 2, 3, 4, 7, 16));

TEST_P(SimWorldSizes, RankAndWorldSize) {
  const int W = GetParam();
  SimWorld world(W, guarded());
  std::vector<int> seen(static_cast<std::size_t>(W), -1);
  world.run([&](SimTransport& t) {
    EXPECT_EQ(t.world_size(), W);
    seen[static_cast<std::size_t>(t.rank())] = t.rank();
  });
  for (int r = 0; r < W; ++r) EXPECT_EQ(seen[static_cast<std::size_t>(r)], r);
}

TEST_P(SimWorldSizes, AllToAllVMovesEveryPieceToItsPlace) {
  const int W = GetParam();
  const auto U = static_cast<std::size_t>(W);
  // bytes[s][d]: what s sends d; laid out in reverse peer order on both sides.
  auto bytes = [](std::size_t s, std::size_t d) { return (s * 7 + d * 3) % 5 * 4 + (s == d ? 1 : 0); };
  std::vector<Bytes> got(U);
  SimWorld world(W, guarded());
  world.run([&](SimTransport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    std::vector<std::size_t> sc(U), sd(U), rc(U), rd(U);
    std::size_t so = 0, ro = 0;
    for (std::size_t p = U; p-- > 0;) {
      sc[p] = bytes(r, p), sd[p] = so, so += sc[p];
      rc[p] = bytes(p, r), rd[p] = ro, ro += rc[p];
    }
    Bytes send(so), recv(ro, std::byte{0});
    for (std::size_t p = 0; p < U; ++p)
      for (std::size_t i = 0; i < sc[p]; ++i) send[sd[p] + i] = static_cast<std::byte>(r * 16 + p + i * 64);
    for (int rep = 0; rep < 3; ++rep) t.all_to_all_v(send.data(), sc, sd, recv.data(), rc, rd);
    got[r] = recv;
    for (std::size_t p = 0; p < U; ++p)
      for (std::size_t i = 0; i < rc[p]; ++i) EXPECT_EQ(recv[rd[p] + i], static_cast<std::byte>(p * 16 + r + i * 64)) << r << " from " << p;
  });
}

TEST_P(SimWorldSizes, AllToAllPiecesLaysEachStreamOverTheReceiversPieces) {
  const int W = GetParam();
  const auto U = static_cast<std::size_t>(W);
  auto bytes = [](std::size_t s, std::size_t d) { return (s * 5 + d * 3) % 7 * 3 + 1; };
  SimWorld world(W, guarded());
  world.run([&](SimTransport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    // Send: peer p's bytes as pieces of 2 bytes, every other byte of a wide
    // buffer, peers in reverse order. Receive: pieces of 3 bytes with gaps.
    std::vector<cpdispatch::BytePiece> sp, rp;
    std::vector<std::size_t> ss{0}, rs{0};
    Bytes send(1), recv(1, std::byte{0xEE});
    std::vector<std::vector<std::size_t>> at(U);  // where the bytes from each peer land
    for (std::size_t p = 0; p < U; ++p) {
      for (std::size_t i = 0; i < bytes(r, p); i += 2) {
        const std::size_t n = std::min<std::size_t>(2, bytes(r, p) - i);
        sp.push_back({send.size() + 1, n});
        for (std::size_t k = 0; k < n + 1; ++k) send.push_back(static_cast<std::byte>(k < 1 ? 0 : r * 16 + p + (i + k - 1) * 64));
      }
      ss.push_back(sp.size());
      for (std::size_t i = 0; i < bytes(p, r); i += 3) {
        const std::size_t n = std::min<std::size_t>(3, bytes(p, r) - i);
        rp.push_back({recv.size(), n});
        for (std::size_t k = 0; k < n; ++k) at[p].push_back(recv.size() + k);
        recv.resize(recv.size() + n + 2, std::byte{0xEE});
      }
      rs.push_back(rp.size());
    }
    t.all_to_all_pieces(send.data(), sp, ss, recv.data(), rp, rs);
    for (std::size_t p = 0; p < U; ++p)
      for (std::size_t i = 0; i < at[p].size(); ++i) EXPECT_EQ(recv[at[p][i]], static_cast<std::byte>(p * 16 + r + i * 64)) << r << " from " << p;
  });
}

TEST(SimTransport, AllToAllPiecesChecksItsArguments) {
  SimWorld world(2, guarded());
  using cpdispatch::BytePiece;
  EXPECT_THAT(cptest::message_of<cpdispatch::invalid_input>([&] {
                world.run([&](SimTransport& t) {
                  Bytes b(8);
                  std::vector<BytePiece> four{{0, 4}}, two{{0, 2}};
                  const std::vector<std::size_t> to_rank_1{0, 0, 1}, from_rank_0{0, 1, 1}, none{0, 0, 0};
                  if (t.rank() == 0) t.all_to_all_pieces(b.data(), four, to_rank_1, b.data(), two, none);
                  else t.all_to_all_pieces(b.data(), four, none, b.data(), two, from_rank_0);
                });
              }),
              HasSubstr("all_to_all_pieces on rank 1 of 2: rank 0 sends 4 bytes to rank 1, whose pieces for it hold 2"));
  EXPECT_THAT(cptest::message_of<cpdispatch::invalid_input>([&] {
                world.run([&](SimTransport& t) {
                  Bytes b(8);
                  std::vector<BytePiece> one{{0, 4}};
                  std::vector<std::size_t> bad{0, 2, 1}, ok{0, 0, 0};
                  t.all_to_all_pieces(b.data(), one, t.rank() == 1 ? bad : ok, b.data(), one, ok);
                });
              }),
              HasSubstr("all_to_all_pieces on rank 1 of 2: send_splits[0..1] = 0..2 is not a range of the 1 pieces"));
}

TEST_P(SimWorldSizes, BarrierAndBroadcast) {
  const int W = GetParam();
  std::atomic<int> before{0};
  SimWorld world(W, guarded());
  world.run([&](SimTransport& t) {
    ++before;
    t.barrier();
    EXPECT_EQ(before.load(), W);  // nobody leaves the barrier before all arrived
    for (int root = 0; root < W; ++root) {
      std::vector<std::int32_t> v(5, t.rank() == root ? 100 + root : -1);
      t.broadcast(v.data(), v.size() * sizeof(std::int32_t), root);
      EXPECT_THAT(v, ::testing::Each(100 + root));
    }
  });
}

template <class E>
Bytes as_bytes(const std::vector<E>& v) {
  Bytes b(v.size() * sizeof(E));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

TEST_P(SimWorldSizes, AllReduceSumsInRankOrderForEveryType) {
  const int W = GetParam();
  SimWorld world(W, guarded());
  world.run([&](SimTransport& t) {
    const int r = t.rank();
    {
      std::vector<std::int8_t> v{static_cast<std::int8_t>(r), static_cast<std::int8_t>(100), -1};
      t.all_reduce(v.data(), v.size(), ElementType::int8, ReduceOp::sum);
      EXPECT_EQ(v[0], static_cast<std::int8_t>(W * (W - 1) / 2));
      EXPECT_EQ(v[1], static_cast<std::int8_t>(static_cast<std::uint8_t>(100 * W)));  // wraps around
      EXPECT_EQ(v[2], static_cast<std::int8_t>(-W));
    }
    {
      std::vector<std::uint8_t> v{static_cast<std::uint8_t>(r + 1)};
      t.all_reduce(v.data(), 1, ElementType::uint8, ReduceOp::sum);
      EXPECT_EQ(v[0], static_cast<std::uint8_t>(W * (W + 1) / 2));
    }
    {
      std::vector<std::int32_t> v{r, -2 * r, 7};
      t.all_reduce(v.data(), v.size(), ElementType::int32, ReduceOp::sum);
      EXPECT_EQ(v, (std::vector<std::int32_t>{W * (W - 1) / 2, -W * (W - 1), 7 * W}));
    }
    {
      std::vector<std::int64_t> v{std::int64_t{1} << 40, r};
      t.all_reduce(v.data(), v.size(), ElementType::int64, ReduceOp::sum);
      EXPECT_EQ(v[0], (std::int64_t{1} << 40) * W);
      EXPECT_EQ(v[1], W * (W - 1) / 2);
    }
    {
      // Rank order matters for floats: 1e8 + 1 + 1 ... - 1e8 in fp32.
      std::vector<float> v{r == 0 ? 1e8f : (r == W - 1 && W > 1 ? -1e8f : 1.0f), 0.5f};
      t.all_reduce(v.data(), v.size(), ElementType::float32, ReduceOp::sum);
      float expect = 1e8f;
      for (int s = 1; s < W; ++s) expect += (s == W - 1 ? -1e8f : 1.0f);
      EXPECT_EQ(v[0], expect);
      EXPECT_EQ(v[1], 0.5f * static_cast<float>(W));
    }
    {
      std::vector<double> v{0.25 * r};
      t.all_reduce(v.data(), 1, ElementType::float64, ReduceOp::sum);
      EXPECT_EQ(v[0], 0.25 * W * (W - 1) / 2);
    }
    {
      // 16-bit floats accumulate in fp32 and round once: 256 + 1 + 1 + ... in
      // bfloat16 would stay 256 (8-bit mantissa); in fp32 it counts.
      std::vector<cpdispatch::bfloat16> v{cpdispatch::bfloat16(r == 0 ? 256.0f : 1.0f)};
      t.all_reduce(v.data(), 1, ElementType::bfloat16, ReduceOp::sum);
      EXPECT_EQ(static_cast<float>(v[0]), static_cast<float>(cpdispatch::bfloat16(256.0f + static_cast<float>(W - 1))));
      std::vector<cpdispatch::float16> h{cpdispatch::float16(r == 0 ? 2048.0f : 1.0f)};
      t.all_reduce(h.data(), 1, ElementType::float16, ReduceOp::sum);
      EXPECT_EQ(static_cast<float>(h[0]), static_cast<float>(cpdispatch::float16(2048.0f + static_cast<float>(W - 1))));
    }
  });
}

TEST_P(SimWorldSizes, AllGatherAndReduceScatter) {
  const int W = GetParam();
  const auto U = static_cast<std::size_t>(W);
  SimWorld world(W, guarded());
  world.run([&](SimTransport& t) {
    const int r = t.rank();
    std::vector<std::int32_t> mine{r, 10 * r};
    std::vector<std::int32_t> all(2 * U, -1);
    t.all_gather(mine.data(), all.data(), 2, ElementType::int32);
    for (int s = 0; s < W; ++s) {
      EXPECT_EQ(all[2 * static_cast<std::size_t>(s)], s);
      EXPECT_EQ(all[2 * static_cast<std::size_t>(s) + 1], 10 * s);
    }
    std::vector<float> send(3 * U);
    for (std::size_t i = 0; i < send.size(); ++i) send[i] = static_cast<float>(i) + static_cast<float>(r);
    std::vector<float> recv(3, -1.0f);
    t.reduce_scatter(send.data(), recv.data(), 3, ElementType::float32, ReduceOp::sum);
    for (std::size_t i = 0; i < 3; ++i) {
      const float expect = static_cast<float>(W) * static_cast<float>(3 * static_cast<std::size_t>(r) + i) + static_cast<float>(W * (W - 1) / 2);
      EXPECT_EQ(recv[i], expect);
    }
  });
}

TEST(SimTransport, PointToPointMatchesBySourceAndDestinationInPostingOrderWhateverTheTags) {
  SimWorld world(3, guarded());
  world.run([&](SimTransport& t) {
    const int r = t.rank();
    if (r == 0) {
      // Receives posted before the sends exist, labelled differently from the
      // sends: tags take no part in matching (transport.hpp's contract).
      std::int32_t a = 0, b = 0, c = 0, d = 0;
      Request rb = t.irecv(&b, 4, 1, /*tag=*/7);
      Request ra = t.irecv(&a, 4, 1, /*tag=*/5);
      Request rc = t.irecv(&c, 4, 1, /*tag=*/5);  // second message with tag 5
      Request rd = t.irecv(&d, 4, 2, /*tag=*/5);
      t.barrier();
      t.wait(rd);
      t.wait(rc);
      t.wait(ra);
      t.wait(rb);
      EXPECT_EQ(b, 51);  // rank 1's first message
      EXPECT_EQ(a, 71);  // its second
      EXPECT_EQ(c, 52);  // its third
      EXPECT_EQ(d, 25);
    } else if (r == 1) {
      std::int32_t x = 51, y = 52, z = 71;
      t.barrier();
      Request s1 = t.isend(&x, 4, 0, 5);
      Request s2 = t.isend(&z, 4, 0, 7);
      Request s3 = t.isend(&y, 4, 0, 5);
      t.wait(s1);
      t.wait(s2);
      t.wait(s3);
    } else {
      std::int32_t x = 25;
      Request s = t.isend(&x, 4, 0, 5);  // posted before the receive
      t.barrier();
      t.wait(s);
    }
    // A ring, sends first, to oneself included.
    const int W = t.world_size();
    std::int64_t out = 1000 + r, in = -1, self_in = -1;
    Request s = t.isend(&out, sizeof out, (r + 1) % W, 0);
    Request ss = t.isend(&out, sizeof out, r, 1);
    Request q = t.irecv(&in, sizeof in, (r + W - 1) % W, 0);
    Request qs = t.irecv(&self_in, sizeof self_in, r, 1);
    t.wait(q);
    t.wait(s);
    t.wait(qs);
    t.wait(ss);
    EXPECT_EQ(in, 1000 + (r + W - 1) % W);
    EXPECT_EQ(self_in, 1000 + r);
  });
}

TEST(SimTransport, MismatchedMessageSizesAreAnError) {
  SimWorld world(2, guarded());
  const std::string msg = cptest::message_of<cpdispatch::invalid_input>([&] {
    world.run([&](SimTransport& t) {
      std::int64_t v = 0;
      Request q = t.rank() == 0 ? t.isend(&v, 8, 1, 3) : t.irecv(&v, 4, 0, 3);
      t.wait(q);
    });
  });
  EXPECT_THAT(msg, HasSubstr("rank 0 sends 8 bytes with tag 3 to rank 1, which receives 4"));
}

TEST(SimTransport, ArgumentErrorsNameTheCall) {
  SimWorld world(2, guarded());
  EXPECT_THAT(cptest::message_of<cpdispatch::invalid_input>([&] {
                world.run([&](SimTransport& t) {
                  std::vector<std::size_t> two(2), one(1);
                  Bytes b(4);
                  t.all_to_all_v(b.data(), two, two, b.data(), t.rank() == 1 ? one : two, two);
                });
              }),
              HasSubstr("all_to_all_v on rank 1 of 2: recv_counts has 1 entries, world_size is 2"));
  EXPECT_THAT(cptest::message_of<cpdispatch::invalid_input>([&] {
                world.run([&](SimTransport& t) {
                  std::vector<std::size_t> sc{0, 0}, rc{0, 0}, zero{0, 0};
                  if (t.rank() == 0) sc[1] = 4;  // rank 1 expects nothing
                  Bytes b(8);
                  t.all_to_all_v(b.data(), sc, zero, b.data(), rc, zero);
                });
              }),
              HasSubstr("rank 0 sends 4 bytes to rank 1, which expects recv_counts[0] = 0"));
  EXPECT_THAT(cptest::message_of<cpdispatch::invalid_input>([&] {
                world.run([&](SimTransport& t) {
                  int v = 0;
                  t.wait(t.isend(&v, 4, 2, 0));
                });
              }),
              HasSubstr("peer 2 is outside [0, 2)"));
  EXPECT_THAT(cptest::message_of<cpdispatch::invalid_input>([&] {
                world.run([&](SimTransport& t) { t.wait(Request{12345}); });
              }),
              HasSubstr("request 12345 is not pending"));
}

TEST(SimTransport, MismatchedCollectivesAreAnErrorNamingBoth) {
  SimWorld world(3, guarded());
  const std::string msg = cptest::message_of<cpdispatch::invalid_input>([&] {
    world.run([&](SimTransport& t) {
      std::vector<float> v(4);
      if (t.rank() == 2) t.all_reduce(v.data(), 3, ElementType::float32, ReduceOp::sum);
      else t.all_reduce(v.data(), 4, ElementType::float32, ReduceOp::sum);
    });
  });
  EXPECT_THAT(msg, HasSubstr("all_reduce of 3 float32"));
  EXPECT_THAT(msg, HasSubstr("all_reduce of 4 float32"));
  EXPECT_THAT(msg, HasSubstr("collectives must match"));
}

TEST(SimTransport, AWorldNeedsAtLeastOneRank) {
  for (int W : {0, -3}) {
    EXPECT_EQ(cptest::message_of<cpdispatch::invalid_input>([&] { SimWorld world(W); }),
              "SimWorld: world_size = " + std::to_string(W) + " must be at least 1");
  }
}

TEST(SimTransport, RunInsideARunIsAnErrorAndTheWorldStaysUsable) {
  SimWorld world(2, guarded());
  const std::string msg = cptest::message_of<cpdispatch::invalid_input>([&] {
    world.run([&](SimTransport& t) {
      if (t.rank() == 1) world.run([](SimTransport&) {});
    });
  });
  EXPECT_EQ(msg, "SimWorld rank 1 of 2: SimWorld::run: the world is already running");
  std::atomic<int> ran{0};
  world.run([&](SimTransport& t) {
    t.barrier();
    ++ran;
  });
  EXPECT_EQ(ran.load(), 2);
}

TEST(SimTransport, ARankThatThrowsAbortsTheWorldAndRunNamesIt) {
  for (int W : {2, 5, 16}) {
    SimWorld world(W, guarded());
    std::atomic<int> released{0};
    try {
      world.run([&](SimTransport& t) {
        if (t.rank() == W - 1) throw std::runtime_error("rank-specific failure");
        try {
          t.barrier();  // blocked: rank W-1 never arrives
        } catch (const cpdispatch::error& e) {
          EXPECT_THAT(e.what(), HasSubstr("aborted: rank " + std::to_string(W - 1) + " failed first (rank-specific failure)"));
          ++released;
          throw;
        }
      });
      ADD_FAILURE() << "run() did not throw";
    } catch (const cpdispatch::error& e) {
      EXPECT_THAT(e.what(), HasSubstr("SimWorld rank " + std::to_string(W - 1) + " of " + std::to_string(W) + ": rank-specific failure"));
      try {
        std::rethrow_if_nested(e);
        ADD_FAILURE() << "the original exception is not nested";
      } catch (const std::runtime_error& original) {
        EXPECT_STREQ(original.what(), "rank-specific failure");
      }
    }
    EXPECT_EQ(released.load(), W - 1);
    // The world can run again.
    world.run([&](SimTransport& t) { t.barrier(); });
  }
}

TEST(SimTransport, TheFirstExceptionKeepsItsKind) {
  SimWorld world(4, guarded());
  try {
    world.run([&](SimTransport& t) {
      if (t.rank() == 2) throw cpdispatch::backend_error("device lost", 77);
      t.barrier();
    });
    ADD_FAILURE() << "run() did not throw";
  } catch (const cpdispatch::backend_error& e) {
    EXPECT_EQ(e.code(), 77);
    EXPECT_THAT(e.what(), HasSubstr("SimWorld rank 2 of 4: device lost"));
  }
}

TEST(SimTransport, ARankThatReturnsWhileOthersWaitIsAnErrorNotAHang) {
  SimWorld world(3);  // no timeout: the detection must not depend on one
  EXPECT_THAT(cptest::message_of<cpdispatch::error>([&] {
                world.run([&](SimTransport& t) {
                  if (t.rank() != 1) t.barrier();
                });
              }),
              HasSubstr("cannot complete: rank 1 has returned from its function"));
  EXPECT_THAT(cptest::message_of<cpdispatch::invalid_input>([&] {
                world.run([&](SimTransport& t) {
                  std::int32_t v = 0;
                  if (t.rank() == 0) t.wait(t.irecv(&v, 4, 2, 0));
                });
              }),
              HasSubstr("irecv from rank 2 with tag 0 cannot complete: rank 2 has returned from its function"));
}

TEST(SimTransport, TimeoutNamesRankOperationAndBound) {
  SimWorld world(2, SimOptions{std::chrono::milliseconds(50)});
  try {
    world.run([&](SimTransport& t) {
      if (t.rank() == 1) {
        std::this_thread::sleep_for(std::chrono::milliseconds(500));  // late, but still arrives
      }
      std::vector<float> v(2, 1.0f);
      t.all_reduce(v.data(), 2, ElementType::float32, ReduceOp::sum);
    });
    ADD_FAILURE() << "run() did not throw";
  } catch (const cpdispatch::timeout_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("SimWorld rank 0 of 2: All-reduce timeout on rank 0 of 2 in all_reduce: not complete after 50 ms"));
  }
}

}  // namespace

namespace {

// run() from two threads at once: one runs, the other is refused (or runs
// after it). Before running_ was written under the world's mutex, the end of
// one run raced with the other's check; ThreadSanitizer reports that race.
TEST(SimTransport, RunFromTwoThreadsAtOnceIsRefusedOrSerialised) {
  SimWorld world(2, guarded());
  std::atomic<int> ran{0}, refused{0};
  auto runner = [&] {
    for (int i = 0; i < 50; ++i) {
      try {
        world.run([&](SimTransport& t) { t.barrier(); });
        ++ran;
      } catch (const cpdispatch::invalid_input& e) {
        EXPECT_THAT(e.what(), HasSubstr("the world is already running"));
        ++refused;
      }
    }
  };
  std::thread a(runner), b(runner);
  a.join();
  b.join();
  EXPECT_EQ(ran + refused, 100);
  EXPECT_GE(ran, 1);
  EXPECT_FALSE(world.running());
}

// Element counts whose byte size wraps around size_t are refused, not
// silently turned into short copies.
TEST(SimTransport, CollectiveByteSizesThatOverflowAreRefused) {
  SimWorld world(1, guarded());
  const std::size_t wraps = std::numeric_limits<std::size_t>::max() / 4 + 2;  // x 4 bytes = 8 after wrapping
  float buf[4] = {};
  auto expect_refused = [&](auto call) {
    EXPECT_THAT(cptest::message_of<cpdispatch::invalid_input>([&] { world.run([&](SimTransport& t) { call(t); }); }),
                HasSubstr("do not fit in memory"));
  };
  expect_refused([&](SimTransport& t) { t.all_reduce(buf, wraps, ElementType::float32, ReduceOp::sum); });
  expect_refused([&](SimTransport& t) { t.all_gather(buf, buf + 2, wraps, ElementType::float32); });
  expect_refused([&](SimTransport& t) { t.reduce_scatter(buf, buf + 2, wraps, ElementType::float32, ReduceOp::sum); });
}

}  // namespace
