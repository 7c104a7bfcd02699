#pragma once
// Adding context to an exception on its way up, without losing what it was.

#include <exception>
#include <string>

#include "cpdispatch/error.hpp"

namespace cpdispatch::detail {

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

}  // namespace cpdispatch::detail
