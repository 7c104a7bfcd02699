#pragma once
// A picture of a plan as a standalone SVG document: a W x W heat map of the
// bytes each rank sends each other rank, and bars of attention cost per rank
// (before and after balancing when both are given). No dependencies.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

#include "cpdispatch/model/cost.hpp"
#include "cpdispatch/error.hpp"

namespace cpdispatch {

namespace detail::svg {

/// Text for SVG content and attribute values.
inline std::string escape(std::string_view text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out += c;
    }
  }
  return out;
}

inline std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

/// 1234567 -> "1.23M": axis and legend labels.
inline std::string human(double v) {
  const char* units[] = {"", "K", "M", "G", "T", "P", "E"};
  int u = 0;
  while (std::fabs(v) >= 1000 && u < 6) v /= 1000, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, u ? "%.3g%s" : "%.0f%s", v, units[u]);
  return buf;
}

/// White to dark blue; t in [0, 1].
inline std::string blue(double t) {
  t = std::clamp(t, 0.0, 1.0);
  auto mix = [t](int a, int b) { return static_cast<int>(std::lround(a + (b - a) * t)); };
  char buf[16];
  std::snprintf(buf, sizeof buf, "#%02x%02x%02x", mix(0xf7, 0x08), mix(0xfb, 0x30), mix(0xff, 0x6b));
  return buf;
}

/// Where the picture's parts go, from the world size.
struct Geometry {
  std::size_t W = 0;
  double cell = 0, map = 0;         // heat map cell and side
  double mx = 70, my = 90;          // heat map origin
  double bx = 0, plot_h = 240;      // bar chart origin (x), height
  double bar_w = 0, plot_w = 0;
  double width = 0, height = 0;
  std::size_t tick = 1;             // label every tick-th rank

  explicit Geometry(std::size_t world) : W(world) {
    cell = std::clamp(384.0 / static_cast<double>(W), 2.0, 48.0);
    map = cell * static_cast<double>(W);
    bx = mx + map + 100;
    bar_w = std::clamp(384.0 / static_cast<double>(W), 3.0, 48.0);
    plot_w = bar_w * static_cast<double>(W);
    width = bx + std::max(plot_w, 280.0) + 50;
    height = std::max(my + map + 60, my + plot_h + 110);
    tick = W <= 16 ? 1 : W <= 64 ? 8 : W / 8;
  }
};

inline void check_costs(const PlanCost& after, const PlanCost* before) {
  if (after.world_size <= 0 || after.attention.size() != static_cast<std::size_t>(after.world_size) ||
      after.bytes.size() != after.attention.size() * after.attention.size()) {
    detail::fail("plan_svg: the plan cost is empty or malformed (world_size = ", after.world_size, ")");
  }
  if (before && before->attention.size() != after.attention.size()) {
    detail::fail("plan_svg: before has ", before->attention.size(), " ranks, after has ", after.attention.size());
  }
}

/// The document header, background, title and the one-line summary.
inline void header(std::string& s, const Geometry& g, const PlanCost& after, const PlanCost* before, std::string_view title) {
  s += "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  s += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + num(g.width) + "\" height=\"" + num(g.height) + "\" viewBox=\"0 0 " +
       num(g.width) + " " + num(g.height) + "\" font-family=\"sans-serif\" font-size=\"11\">\n";
  s += "<rect x=\"0\" y=\"0\" width=\"" + num(g.width) + "\" height=\"" + num(g.height) + "\" fill=\"white\"/>\n";
  if (!title.empty()) s += "<text x=\"10\" y=\"20\" font-size=\"14\" font-weight=\"bold\">" + escape(title) + "</text>\n";
  char ratio[64];
  std::snprintf(ratio, sizeof ratio, "max/mean attention cost %.3f", after.max_over_mean());
  std::string summary = ratio;
  if (before) {
    std::snprintf(ratio, sizeof ratio, " (before: %.3f)", before->max_over_mean());
    summary += ratio;
  }
  summary += "; bytes moved " + human(static_cast<double>(after.bytes_moved));
  s += "<text x=\"10\" y=\"38\">" + escape(summary) + "</text>\n";
}

