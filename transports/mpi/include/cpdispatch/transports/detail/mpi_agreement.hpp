#pragma once
// The outcome agreement of MpiTransport's all-to-all exchanges
// (MpiTransportOptions::agree). Each rank sends every other rank one small
// message saying whether the exchange completed on it (or why not), and
// waits for theirs under the exchange's own deadline. A rank that reports a
// failure, or nothing by the deadline, is named in the error every rank
// throws. Point-to-point messages rather than a collective: at a deadline the
// receives still pending say exactly which ranks stayed silent, and a rank
// that exchanged no bytes with the faulty one still learns of the fault.

#include "cpdispatch/transports/detail/mpi_c_api.hpp"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cpdispatch/error.hpp"

namespace cpdispatch::detail {

/// One rank's outcome of one exchange, as it travels (256 bytes).
struct MpiOutcome {
  std::uint64_t exchange = 0;  ///< the exchange's number on the sender
  std::int32_t code = 0;       ///< the backend's error code (0: none, or a timeout)
  std::int8_t failed = 0;
  std::int8_t timed_out = 0;
  char what[242] = {};  ///< the sender's error message, cut to fit
};
static_assert(sizeof(MpiOutcome) == 256);

/// The messages of one agreement. The buffers live in the transport's
/// handles, which outlive every request that may still use them.
struct MpiAgreementBuffers {
  std::vector<MpiOutcome> in;        ///< [W]: what each rank reported
  MpiOutcome out;                    ///< what this rank reports
  std::vector<MPI_Request> receives; ///< [W]; MPI_REQUEST_NULL once complete (or for this rank)
  std::vector<MPI_Request> sends;    ///< [W]
};

using MpiDeadline = std::optional<std::chrono::steady_clock::time_point>;

class MpiAgreement {
 public:
  /// Consecutive exchanges use distinct tags, so that ranks may wait for posted exchanges in different orders.
  static constexpr int tags = 64;

  void init(MPI_Comm comm, int rank, int size, int first_tag, MpiAgreementBuffers& buffers) {
    comm_ = comm;
    rank_ = rank;
    size_ = size;
    first_tag_ = first_tag;
    b_ = &buffers;
    const auto W = static_cast<std::size_t>(size);
    b_->in.assign(W, MpiOutcome{});
    b_->receives.assign(W, MPI_REQUEST_NULL);
    b_->sends.assign(W, MPI_REQUEST_NULL);
  }

  /// Posts the receives of the outcomes of exchange `exchange`: before the
  /// exchange starts, so that both share one deadline.
  void begin(std::uint64_t exchange) {
    exchange_ = exchange;
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      const int rc = MPI_Irecv(&b_->in[static_cast<std::size_t>(p)], sizeof(MpiOutcome), MPI_BYTE, p, tag(), comm_,
                               &b_->receives[static_cast<std::size_t>(p)]);
      if (rc != MPI_SUCCESS) {
        cancel_receives();
        throw backend_error(concat("MPI_Irecv failed on rank ", rank_, " posting the outcome agreement of exchange #", exchange), rc);
      }
    }
  }

  /// The exchange completed here: tells the others and waits for their
  /// outcomes until `deadline` (none: for ever), then `grace` longer for
  /// those still missing: a peer that timed out in the exchange reports so
  /// at about the same deadline, and is then named as such, not as silent.
  /// Throws, naming the ranks that failed or stayed silent, if any did;
  /// `what()` says where ("on rank 1 in all_to_all_v(...)").
  template <class What>
  void finish_completed(const MpiDeadline& deadline, std::chrono::milliseconds grace, const What& what) {
    b_->out = MpiOutcome{};
    b_->out.exchange = exchange_;
    send_outcome();
    wait_all(b_->receives, deadline);
    if (deadline) wait_all(b_->receives, std::chrono::steady_clock::now() + grace);
    const std::string verdict = verdict_of_others();
    finish_sends(deadline);
    if (verdict.empty()) return;
    cancel_receives();
    const bool silent = any_silent_;
    const std::string message = concat("All-to-all agreement ", what(), ": exchange #", exchange_, " completed here but ", verdict);
    if (silent) throw timeout_error(message);
    throw backend_error(message, first_code_);
  }

  /// This rank's exchange failed with `e` (`timed_out`: at the deadline):
  /// tells the others, waits for their outcomes until `deadline` (a failure
  /// before the deadline, e.g. a bad argument, still takes its full part, so
  /// that no outcome is left behind for a later exchange) and `grace` longer,
  /// and returns what is known of the others (who failed, who said nothing),
  /// to add to the error. all_reported() says whether every outcome came.
  std::string finish_failed(const std::exception& e, int code, bool timed_out, const MpiDeadline& deadline,
                            std::chrono::milliseconds grace) {
    b_->out = MpiOutcome{};
    b_->out.exchange = exchange_;
    b_->out.failed = 1;
    b_->out.timed_out = timed_out ? 1 : 0;
    b_->out.code = code;
    const std::size_t n = std::min(std::strlen(e.what()), sizeof(b_->out.what) - 1);
    std::memcpy(b_->out.what, e.what(), n);
    send_outcome();
    if (!timed_out) wait_all(b_->receives, deadline);
    if (deadline || timed_out) wait_all(b_->receives, std::chrono::steady_clock::now() + grace);
    all_reported_ = test_all(b_->receives);
    const std::string verdict = verdict_of_others();
    finish_sends(std::chrono::steady_clock::now() + std::chrono::milliseconds(100));
    cancel_receives();
    return verdict;
  }

