#pragma once
// The host-side machinery of the two in-process worlds, SimWorld
// (transports/sim: host memory, memcpy) and cpdispatch::DeviceSimWorld
// (transports/device_sim.hpp: one GPU, copies on CUDA streams): W ranks as W threads of
// one process, their meetings for collectives (every rank must bring the
// same call), point-to-point mailboxes matched by (source, destination) in
// posting order (tags only label messages, as in the point-to-point contract
// of transport.hpp), timeouts, and the abort that releases every waiting rank
// when one fails. What moves the bytes stays in each world; the rules, and
// the messages that name a failure, are the same in both because they are
// written once, here.

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cpdispatch/error.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch::detail::sim {

/// What a rank brings to a collective; compared across ranks.
struct Call {
  const char* op = "";
  std::size_t count = 0;  // elements or bytes, per op
  int type = -1;          // ElementType, -1 when untyped
  int root = -1;          // broadcast
  friend bool operator==(const Call& a, const Call& b) {
    return std::string_view(a.op) == b.op && a.count == b.count && a.type == b.type && a.root == b.root;
  }
};

/// "All-reduce" for "all_reduce": how timeout messages name an operation.
inline std::string title_of(std::string_view op) {
  std::string t(op.substr(0, op.find(' ')));
  if (t == "all_to_all_v") t = "all_to_all";
  for (char& ch : t) if (ch == '_') ch = '-';
  if (!t.empty()) t[0] = static_cast<char>(t[0] - 'a' + 'A');
  return t;
}

inline std::string describe(const Call& c) {
  std::string s = c.op;
  if (c.type >= 0) s += concat(" of ", c.count, " ", element_name(static_cast<ElementType>(c.type)));
  else if (std::string_view(c.op) == "broadcast") s += concat(" of ", c.count, " bytes from root ", c.root);
  return s;
}

/// How a world names itself in its messages.
struct Names {
  const char* world;      ///< "SimWorld": what run() puts before a rank's exception
  const char* transport;  ///< "SimTransport": what the transports' own errors start with
  const char* timeout;    ///< "SimOptions::timeout": the option a timeout names
};

/// One isend or irecv. A world that needs more (CUDA events) derives from it.
struct Message {
  bool is_send = false;
  int src = 0, dst = 0, tag = 0;
  const void* send = nullptr;  // isend
  void* recv = nullptr;        // irecv
  std::size_t bytes = 0;
  bool matched = false;  // paired with its other half, or cancelled (then `error` says why)
  std::string error;     // set when the pairing failed
  int peer() const noexcept { return is_send ? dst : src; }
};

/// A rank's requests between isend/irecv and their wait().
template <class M>
class Requests {
 public:
  Request add(std::shared_ptr<M> message) {
    const std::uint64_t id = next_++;
    pending_.emplace(id, std::move(message));
    return Request{id};
  }
  /// The request's message, now no longer pending; null when it was not pending.
  std::shared_ptr<M> take(Request request) {
    const auto it = pending_.find(request.id);
    if (it == pending_.end()) return nullptr;
    std::shared_ptr<M> message = std::move(it->second);
    pending_.erase(it);
    return message;
  }
  void clear() noexcept { pending_.clear(); }

 private:
  std::uint64_t next_ = 1;
  std::unordered_map<std::uint64_t, std::shared_ptr<M>> pending_;
};

/// The world of W rank threads; a world derives from it (M: its message type).
/// One mutex guards the state here and whatever the world publishes for a
/// collective (its slots).
template <class M>
class World {
 public:
  using Lock = std::unique_lock<std::mutex>;

  World(Names names, int world_size, std::optional<std::chrono::milliseconds> timeout)
      : names_(names), size_(world_size), timeout_(timeout) {
    if (world_size <= 0) fail(names.world, ": world_size = ", world_size, " must be at least 1");
  }
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  int world_size() const noexcept { return size_; }

  /// Runs body(r) on thread r for every rank and returns when all have
  /// returned; rethrows the first exception of any rank with "<world> rank r
  /// of W: " in front (same kind, original nested). reset_world() runs first,
  /// under the lock, once the world is known not to be running already.
  template <class ResetWorld, class Body>
  void run_ranks(ResetWorld&& reset_world, Body&& body) {
    {
      Lock lock(mutex_);
      if (running_) fail(names_.world, "::run: the world is already running");
      running_ = true;
      finished_.assign(static_cast<std::size_t>(size_), false);
      any_finished_ = false;
      arrived_ = 0;
      readers_ = 0;
      aborted_ = false;
      first_error_ = nullptr;
      failed_rank_ = -1;
      abort_reason_.clear();
      mailboxes_.clear();
      reset_world();
    }
    std::vector<std::thread> threads;
    threads.reserve(static_cast<std::size_t>(size_));
    try {
      for (int r = 0; r < size_; ++r) {
        threads.emplace_back([this, r, &body] {
          try {
            body(r);
          } catch (...) {
            abort(r, std::current_exception());
          }
          finish(r);
        });
      }
    } catch (...) {  // could not start a thread: release the ones that run
      abort(static_cast<int>(threads.size()), std::current_exception());
      for (auto& t : threads) t.join();
      stop_running();
      throw;
    }
    for (auto& t : threads) t.join();
    const auto [error, failed_rank] = stop_running();
    if (error) {
      try {
        std::rethrow_exception(error);
      } catch (...) {
        rethrow_with_context(concat(names_.world, " rank ", failed_rank, " of ", size_, ": "));
      }
    }
  }

  /// Ends a run under the lock (another thread's run() reads running_ under
  /// it) and hands back its first error, which a next run may reset.
  std::pair<std::exception_ptr, int> stop_running() {
    Lock lock(mutex_);
    running_ = false;
    return {first_error_, failed_rank_};
  }

  /// Whether run() is under way (for tests and diagnostics).
  bool running() const {
    Lock lock(mutex_);
    return running_;
  }

  /// Records the first failure and releases every waiting rank.
  void abort(int rank, std::exception_ptr e) {
    Lock lock(mutex_);
    abort_locked(rank, std::move(e));
  }

  /// Aborts the world with `e` and throws it from this rank, once no rank
  /// reads other ranks' buffers any more (this rank's may be freed next).
  [[noreturn]] void raise(Lock& lock, int rank, std::exception_ptr e) {
    abort_locked(rank, e);
    cv_.wait(lock, [&] { return readers_ == 0; });
    std::rethrow_exception(e);
  }

  /// Aborts the world with "<transport>: <op> on rank <rank> of W: <what>"
  /// (invalid_input) and throws it.
  [[noreturn]] void raise_invalid(int rank, const char* op, const std::string& what) {
    Lock lock(mutex_);
    raise(lock, rank, std::make_exception_ptr(invalid_input(concat(names_.transport, ": ", op, " on rank ", rank, " of ", size_, ": ", what))));
  }

  /// Wakes the ranks in wait_locked: call under the lock after changing what
  /// their `ready` reads.
  void notify_all() { cv_.notify_all(); }

  /// Waits for `ready` under `lock`, honouring the timeout and the abort.
  template <class Ready>
  void wait_locked(Lock& lock, int rank, const char* op, Ready ready) {
    auto released = [&] { return ready() || aborted_; };
    if (!timeout_) {
      cv_.wait(lock, released);
    } else if (!cv_.wait_for(lock, *timeout_, released)) {
      raise(lock, rank, std::make_exception_ptr(timeout_error(concat(title_of(op), " timeout on rank ", rank, " of ", size_, " in ", op,
                                                                     ": not complete after ", timeout_->count(), " ms (", names_.timeout, ")"))));
    }
    if (aborted_) raise_aborted(lock, rank, op);  // even when `ready`: the failure is the news
  }

  /// Runs `read`, which touches other ranks' published host buffers, on
  /// `rank`'s thread, unless the world is aborted; a rank leaving on an abort
  /// waits for it (raise). `read` returns an error message, empty when all
  /// went well; the failure is put down to rank `blame` (-1: `rank`).
  template <class Read>
  void read_others(int rank, const char* op, Read&& read, int blame = -1) {
    {
      Lock lock(mutex_);
      if (aborted_) raise_aborted(lock, rank, op);
      ++readers_;
    }
    std::string problem = read();
    Lock lock(mutex_);
    if (--readers_ == 0 && aborted_) cv_.notify_all();
    if (!problem.empty()) raise(lock, blame < 0 ? rank : blame, std::make_exception_ptr(invalid_input(problem)));
  }

  /// All ranks meet; every rank must bring the same call. The last to arrive
  /// runs on_meeting() under the lock before releasing the others. Returns
  /// the number of the meeting (1, 2, ...).
  template <class OnMeeting>
  std::uint64_t arrive_and_wait(int rank, const Call& call, OnMeeting&& on_meeting) {
    Lock lock(mutex_);
    if (aborted_) raise_aborted(lock, rank, call.op);
    if (arrived_ == 0) {
      call_ = call;
      first_rank_ = rank;
    } else if (!(call == call_)) {
      raise(lock, rank, std::make_exception_ptr(invalid_input(concat(names_.transport, ": rank ", rank, " called ", describe(call), " while rank ",
                                                                     first_rank_, " called ", describe(call_), " (collectives must match)"))));
    }
    const std::uint64_t generation = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      on_meeting();
      cv_.notify_all();
      return generation_;
    }
    bool stuck = false;
    wait_locked(lock, rank, call.op, [&] {
      if (generation_ != generation) return true;
      stuck = any_finished_;  // a rank that returned will never arrive
      return stuck;
    });
    if (stuck && generation_ == generation) {
      int gone = 0;
      while (!finished_[static_cast<std::size_t>(gone)]) ++gone;
      raise(lock, rank, std::make_exception_ptr(error(concat(names_.transport, ": ", call.op, " on rank ", rank, " of ", size_,
                                                             " cannot complete: rank ", gone, " has returned from its function"))));
    }
    return generation + 1;
  }
  std::uint64_t arrive_and_wait(int rank, const Call& call) {
    return arrive_and_wait(rank, call, [] {});
  }

  /// A new isend (is_send) or irecv of `rank` with `peer`; an invalid_input
  /// naming `op` when the peer is not a rank of the world.
  std::shared_ptr<M> new_message(int rank, const char* op, bool is_send, const void* send, void* recv, std::size_t bytes, int peer,
                                 int tag) {
    if (peer < 0 || peer >= size_) raise_invalid(rank, op, concat("peer ", peer, " is outside [0, ", size_, ")"));
    auto m = std::make_shared<M>();
    m->is_send = is_send;
    m->src = is_send ? rank : peer;
    m->dst = is_send ? peer : rank;
    m->tag = tag;
    m->send = send;
    m->recv = recv;
    m->bytes = bytes;
    return m;
  }

  /// Posts `message` of `rank`. When its other half is already posted the
  /// two are paired now, under the lock: pair(send, recv) moves the bytes (or
  /// enqueues their move) and may set the error both halves report. Sizes
  /// must agree exactly.
  template <class Pair>
  void post(int rank, const char* op, const std::shared_ptr<M>& message, Pair&& pair) {
    Lock lock(mutex_);
    if (aborted_) raise_aborted(lock, rank, op);
    Mailbox& box = mailboxes_[{message->src, message->dst}];
    auto& mine = message->is_send ? box.sends : box.recvs;
    auto& theirs = message->is_send ? box.recvs : box.sends;
    if (theirs.empty()) {
      mine.push_back(message);
      return;
    }
    const std::shared_ptr<M> other = std::move(theirs.front());
    theirs.pop_front();
    M& s = message->is_send ? *message : *other;
    M& r = message->is_send ? *other : *message;
    if (s.bytes != r.bytes) {
      s.error = r.error = concat("rank ", s.src, " sends ", s.bytes, " bytes with tag ", s.tag, " to rank ", s.dst, ", which receives ", r.bytes,
                                 " (sizes must agree)");
    } else {
      pair(s, r);
    }
    s.matched = r.matched = true;
    cv_.notify_all();
  }

  /// wait(): takes `request` from `rank`'s pending ones and blocks until its
  /// message is paired (or its peer has returned, or the world is aborted).
  /// An invalid_input naming "wait" when the request was not pending or its
  /// message cannot complete; otherwise returns the message.
  std::shared_ptr<M> wait_request(int rank, Requests<M>& pending, Request request) {
    const char* op = "wait";
    std::shared_ptr<M> message = pending.take(request);
    if (!message) raise_invalid(rank, op, concat("request ", request.id, " is not pending on this rank"));
    const int peer = message->peer();
    std::string problem;
    {
      Lock lock(mutex_);
      wait_locked(lock, rank, message->is_send ? "wait (isend)" : "wait (irecv)",
                  [&] { return message->matched || finished_[static_cast<std::size_t>(peer)]; });
      if (!message->matched) {
        problem = concat(message->is_send ? "isend to" : "irecv from", " rank ", peer, " with tag ", message->tag, " cannot complete: rank ",
                         peer, " has returned from its function");
      } else {
        problem = message->error;
      }
    }
    if (!problem.empty()) raise_invalid(rank, op, problem);
    return message;
  }

 protected:
  mutable std::mutex mutex_;  // the worlds' published slots are guarded by it too

 private:
  void abort_locked(int rank, std::exception_ptr e) {
    if (!first_error_) {
      first_error_ = e;
      failed_rank_ = rank;
      abort_reason_ = what_of(e);
    }
    aborted_ = true;
    cv_.notify_all();
  }

  /// Leaves a wait because the world was aborted (see raise).
  [[noreturn]] void raise_aborted(Lock& lock, int rank, const char* op) {
    cv_.wait(lock, [&] { return readers_ == 0; });
    throw error(concat(names_.transport, ": ", op, " on rank ", rank, " of ", size_, " aborted: rank ", failed_rank_, " failed first (",
                       abort_reason_, ")"));
  }

  /// A rank's function returned: its unpaired messages are cancelled (their
  /// buffers are gone) and ranks waiting for it are told.
  void finish(int rank) {
    Lock lock(mutex_);
    finished_[static_cast<std::size_t>(rank)] = true;
    any_finished_ = true;
    for (auto& [key, box] : mailboxes_) {
      for (auto* queue : {&box.sends, &box.recvs}) {
        std::erase_if(*queue, [&](const std::shared_ptr<M>& m) {
          if ((m->is_send ? m->src : m->dst) != rank) return false;
          m->matched = true;
          m->error = concat("rank ", rank, " returned without waiting for it");
          return true;
        });
      }
    }
    cv_.notify_all();
  }

  struct Mailbox {
    std::deque<std::shared_ptr<M>> sends, recvs;
  };

  Names names_;
  int size_;
  std::optional<std::chrono::milliseconds> timeout_;
  std::condition_variable cv_;
  bool running_ = false;
  // collectives
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  Call call_;
  int first_rank_ = 0;
  int readers_ = 0;  // ranks inside read_others
  // failure
  std::vector<bool> finished_;
  bool any_finished_ = false;
  bool aborted_ = false;
  std::exception_ptr first_error_;
  int failed_rank_ = -1;
  std::string abort_reason_;
  // point to point, keyed by (source, destination)
  std::map<std::pair<int, int>, Mailbox> mailboxes_;
};

}  // namespace cpdispatch::detail::sim