/// Heat map of bytes sent: row = sending (home) rank, column = attending rank.
inline void heat_map(std::string& s, const Geometry& g, const PlanCost& after) {
  const std::size_t W = g.W;
  const double mx = g.mx, my = g.my, cell = g.cell;
  std::int64_t most = 0;
  for (std::int64_t b : after.bytes) most = std::max(most, b);
  s += "<g>\n<text x=\"" + num(mx) + "\" y=\"" + num(my - 22) + "\" font-weight=\"bold\">bytes sent (row: from rank, column: to rank)</text>\n";
  s += "<rect x=\"" + num(mx) + "\" y=\"" + num(my) + "\" width=\"" + num(g.map) + "\" height=\"" + num(g.map) +
       "\" fill=\"" + blue(0) + "\" stroke=\"#999\"/>\n";
  for (std::size_t r = 0; r < W; ++r) {
    for (std::size_t d = 0; d < W; ++d) {
      const std::int64_t b = after.bytes[r * W + d];
      if (b == 0) continue;
      const double t = std::sqrt(static_cast<double>(b) / static_cast<double>(most));  // sqrt: small flows stay visible
      s += "<rect x=\"" + num(mx + cell * static_cast<double>(d)) + "\" y=\"" + num(my + cell * static_cast<double>(r)) +
           "\" width=\"" + num(cell) + "\" height=\"" + num(cell) + "\" fill=\"" + blue(0.15 + 0.85 * t) +
           "\"><title>rank " + std::to_string(r) + " to rank " + std::to_string(d) + ": " + std::to_string(b) +
           " bytes</title></rect>\n";
    }
  }
  for (std::size_t r = 0; r < W; r += g.tick) {
    const double c = cell * (static_cast<double>(r) + 0.5);
    s += "<text x=\"" + num(mx - 4) + "\" y=\"" + num(my + c + 4) + "\" text-anchor=\"end\">" + std::to_string(r) + "</text>\n";
    s += "<text x=\"" + num(mx + c) + "\" y=\"" + num(my - 4) + "\" text-anchor=\"middle\">" + std::to_string(r) + "</text>\n";
  }
  const double ly = my + g.map + 24;  // colour legend
  for (int i = 0; i <= 10; ++i) {
    s += "<rect x=\"" + num(mx + i * 12.0) + "\" y=\"" + num(ly) + "\" width=\"12\" height=\"10\" fill=\"" +
         blue(i == 0 ? 0 : 0.15 + 0.85 * i / 10.0) + "\"/>\n";
  }
  s += "<text x=\"" + num(mx + 140) + "\" y=\"" + num(ly + 9) + "\">0 to " + human(static_cast<double>(most)) +
       " bytes (square-root scale)</text>\n</g>\n";
}

/// One rank's bars: before (behind) and after.
inline void rank_bars(std::string& s, const Geometry& g, std::size_t r, double base, double top, const PlanCost& after, const PlanCost* before) {
  auto y_of = [&](double v) { return base - g.plot_h * v / top; };
  const double x = g.bx + g.bar_w * static_cast<double>(r);
  if (before) {
    const auto v = static_cast<double>(before->attention[r]);
    s += "<rect x=\"" + num(x) + "\" y=\"" + num(y_of(v)) + "\" width=\"" + num(g.bar_w * 0.9) + "\" height=\"" + num(base - y_of(v)) +
         "\" fill=\"#f4a582\"><title>rank " + std::to_string(r) + " before: " + std::to_string(before->attention[r]) + "</title></rect>\n";
  }
  const auto v = static_cast<double>(after.attention[r]);
  const double inset = before ? g.bar_w * 0.25 : 0;
  s += "<rect x=\"" + num(x + inset) + "\" y=\"" + num(y_of(v)) + "\" width=\"" + num(g.bar_w * 0.9 - 2 * inset) + "\" height=\"" +
       num(base - y_of(v)) + "\" fill=\"#2166ac\"><title>rank " + std::to_string(r) + ": " + std::to_string(after.attention[r]) +
       "</title></rect>\n";
  if (r % g.tick == 0) {
    s += "<text x=\"" + num(x + g.bar_w * 0.45) + "\" y=\"" + num(base + 14) + "\" text-anchor=\"middle\">" + std::to_string(r) + "</text>\n";
  }
}

