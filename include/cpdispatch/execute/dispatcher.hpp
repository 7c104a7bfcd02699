#pragma once
// The per-rank dispatcher: moves one rank's tokens between the MLP layout and
// the attention layout through a Transport, as the plan's metadata says.
//
//   auto qkv = plan_qkv(plan);                       // same plan on every rank
//   Dispatcher q(transport, qkv.q_fwd, qkv.q_rev, q_token_bytes);
//   Dispatcher kv(transport, qkv.kv_fwd, qkv.kv_rev, kv_token_bytes);
//   q.forward(q_mlp, q_attn);                        // MLP -> attention layout
//   kv.forward(kv_mlp, kv_attn);                     // every copy is sent
//   ... attention ...
//   q.reverse(dq_attn, dq_mlp);                      // attention -> MLP layout
//   kv.reverse_combine(dkv_attn, dkv_replica, dkv_mlp, ElementType::bfloat16);
//
// A dispatcher is built from this rank's slices of a forward and a reverse
// metadata of the SAME tensor (q_fwd + q_rev, or kv_fwd + kv_rev): the forward
// slice says where this rank's tokens go, the reverse slice what it receives.
// Any pair the planner produces works; hand-made pairs must keep the planner's
// convention that a rank's reverse entries lie back to back, in order, in its
// attention layout (entry m at the sum of the lengths of entries 0..m-1).
//
// Each call: the tokens for each peer are packed into one contiguous segment
// (send side grouped by destination, in the order the receiver expects), ONE
// all_to_all_v moves them (byte counts; zero for the rank itself), and they
// are unpacked into place. Traffic to the rank itself is a local copy, never a
// transport call; with world_size() == 1 the transport is not called at all.
// Where a peer's pieces are already contiguous (forward receives and reverse
// sends, for plans from plan_query/plan_qkv) the transport reads or writes the
// caller's buffer directly and that copy is skipped. A transport that also
// offers all_to_all_pieces (PieceTransport, transport.hpp; the sim transport
// does) gets ONE all_to_all_pieces call instead, with the pieces in place: no
// pack, no unpack, no staging. All of this is computed once, at construction
// (O(entries log entries + world_size)), and again by replan for the next
// step's slices, in the same storage.
//
// Wire order: the pieces between two ranks travel in ascending order of their
// position in the receiver's attention layout, in both directions.
//
// Every rank must make the same sequence of dispatcher calls (each is one
// collective of the transport).
//
// Buffers (all in bytes; a token is `token_bytes` wide):
//   mlp        T tokens: this rank's shards back to back (forward input; the
//              output of reverse_combine and of reverse for one copy per shard)
//   attention  what this rank holds for attention (forward output, reverse input)
//   replica    the reverse output: [C][T] for metadata with copies (KV), where
//              copy c of shard j returns to c*T + P(j); == mlp otherwise.
//              Cells of copies that do not exist are left as they were.
//   staging    scratch for packing/unpacking; caller-owned (the overloads that
//              take it) or owned by the dispatcher (host: allocated on the
//              first call that needs it; device: at construction). None with
//              a PieceTransport.
// required_bytes() gives the sizes; larger buffers are fine, smaller ones
// throw capacity_error naming the buffer, the needed and the given size.
// Buffers of one call must not overlap (invalid_input). After construction
// and the first call, calls do not allocate.
//
// Errors: bad metadata or arguments throw invalid_input (capacity_error for
// short buffers) naming the rank; an exception from the transport propagates
// with "Dispatcher::<call> (rank r of W): all_to_all_v failed: " (or
// all_to_all_pieces) in front of its message, keeping its kind (backend_error
// keeps its code; the original is nested, see execute/detail/rethrow.hpp). The
// dispatcher stays usable afterwards (the transport may not be).
//
// The transport is held by reference and must outlive the dispatcher. A
// dispatcher is not thread-safe (one per rank and thread).
//
// Memory spaces: the buffer types (const_buffer, mutable_buffer) and the data
// path (local copies, combine, owned staging; execute/data_path.hpp) follow
// the transport's memory_space. Host transports take std::span<std::byte>.
// Device transports (NCCL, the device sim) take cuda::DeviceSpan, which host
// containers do not convert to, and name the CUDA data path as their member
// type `data_path` (cuda::DeviceDataPath): a translation unit that makes a
// dispatcher over them includes cpdispatch/cuda/data_path.hpp (compiled by
// nvcc), wherever it likes; without it the dispatcher is refused at compile
// time with a readable message. On a device
// path every call is stream-ordered on the transport's stream (kernels for
// the copies and the combine, pieces uploaded once at construction): no host
// synchronisation and no host access to the buffers, so a sequence of calls
// can be captured in a CUDA graph.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "cpdispatch/execute/exchange_owner.hpp"
#include "cpdispatch/execute/exchange_plan.hpp"
#include "cpdispatch/execute/plan_agreement.hpp"
#include "cpdispatch/execute/staged_exchange.hpp"
#include "cpdispatch/error.hpp"
#include "cpdispatch/plan/metadata.hpp"
#include "cpdispatch/bytes.hpp"
#include "cpdispatch/transport.hpp"

