#pragma once
// The counting global allocator of the test program allocation_test, for
// tests that bound a call's memory or that it allocates nothing:
// - while `counting_allocator::counting` is on, every operator new is counted
//   (in all, the most held at once, the largest single one), and any single
//   allocation above 1 GiB throws bad_alloc at once, so a planner that fails
//   to stop ends the test rather than taking the machine's memory;
// - while a thread's `thread_allocations::counting` is on, that thread's
//   allocations are counted (each rank thread of a SimWorld on its own).
// Include from exactly one translation unit of a test program: it replaces
// the global operator new and delete.

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <new>
#include <string>

#include "cpdispatch/error.hpp"

namespace thread_allocations {

inline thread_local bool counting = false;
inline thread_local std::size_t allocations = 0;

}  // namespace thread_allocations

namespace counting_allocator {

inline std::atomic<bool> counting{false};
inline std::atomic<std::size_t> total{0}, live{0}, peak{0}, largest{0};
constexpr std::size_t refused_size = std::size_t{1} << 30;

// Each block carries its size and its distance from the start of the
// malloc'd block in a header, so every form of delete (sized or not, aligned
// or not, nothrow) is counted and freed right.
constexpr std::size_t header = 2 * sizeof(std::size_t);

/// Keeps `value` at least `n`.
inline void raise_to(std::atomic<std::size_t>& value, std::size_t n) {
  std::size_t v = value.load();
  while (n > v && !value.compare_exchange_weak(v, n)) {
  }
}

inline void note(std::size_t n) {
  if (thread_allocations::counting) ++thread_allocations::allocations;
  if (!counting.load(std::memory_order_relaxed)) return;
  if (n > refused_size) throw std::bad_alloc();  // the planner did not stop first: EXPECTs below fail
  total += n;
  raise_to(peak, live.fetch_add(n) + n);
  raise_to(largest, n);
}

/// `n` bytes aligned to `align` (a power of two, at least the header's size).
inline void* counted_new(std::size_t n, std::size_t align = alignof(std::max_align_t)) {
  note(n);
  const std::size_t offset = align < header ? header : align;
  auto* block = static_cast<unsigned char*>(std::aligned_alloc(offset, (n + 2 * offset - 1) / offset * offset));
  if (block == nullptr) throw std::bad_alloc();
  unsigned char* p = block + offset;
  const std::size_t fields[2] = {counting.load(std::memory_order_relaxed) ? n : 0, offset};
  std::memcpy(p - header, fields, sizeof fields);
  return p;
}

inline void counted_delete(void* ptr) noexcept {
  if (ptr == nullptr) return;
  auto* p = static_cast<unsigned char*>(ptr);
  std::size_t fields[2];
  std::memcpy(fields, p - header, sizeof fields);
  live.fetch_sub(std::min(fields[0], live.load()));
  std::free(p - fields[1]);
}

}  // namespace counting_allocator

void* operator new(std::size_t n) { return counting_allocator::counted_new(n); }
void* operator new[](std::size_t n) { return counting_allocator::counted_new(n); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return counting_allocator::counted_new(n);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, const std::nothrow_t& t) noexcept { return operator new(n, t); }
void* operator new(std::size_t n, std::align_val_t a) { return counting_allocator::counted_new(n, static_cast<std::size_t>(a)); }
void* operator new[](std::size_t n, std::align_val_t a) { return counting_allocator::counted_new(n, static_cast<std::size_t>(a)); }
void operator delete(void* p) noexcept { counting_allocator::counted_delete(p); }
void operator delete[](void* p) noexcept { counting_allocator::counted_delete(p); }
void operator delete(void* p, std::size_t) noexcept { counting_allocator::counted_delete(p); }
void operator delete[](void* p, std::size_t) noexcept { counting_allocator::counted_delete(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { counting_allocator::counted_delete(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { counting_allocator::counted_delete(p); }
void operator delete(void* p, std::align_val_t) noexcept { counting_allocator::counted_delete(p); }
void operator delete[](void* p, std::align_val_t) noexcept { counting_allocator::counted_delete(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { counting_allocator::counted_delete(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { counting_allocator::counted_delete(p); }

namespace counting_allocator {

constexpr std::size_t hundred_mb = 100'000'000;

/// What running `f` allocated in all, the most it held at once, and its largest single allocation.
struct Counted {
  std::size_t total = 0, peak = 0, largest = 0;
};

inline Counted count(const std::function<void()>& f) {
  total = 0;
  live = 0;
  peak = 0;
  largest = 0;
  counting = true;
  try {
    f();
  } catch (...) {
    counting = false;
    throw;
  }
  counting = false;
  return {total.load(), peak.load(), largest.load()};
}

/// `f` throws invalid_input whose message holds every one of `parts`,
/// having allocated under 100 MB in all.
inline void expect_refused(const std::function<void()>& f, std::initializer_list<std::string> parts) {
  std::string message;
  const Counted used = count([&] {
    try {
      f();
    } catch (const cpdispatch::invalid_input& e) {
      message = e.what();
    }
  });
  ASSERT_FALSE(message.empty()) << "expected invalid_input";
  for (const std::string& part : parts) EXPECT_NE(message.find(part), std::string::npos) << "missing '" << part << "' in: " << message;
  EXPECT_LT(used.total, hundred_mb) << message;
}

}  // namespace counting_allocator
