#pragma once
// A step's timeline, opt-in (CpAttentionOptions::trace): the attention op
// records, per rank, when each of its parts starts and ends: each stage
// group's post and wait, the unpacking of what arrived, each kernel pass,
// each merge of passes, each fan-out and fan-in of the key-value copies and
// the sum of the gradients' copies, with the bytes a post sends and
// receives. Without a trace the op reads no clock and stores nothing.
//
// write_chrome_trace writes the timelines of every rank as Chrome
// trace-event JSON (one process a rank, complete events in microseconds),
// which Perfetto (ui.perfetto.dev) and chrome://tracing open. On a device
// transport the op's calls only enqueue work, so the times are those of
// the host's calls, not of the GPU's work.

#include <chrono>
#include <cstdint>
#include <ostream>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

namespace cpdispatch {

/// One part of a step on one rank.
struct TraceEvent {
  const char* name = "";      ///< "post", "wait", "unpack", "copy self", "kernel", "merge", "fan-out", "fan-in", "combine"
  const char* call = "";      ///< the op's call: "forward" or "backward"
  int group = -1;             ///< the stage group of a post, wait or unpack; the round of a pass or fan (-1: none)
  std::int64_t start_ns = 0;  ///< since the trace's origin
  std::int64_t end_ns = 0;
  std::int64_t bytes = 0;  ///< a post's bytes sent plus received
};

/// One rank's timeline. Give every rank's trace the same origin to line them up.
class StepTrace {
 public:
  using Clock = std::chrono::steady_clock;

  explicit StepTrace(int rank = 0, Clock::time_point origin = Clock::now()) : rank_(rank), origin_(origin) {}

  int rank() const noexcept { return rank_; }
  std::span<const TraceEvent> events() const noexcept { return events_; }
  /// Forgets the events (keeping their storage).
  void clear() noexcept { events_.clear(); }
  /// Room for n events, so that recording them allocates nothing.
  void reserve(std::size_t n) { events_.reserve(n); }
  /// Adds an event whose times are known (a model's prediction).
  void push(const TraceEvent& e) { events_.push_back(e); }

  /// Runs f() and records it as one event; returns what f returns.
  template <class F>
  decltype(auto) record(const char* name, const char* call, int group, std::int64_t bytes, F&& f) {
    const Clock::time_point start = Clock::now();
    if constexpr (std::is_void_v<std::invoke_result_t<F>>) {
      std::forward<F>(f)();
      add(name, call, group, bytes, start);
    } else {
      decltype(auto) result = std::forward<F>(f)();
      add(name, call, group, bytes, start);
      return result;
    }
  }

 private:
  void add(const char* name, const char* call, int group, std::int64_t bytes, Clock::time_point start) {
    const auto ns = [this](Clock::time_point t) { return std::chrono::duration_cast<std::chrono::nanoseconds>(t - origin_).count(); };
    events_.push_back({name, call, group, ns(start), ns(Clock::now()), bytes});
  }

  int rank_;
  Clock::time_point origin_;
  std::vector<TraceEvent> events_;
};

namespace detail {

/// ns as microseconds with three decimals (exact, unlike a double's default six digits).
inline void write_micros(std::ostream& out, std::int64_t ns) {
  if (ns < 0) {
    out << '-';
    ns = -ns;
  }
  const std::int64_t frac = ns % 1000;
  out << ns / 1000 << '.' << (frac < 100 ? "0" : "") << (frac < 10 ? "0" : "") << frac;
}

}  // namespace detail

/// Every trace's events as Chrome trace-event JSON: process = rank, one
/// thread, "X" events named "<call> <name>" (and the group) with the bytes in args.
inline void write_chrome_trace(std::ostream& out, std::span<const StepTrace* const> traces) {
  out << "{\"traceEvents\":[";
  bool first = true;
  for (const StepTrace* t : traces) {
    out << (first ? "" : ",") << "\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" << t->rank() << ",\"args\":{\"name\":\"rank " << t->rank()
        << "\"}}";
    first = false;
    for (const TraceEvent& e : t->events()) {
      out << ",\n{\"name\":\"" << e.call << ' ' << e.name;
      if (e.group >= 0) out << ' ' << e.group;
      out << "\",\"cat\":\"" << e.call << "\",\"ph\":\"X\",\"pid\":" << t->rank() << ",\"tid\":0,\"ts\":";
      detail::write_micros(out, e.start_ns);
      out << ",\"dur\":";
      detail::write_micros(out, e.end_ns - e.start_ns);
      out << ",\"args\":{\"bytes\":" << e.bytes << ",\"group\":" << e.group << "}}";
    }
  }
  out << "\n],\"displayTimeUnit\":\"ms\"}\n";
}

}  // namespace cpdispatch