namespace cpdispatch {

/// The buffer sizes one dispatcher needs, in bytes.
struct BufferSizes {
  std::size_t mlp_bytes = 0;        ///< forward input; reverse_combine's gradient output
  std::size_t attention_bytes = 0;  ///< forward output; reverse input
  std::size_t replica_bytes = 0;    ///< reverse output ([C][T] replica buffer, or == mlp_bytes)
  std::size_t staging_bytes = 0;    ///< staging for any call (0: none needed)
  friend bool operator==(const BufferSizes&, const BufferSizes&) = default;
};

/// How a Dispatcher checks its plans.
struct DispatcherOptions {
  /// At construction and each replan, check that the ranks' slices belong to
  /// one plan (execute/plan_agreement.hpp: one all_to_all_v of a few words a
  /// peer per plan; a mismatch throws on every rank). Off for a bare
  /// dispatcher, whose construction is otherwise no collective; QkvDispatch
  /// and ContextParallelAttention check by default.
  bool check_plan_agreement = false;
};

template <class T>
class Dispatcher {
  CPDISPATCH_CHECK_ALL_TO_ALL_TRANSPORT(T);
  using Owner = detail::ExchangeOwner<T, 2>;  // slots by Direction
  using Direction = detail::Direction;
  /// A plan: the exchanges, and the reverse slice for the combine.
  struct State {
    detail::DispatchPlan plan;
    RankMetadata rev;
  };

 public:
  using transport_type = T;
  using const_buffer = typename Owner::const_buffer;  ///< in the transport's memory space
  using mutable_buffer = typename Owner::mutable_buffer;

  /// From this rank's slices of a forward and the matching reverse metadata.
  /// Throws invalid_input when a slice is not this transport's rank or world
  /// size, token_bytes is 0, or the two slices do not belong together; with
  /// options.check_plan_agreement also (on every rank) when the ranks' slices
  /// are not of one plan, which makes construction a collective.
  Dispatcher(T& transport, RankMetadata fwd, RankMetadata rev, std::size_t token_bytes, DispatcherOptions options = {})
      : owner_(transport, "Dispatcher"),
        token_bytes_(token_bytes),
        who_(detail::concat("Dispatcher (rank ", owner_.rank(), " of ", owner_.world_size(), ")")),
        check_(options.check_plan_agreement && owner_.world_size() > 1) {
    if (check_) agreement_.size(owner_.world_size(), 1);
    plan(fwd, rev, state_.now.plan);
    state_.now.rev = std::move(rev);
    lay_out();
    owner_.grow_staging(sizes_.staging_bytes);
  }

  /// The same from global metadata: takes the slices of transport.rank().
  Dispatcher(T& transport, const Metadata& fwd, const Metadata& rev, std::size_t token_bytes, DispatcherOptions options = {})
      : Dispatcher(transport, slices(transport, fwd, rev), token_bytes, options) {}

  /// The next step's slices of the same tensor, at the same token width.
  /// The dispatcher keeps its storage: once a plan fits what an earlier one
  /// needed, replanning allocates nothing (and the owned staging grows only
  /// when a plan needs more). On a throw it keeps its previous plan. Host
  /// transports (the device path uploads its piece lists at construction).
  void replan(const RankMetadata& fwd, const RankMetadata& rev)
    requires(detail::memory_space_of<T>() == MemorySpace::host)
  {
    prepare_replan(fwd, rev);
    commit_replan();
  }