  /// Whether every other rank's outcome of the last failed exchange arrived
  /// (none is left to be matched by a later exchange's agreement).
  bool all_reported() const noexcept { return all_reported_; }

  /// Sends still pending after an agreement gave up (the transport keeps them for its destructor).
  std::vector<MPI_Request>& leftover_sends() { return b_->sends; }

 private:
  int tag() const noexcept { return first_tag_ - static_cast<int>(exchange_ % tags); }

  void send_outcome() {
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      const int rc = MPI_Isend(&b_->out, sizeof(MpiOutcome), MPI_BYTE, p, tag(), comm_, &b_->sends[static_cast<std::size_t>(p)]);
      if (rc != MPI_SUCCESS) throw backend_error(concat("MPI_Isend failed on rank ", rank_, " sending its outcome of exchange #", exchange_), rc);
    }
  }

  /// MPI_Testsome until every request is complete or the deadline passes; completed ones become MPI_REQUEST_NULL.
  void wait_all(std::vector<MPI_Request>& reqs, const MpiDeadline& deadline) {
    if (!deadline) {
      MPI_Waitall(static_cast<int>(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE);
      return;
    }
    while (!test_all(reqs) && std::chrono::steady_clock::now() < *deadline) std::this_thread::yield();
  }

  /// One MPI_Testsome; true when nothing is left pending.
  bool test_all(std::vector<MPI_Request>& reqs) {
    if (std::all_of(reqs.begin(), reqs.end(), [](MPI_Request r) { return r == MPI_REQUEST_NULL; })) return true;
    indices_.resize(reqs.size());
    int done = 0;
    MPI_Testsome(static_cast<int>(reqs.size()), reqs.data(), &done, indices_.data(), MPI_STATUSES_IGNORE);
    return done == MPI_UNDEFINED || std::all_of(reqs.begin(), reqs.end(), [](MPI_Request r) { return r == MPI_REQUEST_NULL; });
  }

  /// "rank 3 reported nothing by the deadline; rank 0 failed: ..." over the
  /// other ranks, or empty when every one of them completed the exchange.
  std::string verdict_of_others() {
    std::string silent, failed, mismatched;
    any_silent_ = false;
    first_code_ = 0;
    for (int p = 0; p < size_; ++p) {
      const auto i = static_cast<std::size_t>(p);
      if (p == rank_) continue;
      if (b_->receives[i] != MPI_REQUEST_NULL) {
        silent += concat(silent.empty() ? "" : ", ", p);
        any_silent_ = true;
      } else if (b_->in[i].exchange != exchange_) {
        mismatched += concat(mismatched.empty() ? "" : "; ", "rank ", p, " reported exchange #", b_->in[i].exchange);
      } else if (b_->in[i].failed) {
        const MpiOutcome& o = b_->in[i];
        if (first_code_ == 0) first_code_ = o.code;
        failed += concat(failed.empty() ? "" : "; ", "rank ", p, o.timed_out ? " timed out: " : " failed: ",
                         std::string(o.what, strnlen(o.what, sizeof(o.what))));
      }
    }
    std::string verdict;
    if (!silent.empty()) verdict = concat("rank(s) ", silent, " reported no outcome in time (stalled, failed before reaching MPI, or dead)");
    if (!failed.empty()) verdict += concat(verdict.empty() ? "" : "; ", failed);
    if (!mismatched.empty()) verdict += concat(verdict.empty() ? "" : "; ", "out of step: ", mismatched);
    return verdict;
  }

  /// Sends to a live rank are small and complete at once; to a dead one they may not: those stay with the transport.
  void finish_sends(const MpiDeadline& deadline) { wait_all(b_->sends, deadline); }

  /// A cancelled receive completes at once, so nothing can land in the buffers later.
  void cancel_receives() {
    for (MPI_Request& r : b_->receives) {
      if (r == MPI_REQUEST_NULL) continue;
      MPI_Cancel(&r);
      MPI_Wait(&r, MPI_STATUS_IGNORE);
    }
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  int first_tag_ = 0;
  std::uint64_t exchange_ = 0;
  bool any_silent_ = false;
  bool all_reported_ = true;
  int first_code_ = 0;
  MpiAgreementBuffers* b_ = nullptr;
  std::vector<int> indices_;
};

}  // namespace cpdispatch::detail
