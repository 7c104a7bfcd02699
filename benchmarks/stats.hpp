#pragma once
// The statistics the benchmarks report, in one place: every table's median
// means the same thing.

#include <algorithm>
#include <cstddef>
#include <vector>

namespace bench {

/// The median of a sample: its middle value, or the mean of its two middle
/// values for an even count; 0 for an empty sample (a table cell with no runs).
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace bench
