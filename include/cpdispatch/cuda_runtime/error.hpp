#pragma once
// CUDA runtime errors as exceptions of the cpdispatch family.
//
//   CPDISPATCH_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, stream));
//
// throws cuda_error("cudaMemcpyAsync failed at data_path.hpp:120: cudaErrorInvalidValue
// (invalid argument)", code) when the call does not return cudaSuccess. Before
// throwing, CUDA's last error is read and so cleared (cudaGetLastError), so a
// later, unrelated check does not report this failure again. (Sticky errors,
// e.g. an illegal address in a kernel, stay: the CUDA context is unusable
// after them, and every later call reports them.)
//
// Plain C++ over the CUDA runtime API: compiles with the host compiler too.

#include <cuda_runtime_api.h>

#include <string>
#include <string_view>

#include "cpdispatch/error.hpp"

namespace cpdispatch {

/// A CUDA runtime call failed; code() is the cudaError_t.
class cuda_error : public backend_error {
 public:
  using backend_error::backend_error;
};

namespace detail {

/// "data_path.hpp" for "/path/to/include/cpdispatch/cuda/data_path.hpp".
constexpr std::string_view file_name_of(std::string_view path) noexcept {
  const std::size_t slash = path.find_last_of("/\\");
  return slash == std::string_view::npos ? path : path.substr(slash + 1);
}

/// "cudaMemcpyAsync" for the text "cudaMemcpyAsync(dst, src, n, kind, stream)".
constexpr std::string_view call_name_of(std::string_view expression) noexcept {
  const std::size_t paren = expression.find('(');
  std::string_view name = paren == std::string_view::npos ? expression : expression.substr(0, paren);
  while (!name.empty() && (name.back() == ' ' || name.back() == '\t')) name.remove_suffix(1);
  return name;
}

/// The message of every backend failure: `<call> failed at <file>:<line>:
/// <error name> (<description>)`, then `; <detail>` when there is one.
inline std::string backend_failure_message(std::string_view call, std::string_view file, int line, std::string_view error_name,
                                           std::string_view description, std::string_view detail = {}) {
  std::string message = concat(call_name_of(call), " failed at ", file_name_of(file), ":", line, ": ", error_name, " (", description, ")");
  if (!detail.empty()) message += concat("; ", detail);
  return message;
}

/// Builds the cuda_error of a failed call; clears CUDA's last error first.
inline cuda_error make_cuda_error(cudaError_t code, std::string_view call, std::string_view file, int line) {
  (void)cudaGetLastError();  // the failure is reported now, not again by the next check
  const char* name = cudaGetErrorName(code);
  const char* description = cudaGetErrorString(code);
  return cuda_error(backend_failure_message(call, file, line, name ? name : "cudaError?", description ? description : "no description"),
                    static_cast<int>(code));
}

inline void cuda_check(cudaError_t code, std::string_view call, std::string_view file, int line) {
  if (code == cudaSuccess) [[likely]] return;
  throw make_cuda_error(code, call, file, line);
}

}  // namespace detail
}  // namespace cpdispatch

/// Throws cuda_error naming the call, the file and line, and CUDA's own
/// error name and text, when `expr` does not return cudaSuccess.
#define CPDISPATCH_CUDA_CHECK(expr) ::cpdispatch::detail::cuda_check((expr), #expr, __FILE__, __LINE__)

/// After a kernel launch: reports a launch failure (bad configuration, no
/// kernel image for this GPU, ...) as cuda_error naming `kernel_name`.
#define CPDISPATCH_CUDA_CHECK_LAUNCH(kernel_name) \
  ::cpdispatch::detail::cuda_check(cudaGetLastError(), kernel_name " launch", __FILE__, __LINE__)
