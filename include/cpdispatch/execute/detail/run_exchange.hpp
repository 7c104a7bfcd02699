#pragma once
// The one engine that runs a planned exchange (an ExchangePlan) for every
// dispatcher of this directory: the Dispatcher, KvWireDispatcher and
// NodeWireDispatcher (each phase) call it with their data path and buffers.
//
// Over a PieceTransport it is one all_to_all_pieces on the caller's buffers
// (unless the caller opts out); otherwise the send side is packed into
// staging (unless it is direct), one all_to_all_v moves the bytes, and the
// receive side is unpacked from staging (unless direct). Then the traffic to
// this rank itself is copied. A single rank makes no transport call. A
// transport failure is rethrown with "<who>::<call> (rank r of W):
// <collective> failed: " in front, same kind; the data path's own failures
// pass unchanged.

#include <cstddef>

#include "cpdispatch/error.hpp"
#include "cpdispatch/execute/data_path.hpp"
#include "cpdispatch/execute/exchange_plan.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch::detail {

/// Who runs an exchange, for the context of a transport failure.
struct ExchangeCaller {
  const char* who;   ///< the dispatcher's class name
  const char* call;  ///< its member function
};

/// Runs `ex` from `in` to `out`. `which` names the piece lists to the data
/// path; `staging` holds ex.staging_bytes() bytes (unused over all_to_all_pieces).
/// `Pieces` false: all_to_all_v even over a PieceTransport (a plan without piece lists).
template <bool Pieces = true, class T, class Path, class Which>
void run_exchange(T& transport, Path& path, Which which, const ExchangePlan& ex, const std::byte* in, std::byte* out,
                  std::byte* staging, ExchangeCaller caller) {
  constexpr bool pieces = Pieces && PieceTransport<T>;
  const bool alone = transport.world_size() == 1;
  auto context = [&] {
    return concat(caller.who, "::", caller.call, " (rank ", transport.rank(), " of ", transport.world_size(), "): ",
                  pieces ? "all_to_all_pieces" : "all_to_all_v", " failed: ");
  };
  if constexpr (pieces) {  // no staging: the transport reads and writes the pieces in place
    try {
      if (!alone) transport.all_to_all_pieces(in, ex.send.pieces, ex.send.splits, out, ex.recv.pieces, ex.recv.splits);
    } catch (...) {
      rethrow_with_context(context());
    }
  } else {
    std::byte* recv_staging = staging + ex.recv_staging_offset();
    if (!ex.send.direct) path.copy(which, Stage::pack, ex.send.copies, in, staging);
    try {
      if (!alone) {
        transport.all_to_all_v(ex.send.direct ? static_cast<const void*>(in) : staging, ex.send.counts, ex.send.displs,
                               ex.recv.direct ? static_cast<void*>(out) : recv_staging, ex.recv.counts, ex.recv.displs);
      }
    } catch (...) {
      rethrow_with_context(context());
    }
    if (!ex.recv.direct) path.copy(which, Stage::unpack, ex.recv.copies, recv_staging, out);
  }
  path.copy(which, Stage::self, ex.self, in, out);
}

}  // namespace cpdispatch::detail
