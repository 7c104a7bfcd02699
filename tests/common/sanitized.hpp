#pragma once
// Whether this build runs under AddressSanitizer (the tests' one check of it). Tests
// whose time goes to many random or sampled cases (or to their own
// brute-force oracle) run a share of them there: the sanitizers look for
// memory errors on the code paths, which a share of the cases reaches;
// unsanitized builds run all.

namespace cptest {

#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool sanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool sanitized = true;
#else
inline constexpr bool sanitized = false;
#endif
#else
inline constexpr bool sanitized = false;
#endif

/// `all` unsanitized; under the sanitizers, `share` of them.
template <class N>
constexpr N cases(N all, N share) {
  return sanitized ? share : all;
}

}  // namespace cptest