/// What the attention cost counts, for the bars' title.
inline std::string pairs_name(const AttentionMask& mask) {
  return mask == AttentionMask::causal() ? "causal token pairs" : "(query, key) pairs, " + to_string(mask) + " mask";
}

/// Bars of attention cost per attending rank, with grid, mean and legend.
inline void cost_bars(std::string& s, const Geometry& g, const PlanCost& after, const PlanCost* before) {
  std::int64_t top = after.max_attention();
  if (before) top = std::max(top, before->max_attention());
  top = std::max<std::int64_t>(top, 1);
  const double bx = g.bx, plot_w = g.plot_w, base = g.my + g.plot_h;
  auto y_of = [&](double v) { return base - g.plot_h * v / static_cast<double>(top); };
  s += "<g>\n<text x=\"" + num(bx) + "\" y=\"" + num(g.my - 22) + "\" font-weight=\"bold\">attention cost per rank (" + escape(pairs_name(after.mask)) + ")</text>\n";
  for (int i = 0; i <= 4; ++i) {
    const double v = static_cast<double>(top) * i / 4.0;
    s += "<line x1=\"" + num(bx) + "\" x2=\"" + num(bx + plot_w) + "\" y1=\"" + num(y_of(v)) + "\" y2=\"" + num(y_of(v)) +
         "\" stroke=\"#ddd\"/>\n";
    s += "<text x=\"" + num(bx - 4) + "\" y=\"" + num(y_of(v) + 4) + "\" text-anchor=\"end\">" + human(v) + "</text>\n";
  }
  for (std::size_t r = 0; r < g.W; ++r) rank_bars(s, g, r, base, static_cast<double>(top), after, before);
  const double mean_y = y_of(after.mean_attention());
  s += "<line x1=\"" + num(bx) + "\" x2=\"" + num(bx + plot_w) + "\" y1=\"" + num(mean_y) + "\" y2=\"" + num(mean_y) +
       "\" stroke=\"black\" stroke-dasharray=\"4 3\"/>\n";
  s += "<text x=\"" + num(bx + plot_w + 4) + "\" y=\"" + num(mean_y + 4) + "\">mean</text>\n";
  const double lg = base + 34;
  if (before) {
    s += "<rect x=\"" + num(bx) + "\" y=\"" + num(lg) + "\" width=\"12\" height=\"10\" fill=\"#f4a582\"/>\n";
    s += "<text x=\"" + num(bx + 16) + "\" y=\"" + num(lg + 9) + "\">before (every piece at its home rank)</text>\n";
  }
  s += "<rect x=\"" + num(bx) + "\" y=\"" + num(lg + 16) + "\" width=\"12\" height=\"10\" fill=\"#2166ac\"/>\n";
  s += "<text x=\"" + num(bx + 16) + "\" y=\"" + num(lg + 25) + "\">" + std::string(before ? "after" : "this plan") + "</text>\n";
  s += "<text x=\"" + num(bx + plot_w / 2) + "\" y=\"" + num(base + 28) + "\" text-anchor=\"middle\">rank</text>\n</g>\n";
}

}  // namespace detail::svg

/// The SVG picture of a plan's cost: `after` is the plan shown; `before`
/// (optional, same world size) adds the unbalanced attention cost bars.
inline std::string plan_svg(const PlanCost& after, const PlanCost* before = nullptr, std::string_view title = "") {
  detail::svg::check_costs(after, before);
  const detail::svg::Geometry g(static_cast<std::size_t>(after.world_size));
  std::string s;
  detail::svg::header(s, g, after, before, title);
  detail::svg::heat_map(s, g, after);
  detail::svg::cost_bars(s, g, after, before);
  s += "</svg>\n";
  return s;
}

}  // namespace cpdispatch
