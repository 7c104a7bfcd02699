#pragma once
// Counts each thread's allocations while that thread's `counting` is on: for
// tests that a call allocates nothing, on every rank thread of a SimWorld.
// Include from exactly one source file of a test program: it replaces the
// global operator new and delete.

// GCC sees malloc'd memory reach std::free through the replaced operators
// and, inlining them into the library's deallocations, calls it a mismatch.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

#include <cstddef>
#include <cstdlib>
#include <new>

namespace thread_allocations {

inline thread_local bool counting = false;
inline thread_local std::size_t allocations = 0;

}  // namespace thread_allocations

void* operator new(std::size_t n) {
  if (thread_allocations::counting) ++thread_allocations::allocations;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
