#pragma once
// The --stages option of the attention-step benchmarks, host and device.

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <string>
#include <vector>

namespace bench {

/// "1,2,4" -> {1, 2, 4}; empty when an item is not a positive count.
inline std::vector<int> stage_list(const std::string& text) {
  std::vector<int> out;
  std::size_t at = 0;
  while (at <= text.size()) {
    const std::size_t comma = std::min(text.find(',', at), text.size());
    const int n = std::atoi(text.substr(at, comma - at).c_str());
    if (n < 1) return {};
    out.push_back(n);
    at = comma + 1;
  }
  return out;
}

}  // namespace bench
