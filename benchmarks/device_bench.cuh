#pragma once
// What the device benchmarks share: the document-length samples, inputs
// filled on the device, medians. Included by .cu files only (a kernel).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_runtime.h>

#include "cpdispatch/cuda_runtime/launch.hpp"
#include "cpdispatch/cuda_runtime/memory.hpp"
#include "stats.hpp"

namespace bench {

/// The document lengths of data/<name>.json (a JSON array of integers); empty when no file is found.
/// Scanned by hand: the CUDA benchmarks do not depend on nlohmann_json.
inline std::vector<std::int64_t> read_lengths(const std::string& name) {
  std::vector<std::filesystem::path> dirs;
  if (const char* env = std::getenv("CPDISPATCH_DOC_LENGTHS_DIR"); env && *env) dirs.emplace_back(env);
#ifdef CPDISPATCH_DOC_LENGTHS_DIR
  dirs.emplace_back(CPDISPATCH_DOC_LENGTHS_DIR);
#endif
  dirs.emplace_back("data");
  for (const auto& dir : dirs) {
    std::ifstream in(dir / (name + ".json"));
    if (!in) continue;
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::vector<std::int64_t> out;
    for (std::size_t i = 0; i < text.size();) {
      if (text[i] < '0' || text[i] > '9') {
        ++i;
        continue;
      }
      std::int64_t v = 0;
      for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i) v = v * 10 + (text[i] - '0');
      out.push_back(v);
    }
    return out;
  }
  return {};
}

/// x[i] uniform in [-1, 1) from a hash of (seed, i): filled on the device, so
/// that gigabytes of inputs cost no host time.
template <class E>
__global__ void fill_uniform(E* x, std::size_t n, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    std::uint64_t h = seed * 0x9E3779B97F4A7C15ull + i;  // splitmix64's finaliser
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ull;
    h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;
    h ^= h >> 31;
    const float u = static_cast<float>(h >> 40) * (2.0f / 16777216.0f) - 1.0f;
    if constexpr (std::is_same_v<E, float>) {
      x[i] = u;
    } else {
      x[i].bits = E::from_float(u);
    }
  }
}

template <class E>
cpdispatch::cuda::DeviceBuffer<E> random_device(std::size_t n, std::uint64_t seed, cudaStream_t stream = nullptr) {
  cpdispatch::cuda::DeviceBuffer<E> b(std::max<std::size_t>(n, 1));
  cpdispatch::cuda::launch_kernel("fill_uniform", fill_uniform<E>, dim3(1024), dim3(256), stream, b.data(), n, seed);
  return b;
}

}  // namespace bench
