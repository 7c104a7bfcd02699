#pragma once
// A line chart of modelled step time against W as a standalone SVG document
// (bench_step_model --svg FILE): one panel a sample, log-scale W and time
// axes (the schemes span four orders of magnitude), one line a scheme.
// Text escaping and number formatting come from cpdispatch/io/svg.hpp.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cpdispatch/io/svg.hpp"

namespace step_chart {

/// One scheme's points: (W, step time in ms); W where it cannot run are left out.
struct Series {
  std::string name;
  std::vector<std::pair<double, double>> points;
};

/// One sample's chart.
struct Panel {
  std::string title;
  std::vector<Series> series;
};

namespace detail {

using cpdispatch::detail::svg::escape;
using cpdispatch::detail::svg::num;

constexpr double kPanelW = 440, kPanelH = 300, kLeft = 70, kTop = 60, kGap = 110, kLegendH = 70;
constexpr const char* kColours[] = {"#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#ff7f0e", "#17becf"};
constexpr const char* kDashes[] = {"", "6,3", "", "2,3", "8,3,2,3", "4,4", ""};

/// "250 ms", "1.5 s", "380 s": labels of the time axis.
inline std::string time_label(double ms) {
  char buf[32];
  if (ms < 1000) std::snprintf(buf, sizeof buf, "%g ms", ms);
  else std::snprintf(buf, sizeof buf, "%g s", ms / 1000);
  return buf;
}

/// The decades [lo, hi] (powers of ten) that hold every point of every panel.
inline std::pair<int, int> decades(const std::vector<Panel>& panels) {
  double lo = 1e300, hi = 0;
  for (const Panel& p : panels)
    for (const Series& s : p.series)
      for (const auto& [w, ms] : s.points)
        if (ms > 0) lo = std::min(lo, ms), hi = std::max(hi, ms);
  if (hi <= 0) return {0, 1};
  const int a = static_cast<int>(std::floor(std::log10(lo))), b = static_cast<int>(std::ceil(std::log10(hi)));
  return {a, std::max(b, a + 1)};
}

/// The W range (powers of two) of every panel.
inline std::pair<double, double> w_range(const std::vector<Panel>& panels) {
  double lo = 1e300, hi = 0;
  for (const Panel& p : panels)
    for (const Series& s : p.series)
      for (const auto& pt : s.points) lo = std::min(lo, pt.first), hi = std::max(hi, pt.first);
  if (hi <= 0) return {1, 2};
  return {std::log2(lo), std::max(std::log2(hi), std::log2(lo) + 1)};
}

struct Axes {
  double x0, y0;         // the panel's plot origin (top left)
  double w_lo, w_hi;     // log2 W
  int d_lo, d_hi;        // log10 ms
  double x(double W) const { return x0 + (std::log2(W) - w_lo) / (w_hi - w_lo) * kPanelW; }
  double y(double ms) const { return y0 + kPanelH - (std::log10(ms) - d_lo) / (d_hi - d_lo) * kPanelH; }
};

inline void grid(std::string& s, const Axes& a, const Panel& p) {
  s += "<text x=\"" + num(a.x0 + kPanelW / 2) + "\" y=\"" + num(a.y0 - 12) + "\" text-anchor=\"middle\" font-weight=\"bold\">" + escape(p.title) +
       "</text>\n";
  s += "<rect x=\"" + num(a.x0) + "\" y=\"" + num(a.y0) + "\" width=\"" + num(kPanelW) + "\" height=\"" + num(kPanelH) +
       "\" fill=\"none\" stroke=\"#444\"/>\n";
  for (int d = a.d_lo; d <= a.d_hi; ++d) {
    const double ms = std::pow(10.0, d), y = a.y(ms);
    s += "<line x1=\"" + num(a.x0) + "\" y1=\"" + num(y) + "\" x2=\"" + num(a.x0 + kPanelW) + "\" y2=\"" + num(y) + "\" stroke=\"#ddd\"/>\n";
    s += "<text x=\"" + num(a.x0 - 6) + "\" y=\"" + num(y + 4) + "\" text-anchor=\"end\">" + escape(time_label(ms)) + "</text>\n";
  }
  for (double e = std::ceil(a.w_lo); e <= a.w_hi + 1e-9; ++e) {
    const double W = std::exp2(e), x = a.x(W);
    s += "<line x1=\"" + num(x) + "\" y1=\"" + num(a.y0) + "\" x2=\"" + num(x) + "\" y2=\"" + num(a.y0 + kPanelH) + "\" stroke=\"#eee\"/>\n";
    s += "<text x=\"" + num(x) + "\" y=\"" + num(a.y0 + kPanelH + 16) + "\" text-anchor=\"middle\">" + std::to_string(static_cast<long long>(W)) +
         "</text>\n";
  }
  s += "<text x=\"" + num(a.x0 + kPanelW / 2) + "\" y=\"" + num(a.y0 + kPanelH + 36) + "\" text-anchor=\"middle\">W (ranks, 8 a node)</text>\n";
}

inline void line(std::string& s, const Axes& a, const Series& series, std::size_t k) {
  const char* colour = kColours[k % std::size(kColours)];
  const char* dash = kDashes[k % std::size(kDashes)];
  if (series.points.size() > 1) {
    s += "<polyline fill=\"none\" stroke=\"" + std::string(colour) + "\" stroke-width=\"2\"";
    if (*dash) s += " stroke-dasharray=\"" + std::string(dash) + "\"";
    s += " points=\"";
    for (const auto& [W, ms] : series.points) s += num(a.x(W)) + "," + num(a.y(ms)) + " ";
    s += "\"/>\n";
  }
  for (const auto& [W, ms] : series.points) {
    s += "<circle cx=\"" + num(a.x(W)) + "\" cy=\"" + num(a.y(ms)) + "\" r=\"3\" fill=\"" + colour + "\"><title>" + escape(series.name) + ", W = " +
         std::to_string(static_cast<long long>(W)) + ": " + num(ms) + " ms</title></circle>\n";
  }
}

inline void legend(std::string& s, const std::vector<Series>& series, double y) {
  for (std::size_t k = 0; k < series.size(); ++k) {
    const double x = kLeft + static_cast<double>(k % 4) * 230, yy = y + static_cast<double>(k / 4) * 22;
    const char* dash = kDashes[k % std::size(kDashes)];
    s += "<line x1=\"" + num(x) + "\" y1=\"" + num(yy) + "\" x2=\"" + num(x + 30) + "\" y2=\"" + num(yy) + "\" stroke=\"" +
         kColours[k % std::size(kColours)] + "\" stroke-width=\"2\"";
    if (*dash) s += " stroke-dasharray=\"" + std::string(dash) + "\"";
    s += "/>\n<text x=\"" + num(x + 36) + "\" y=\"" + num(yy + 4) + "\">" + escape(series[k].name) +
         (series[k].points.empty() ? " (cannot run)" : "") + "</text>\n";
  }
}

}  // namespace detail

/// The panels side by side, one legend (the first panel's series names) below.
inline std::string chart_svg(const std::vector<Panel>& panels, std::string_view title) {
  using namespace detail;
  const auto [d_lo, d_hi] = decades(panels);
  const auto [w_lo, w_hi] = w_range(panels);
  const double width = kLeft + static_cast<double>(panels.size()) * (kPanelW + kGap) - kGap + 40;
  const double height = kTop + kPanelH + 50 + kLegendH;
  std::string s = "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + num(width) + "\" height=\"" + num(height) +
                  "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  s += "<text x=\"" + num(kLeft) + "\" y=\"22\" font-size=\"14\">" + escape(title) + "</text>\n";
  for (std::size_t i = 0; i < panels.size(); ++i) {
    const Axes a{kLeft + static_cast<double>(i) * (kPanelW + kGap), kTop, w_lo, w_hi, d_lo, d_hi};
    grid(s, a, panels[i]);
    for (std::size_t k = 0; k < panels[i].series.size(); ++k) line(s, a, panels[i].series[k], k);
  }
  if (!panels.empty()) legend(s, panels.front().series, kTop + kPanelH + 62);
  return s + "</svg>\n";
}

}  // namespace step_chart