  /// replan in two steps, for an owner that replans several dispatchers at
  /// once and must keep all old plans if any new one is refused:
  /// prepare_replan plans and checks (it may throw; the current plan stays in
  /// use), commit_replan switches to it (never throws; nothing without a
  /// prepared plan).
  void prepare_replan(const RankMetadata& fwd, const RankMetadata& rev)
    requires(detail::memory_space_of<T>() == MemorySpace::host)
  {
    state_.prepare([&](State& next) {
      plan(fwd, rev, next.plan);
      next.rev = rev;
    });
  }
  void commit_replan() noexcept {
    if (state_.commit()) lay_out();
  }

  const BufferSizes& required_bytes() const noexcept { return sizes_; }
  int rank() const noexcept { return owner_.rank(); }
  int world_size() const noexcept { return owner_.world_size(); }
  std::size_t token_bytes() const noexcept { return token_bytes_; }

  /// MLP layout -> attention layout (every copy is sent).
  void forward(const_buffer mlp, mutable_buffer attention) { forward(mlp, attention, own_staging()); }
  void forward(const_buffer mlp, mutable_buffer attention, mutable_buffer staging) {
    exchange("forward", Direction::forward, mlp, "mlp", attention, "attention", staging);
  }

  /// Attention layout -> MLP layout, or the [C][T] replica buffer for
  /// metadata with copies (use reverse_combine to sum the copies).
  void reverse(const_buffer attention, mutable_buffer replica) { reverse(attention, replica, own_staging()); }
  void reverse(const_buffer attention, mutable_buffer replica, mutable_buffer staging) {
    exchange("reverse", Direction::reverse, attention, "attention", replica, "replica", staging);
  }

  /// KV backward: brings every copy's gradient back into `replica` ([C][T]),
  /// then sums the copies of each shard into `grad` ([T]; fixed order,
  /// fp32 accumulation for 16-bit types). The exchange comes first; the
  /// combine runs only when it succeeded.
  void reverse_combine(const_buffer attention_grad, mutable_buffer replica, mutable_buffer grad, ElementType type) {
    reverse_combine(attention_grad, replica, grad, type, own_staging());
  }
  void reverse_combine(const_buffer attention_grad, mutable_buffer replica, mutable_buffer grad, ElementType type,
                       mutable_buffer staging) {
    const char* call = "reverse_combine";
    if (!rev().seq_recv_mask) owner_.fail(call, "the reverse metadata has no seq_recv_mask (it has one copy per shard); use reverse()");
    const detail::ExchangePlan& ex = plan_of(Direction::reverse);
    owner_.check_elements(call, type, token_bytes_, {{replica, "replica"}, {grad, "grad"}});  // the exchange copies bytes, the combine elements
    owner_.check_buffers(call,
                         {{grad, "grad", sizes_.mlp_bytes, plan_of(Direction::forward).input_tokens},
                          {staging, "staging", staging_of(ex)},
                          {attention_grad, "attention_grad", sizes_.attention_bytes, ex.input_tokens},
                          {replica, "replica", sizes_.replica_bytes, ex.output_tokens}},
                         token_bytes_);
    exchange(call, Direction::reverse, attention_grad, "attention_grad", replica, "replica", staging);
    owner_.data_path().combine(combine_, type, replica.data(), sizes_.replica_bytes, grad.data(), sizes_.mlp_bytes);
  }

 private:
  Dispatcher(T& transport, std::pair<RankMetadata, RankMetadata>&& slices, std::size_t token_bytes, DispatcherOptions options)
      : Dispatcher(transport, std::move(slices.first), std::move(slices.second), token_bytes, options) {}

