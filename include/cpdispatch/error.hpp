#pragma once
// The exception family of cpdispatch. Every error the library raises derives
// from cpdispatch::error, so callers can catch one type; the subclasses tell
// bad input apart from a failing backend.

#include <cstddef>
#include <cstdint>
#include <exception>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace cpdispatch {

/// Root of every exception cpdispatch throws.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A caller handed us something that breaks a documented rule (shape, range,
/// padding, capacity). The message names the field and its indices.
class invalid_input : public error {
 public:
  using error::error;
};

/// A buffer the caller owns is smaller than the plan needs.
class capacity_error : public invalid_input {
 public:
  using invalid_input::invalid_input;
};

/// A communication or device backend (MPI, CUDA, NCCL) reported a failure;
/// `code()` is the backend's own error code.
class backend_error : public error {
 public:
  backend_error(const std::string& what, int code) : error(what), code_(code) {}
  int code() const noexcept { return code_; }

 private:
  int code_;
};

/// A blocking communication call did not complete within the transport's
/// timeout ("All-reduce timeout on rank 3: ..."). The backend reported no
/// error, so `code()` is 0. The operation may still be pending in the backend
/// and write into its buffers later: treat the communicator as broken.
class timeout_error : public backend_error {
 public:
  explicit timeout_error(const std::string& what) : backend_error(what, 0) {}
};

namespace detail {

/// Streams every argument into one string: the message builder for errors.
template <class... Args>
std::string concat(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}

/// "[3][1]" for the indices of a field, so messages read like `dst[3][1]`.
template <class... Ix>
std::string index_str(Ix... ix) {
  std::ostringstream out;
  ((out << '[' << ix << ']'), ...);
  return out.str();
}

template <class E = invalid_input, class... Args>
[[noreturn]] void fail(Args&&... args) {
  throw E(concat(std::forward<Args>(args)...));
}

// Checked arithmetic: the one place sizes and counts that come from users are
// added and multiplied. Each throws invalid_input naming the caller instead of
// wrapping around (and then allocating or copying too little).

/// a + b for token counts.
inline std::int64_t add_tokens(std::int64_t a, std::int64_t b, std::string_view what) {
  std::int64_t sum = 0;
  if (__builtin_add_overflow(a, b, &sum)) {
    fail(what, ": token count overflows 64 bits (", a, " + ", b, ")");
  }
  return sum;
}

/// a * b for sizes; `what` says what the product is.
inline std::size_t checked_mul(std::size_t a, std::size_t b, std::string_view what) {
  std::size_t product = 0;
  if (__builtin_mul_overflow(a, b, &product)) fail(what, ": ", a, " x ", b, " does not fit in memory");
  return product;
}

/// count * element_size * blocks bytes (blocks: e.g. one per rank of a gather).
inline std::size_t checked_bytes(std::size_t count, std::size_t element_size, std::size_t blocks, std::string_view who) {
  std::size_t bytes = 0;
  if (__builtin_mul_overflow(count, element_size, &bytes) || __builtin_mul_overflow(bytes, blocks, &bytes)) {
    fail(who, ": ", count, " elements of ", element_size, " bytes x ", blocks, " do not fit in memory");
  }
  return bytes;
}

/// tokens * token_bytes bytes; a negative token count is refused too.
inline std::size_t token_bytes_of(std::int64_t tokens, std::size_t token_bytes, std::string_view who) {
  std::size_t bytes = 0;
  if (tokens < 0 || __builtin_mul_overflow(static_cast<std::size_t>(tokens), token_bytes, &bytes)) {
    fail(who, ": ", tokens, " tokens of ", token_bytes, " bytes do not fit in memory");
  }
  return bytes;
}


/// Call from inside a catch block: rethrows the exception being handled with
/// `context` put in front of its message. The new exception keeps its place in
/// the cpdispatch::error family (timeout_error, capacity_error and
/// invalid_input stay what they are; any other backend_error becomes a
/// backend_error with the same code; any other std::exception becomes an
/// error), and the original is nested in it, so std::rethrow_if_nested reaches
/// a backend's own subclass (e.g. mpi_error). Anything not derived from std::exception
/// propagates unchanged.
[[noreturn]] inline void rethrow_with_context(const std::string& context) {
  try {
    throw;
  } catch (const timeout_error& e) {
    std::throw_with_nested(timeout_error(context + e.what()));
  } catch (const backend_error& e) {
    std::throw_with_nested(backend_error(context + e.what(), e.code()));
  } catch (const capacity_error& e) {
    std::throw_with_nested(capacity_error(context + e.what()));
  } catch (const invalid_input& e) {
    std::throw_with_nested(invalid_input(context + e.what()));
  } catch (const std::exception& e) {
    std::throw_with_nested(error(context + e.what()));
  }
}

/// The message of a stored exception ("unknown exception" for non-standard ones).
inline std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace detail
}  // namespace cpdispatch
