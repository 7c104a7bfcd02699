// Per-rank planning at W = 16384 builds nothing of W x W size: every
// allocation made while planning one rank is counted (this program replaces
// the global operator new), and the largest one and the peak of live bytes
// must stay far below one dense [W][W+1] count matrix (2 GiB).

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

#include "cpdispatch/plan/generate.hpp"
#include "cpdispatch/plan/rank.hpp"

namespace {

std::atomic<bool> counting{false};
std::atomic<std::size_t> live{0}, peak{0}, largest{0};

void note_allocation(std::size_t n) {
  if (!counting.load(std::memory_order_relaxed)) return;
  const std::size_t now = live.fetch_add(n) + n;
  std::size_t p = peak.load();
  while (now > p && !peak.compare_exchange_weak(p, now)) {
  }
  std::size_t l = largest.load();
  while (n > l && !largest.compare_exchange_weak(l, n)) {
  }
}

}  // namespace

// Sized deallocation tells us how much is freed; the unsized forms are not
// counted (nothing under test frees through them with counting on).
void* operator new(std::size_t n) {
  note_allocation(n);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t n) noexcept {
  if (counting.load(std::memory_order_relaxed)) live.fetch_sub(std::min(n, live.load()));
  std::free(p);
}

namespace {

TEST(RankPlanningMemory, NoWorldSquaredStructureAt16384Ranks) {
  const std::int64_t W = 16384;
  cpdispatch::RandomDocumentsOptions o;
  o.world_size = W;
  o.num_documents = 16 * W / 4;  // about 16 shards per rank
  o.max_shards = 8;
  o.max_len = 512;
  const cpdispatch::QkvDocumentsPlan plan = cpdispatch::random_documents_plan(o, 7);
  counting = true;
  const cpdispatch::RankQkvMetadata mine = cpdispatch::plan_qkv_for_rank(plan, W / 2);
  counting = false;
  const std::size_t dense = static_cast<std::size_t>(W) * static_cast<std::size_t>(W + 1) * sizeof(std::int64_t);
  EXPECT_LT(largest.load(), dense / 64) << "largest allocation " << largest.load() << " bytes";
  EXPECT_LT(peak.load(), dense / 16) << "peak " << peak.load() << " bytes";
  EXPECT_EQ(mine.q_fwd.num_recv_tokens.size(), static_cast<std::size_t>(W + 1));
  EXPECT_GT(mine.kv_fwd.num_total_recv_tokens, 0);
}

}  // namespace