  static std::pair<RankMetadata, RankMetadata> slices(const T& transport, const Metadata& fwd, const Metadata& rev) {
    const int r = transport.rank();
    for (auto [name, m] : {std::pair{"fwd", &fwd}, std::pair{"rev", &rev}}) {
      if (m->world_size != transport.world_size()) {
        detail::fail("Dispatcher (rank ", r, " of ", transport.world_size(), "): ", name, ".world_size = ", m->world_size,
                     " but the transport's world_size() = ", transport.world_size());
      }
      detail::check_shapes(*m, name);
    }
    return {fwd.get_slice(r), rev.get_slice(r)};
  }

  /// Plans the slices into `into`, with the plan agreement where asked for.
  void plan(const RankMetadata& fwd, const RankMetadata& rev, detail::DispatchPlan& into) {
    const auto local = [&] { planner_.plan(fwd, rev, token_bytes_, owner_.rank(), owner_.world_size(), who_, into); };
    if (check_) detail::PlanAgreement::run(local, [&](bool refused) { agree(fwd, rev, refused); });
    else local();
  }

  /// Plan agreement: this rank's record to every rank (also when it refused
  /// its slices, so that the others throw too), then the same verdict everywhere.
  void agree(const RankMetadata& fwd, const RankMetadata& rev, bool refused) {
    static constexpr const char* names[] = {""};
    const detail::AgreementSlot slot[] = {{names[0], &fwd, &rev}};
    detail::AgreementHeader h;
    h.world_size = fwd.world_size;
    h.config = detail::agreement_hash({token_bytes_});
    h.layout = detail::agreement_hash({fwd.has_copies, fwd.num_copies});
    agreement_.build(owner_.rank(), h, slot, refused);
    try {
      agreement_.exchange(owner_.transport());
    } catch (...) {
      detail::rethrow_with_context(detail::concat(who_, ": plan agreement: all_to_all_v failed: "));
    }
    if (!refused) agreement_.check("Dispatcher", owner_.rank(), names);
  }

  const detail::ExchangePlan& plan_of(Direction dir) const noexcept {
    return dir == Direction::forward ? state_.now.plan.forward : state_.now.plan.reverse;
  }
  const RankMetadata& rev() const noexcept { return state_.now.rev; }

  /// The staging an exchange needs: none for a PieceTransport.
  static std::size_t staging_of(const detail::ExchangePlan& ex) noexcept {
    if constexpr (PieceTransport<T>) return 0; else return ex.staging_bytes();
  }

  /// The plan's sizes and lists with the data path (the host path keeps
  /// views of the plan; once the lists have been seen, this allocates nothing).
  void lay_out() {
    const detail::DispatchPlan& plan = state_.now.plan;
    sizes_ = {plan.forward.input_bytes, plan.forward.output_bytes, plan.reverse.output_bytes,
              std::max(staging_of(plan.forward), staging_of(plan.reverse))};
    owner_.lay_out({&plan.forward, &plan.reverse}, [&](auto& path) {
      if (rev().seq_recv_mask) combine_ = path.add_combine(rev(), token_bytes_);  // reverse KV
    });
  }

  /// The owned staging (grown to the plan's at construction, so that a
  /// device dispatcher's calls never allocate; after a replan, at its first call).
  mutable_buffer own_staging() { return owner_.staging(sizes_.staging_bytes); }

  void exchange(const char* call, Direction dir, const_buffer in, const char* in_name, mutable_buffer out, const char* out_name,
                mutable_buffer staging) {
    const detail::ExchangePlan& ex = plan_of(dir);
    owner_.check_buffers(call,
                         {{staging, "staging", staging_of(ex)}, {in, in_name, ex.input_bytes, ex.input_tokens}, {out, out_name, ex.output_bytes, ex.output_tokens}},
                         token_bytes_);
    owner_.run(static_cast<std::size_t>(dir), ex, in.data(), out.data(), staging.data(), call);
  }

  Owner owner_;
  std::size_t token_bytes_;
  std::string who_;                 // "Dispatcher (rank r of W)", in front of planning errors
  bool check_;                      // plan agreement at construction and replan
  detail::PlanAgreement agreement_;
  detail::DispatchPlanner planner_;  // its storage, kept for replan
  detail::ReplanPair<State> state_;  // the plan in use, and prepare_replan's
  BufferSizes sizes_;
  std::size_t combine_ = 0;  // the combine's id with the data path (reverse KV)
};

}  // namespace cpdispatch
