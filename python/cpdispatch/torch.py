"""cpdispatch for PyTorch: the planned exchange over torch.distributed.

    from cpdispatch.torch import RankDispatch, ContextParallelAttention

    dispatch = RankDispatch(plan)            # this rank's share of the plan (dist.get_rank())
    attention = ContextParallelAttention()
    out = attention(q, k, v, dispatch)       # q, k, v: [tokens, heads, dim] in the MLP layout

The C++ core gives each rank the gather/scatter token indices of its
exchanges (cpdispatch.token_indices); this module only runs
``index_select`` / ``index_copy_`` / ``index_add_`` and
``torch.distributed.all_to_all_single`` with the split sizes from the
metadata. Each step is a torch.autograd.Function, so gradients flow through
``loss.backward()``: the backward of the key-value dispatch is the reverse
exchange into the [C][T] replica buffer followed by the copy combine (copies
summed in ascending order), and with dedup the fan-in before it.

The default attention kernel, varlen_attention, is flash-attention's
algorithm in PyTorch ops: memory bounded by its block sizes, grouped-query
attention, the log-sum-exp on request. ContextParallelAttention takes it or
flash-attention's or sdpa's by name (KERNELS), or any varlen callable, and
with ``stages`` > 1 overlaps the exchange with the attention: what this rank
holds is attended while the rest arrives, and the parts merge by their
log-sum-exps.

A plan whose documents carry slices (docs/plan-format.md section 2e:
shared prefixes, block-causal frames, prefix-LM) gives each rank attention
entries, (q_start, q_len, kv_start, kv_len, lo, hi) with a band lo <= t - j
<= hi on key row minus query row (None: open); RankDispatch.entries holds
them and the kernels take them (``entries=``), several per query row
folded into one softmax.
"""

import bisect
import importlib
import inspect
import math
import numbers
import re

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

import cpdispatch

__all__ = ["RankDispatch", "ContextParallelAttention", "varlen_attention", "attention_mask", "BLOCK_Q", "BLOCK_KV", "BlockwiseKernel",
           "FlashAttnVarlenKernel", "SdpaKernel", "KERNELS", "kernel_adapter"]


def _tensor(array):
    return torch.from_numpy(array)  # shares the planner's storage


def _at(index, x):
    return index if index.device == x.device else index.to(x.device)


class _Exchange:
    """One exchange's indices (send_index, recv_index) and split sizes."""

    def __init__(self, ix):
        self.send_index = _tensor(ix["send_index"])
        self.recv_index = _tensor(ix["recv_index"])
        self.send_counts = ix["send_counts"].tolist()
        self.recv_counts = ix["recv_counts"].tolist()
        self.output_tokens = ix["output_tokens"]

    def __call__(self, x, group):
        send = x.index_select(0, _at(self.send_index, x))
        if dist.is_available() and dist.is_initialized():
            recv = x.new_empty((sum(self.recv_counts),) + tuple(x.shape[1:]))
            dist.all_to_all_single(recv, send, self.recv_counts, self.send_counts, group=group)
        elif len(self.send_counts) == 1:
            recv = send  # one rank and no process group: everything stays here
        else:
            raise RuntimeError("cpdispatch.torch: a plan of several ranks needs torch.distributed initialised")
        out = x.new_zeros((self.output_tokens,) + tuple(x.shape[1:]))
        return out.index_copy_(0, _at(self.recv_index, x), recv)


class _Route:
    """A (forward, reverse) exchange pair and the copy combine of one tensor kind."""

    def __init__(self, ix):
        self.forward = _Exchange(ix["forward"])
        self.reverse = _Exchange(ix["reverse"])
        self.tokens = ix["tokens"]
        self.combine_source = _tensor(ix["combine_source"])
        self.combine_target = _tensor(ix["combine_target"])

    def combine(self, replica):
        """[C][T] replica rows -> [T]: each copy added in ascending copy order."""
        if replica.shape[0] == self.tokens:
            return replica  # one copy per shard: nothing to sum
        out = replica.new_zeros((self.tokens,) + tuple(replica.shape[1:]))
        return out.index_add_(0, _at(self.combine_target, replica), replica.index_select(0, _at(self.combine_source, replica)))


class _Dispatch(torch.autograd.Function):
    """MLP layout -> attention layout; backward: reverse exchange + combine."""

    @staticmethod
    def forward(ctx, x, route, group):
        ctx.route, ctx.group = route, group
        return route.forward(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.route.combine(ctx.route.reverse(grad.contiguous(), ctx.group)), None, None


class _DedupDispatch(torch.autograd.Function):
    """Key-values once per destination rank, then the fan-out to every KV
    group; backward: fan-in, reverse wire exchange, combine."""

    @staticmethod
    def forward(ctx, x, wire, fan_source, wire_tokens, group):
        ctx.wire, ctx.fan_source, ctx.wire_tokens, ctx.group = wire, fan_source, wire_tokens, group
        return wire.forward(x, group).index_select(0, _at(fan_source, x))

    @staticmethod
    def backward(ctx, grad):
        fanned_in = grad.new_zeros((ctx.wire_tokens,) + tuple(grad.shape[1:])).index_add_(0, _at(ctx.fan_source, grad), grad)
        return ctx.wire.combine(ctx.wire.reverse(fanned_in, ctx.group)), None, None, None, None


class _Undispatch(torch.autograd.Function):
    """Attention layout -> MLP layout (the query route's reverse exchange)."""

    @staticmethod
    def forward(ctx, y, route, group):
        ctx.route, ctx.group = route, group
        return route.reverse(y, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.route.forward(grad.contiguous(), ctx.group), None, None


def _pick(index, counts, keep):
    """The rows of ``index`` (one segment of ``counts[p]`` rows per peer p)
    of the peers ``keep`` marks, and the counts with the others' zeroed."""
    peer = torch.repeat_interleave(torch.arange(len(counts)), torch.as_tensor(counts, dtype=torch.long))
    return index[torch.as_tensor(keep, dtype=torch.bool)[peer]], [c if k else 0 for c, k in zip(counts, keep)]


class _Selection:
    """The rows of one exchange that one stage carries: to and from the peers it marks."""

    def __init__(self, exchange, send_peers, recv_peers):
        self.send_index, self.send_counts = _pick(exchange.send_index, exchange.send_counts, send_peers)
        self.recv_index, self.recv_counts = _pick(exchange.recv_index, exchange.recv_counts, recv_peers)


class _Joint:
    """Exchanges of several tensors in ONE all_to_all_single: each peer's
    segment holds its rows of the first tensor, then of the second, ...,
    flattened, so one collective carries queries and key-values (or their
    gradients). ``send_peers`` / ``recv_peers``: which peers' traffic this
    stage carries (all of them: the whole exchange)."""

    def __init__(self, exchanges, send_peers, recv_peers):
        self.parts = [_Selection(e, send_peers, recv_peers) for e in exchanges]
        self.send_peers = [p for p in range(len(send_peers)) if any(s.send_counts[p] for s in self.parts)]
        self.recv_peers = [p for p in range(len(recv_peers)) if any(s.recv_counts[p] for s in self.parts)]

    def post(self, xs, group, collective=True):
        """Packs and posts (async_op); ``collective=False``: traffic to this rank alone, no collective."""
        widths = [math.prod(x.shape[1:]) for x in xs]
        rows = [x.index_select(0, _at(s.send_index, x)).reshape(len(s.send_index), w) for x, s, w in zip(xs, self.parts, widths)]
        by_peer = [r.split(s.send_counts) for r, s in zip(rows, self.parts)]
        pieces = [b[p].reshape(-1) for p in self.send_peers for b in by_peer]
        send = torch.cat(pieces) if pieces else xs[0].new_empty(0)
        if not collective:
            return _Posted(self, widths, send, send, None)
        recv_split = _elements([s.recv_counts for s in self.parts], widths)
        recv = send.new_empty(sum(recv_split))
        work = dist.all_to_all_single(recv, send, recv_split, _elements([s.send_counts for s in self.parts], widths), group=group, async_op=True)
        return _Posted(self, widths, send, recv, work)


def _elements(counts, widths):
    """Elements per peer of several tensors' rows: each one's rows times its row width."""
    return [sum(c * w for c, w in zip(per_peer, widths)) for per_peer in zip(*counts)]


class _Posted:
    """One posted joint exchange: ``land`` waits for it and unpacks each tensor's rows into its output."""

    def __init__(self, joint, widths, send, recv, work):
        self.joint, self.widths, self.recv, self.work = joint, widths, recv, work
        self.send = send  # kept until the exchange completes

    def land(self, outs):
        if self.work is not None:
            self.work.wait()
        self.send = None
        parts = self.joint.parts
        sizes = [s.recv_counts[p] * w for p in self.joint.recv_peers for s, w in zip(parts, self.widths)]
        chunks = self.recv.split(sizes)
        for i, (out, s) in enumerate(zip(outs, parts)):
            got = chunks[i::len(parts)]
            rows = torch.cat(got) if got else out.new_empty(0)
            out.index_copy_(0, _at(s.recv_index, out), rows.view((len(s.recv_index),) + tuple(out.shape[1:])))
        return outs


class RankDispatch:
    """One rank's share of a qkv plan, ready to run.

    ``plan``: the plan every rank holds (a dict or JSON text, e.g. from
    cpdispatch.balance, or a cpdispatch.Plan). ``rank`` defaults to ``dist.get_rank(group)``.
    ``dedup`` (default: the plan's "dedup") sends each key-value shard once per
    destination rank. Attributes: ``meta`` (cpdispatch.plan_for_rank),
    ``mask`` (the plan's attention mask), ``position_ids`` (int64 tensor: each
    MLP-layout token's position within its document, for RoPE), ``entries``
    (a plan whose documents have slices: the rank's attention entries,
    (q_start, q_len, kv_start, kv_len, lo, hi) over its attention-layout
    buffers, from the plan's attn.entries; None otherwise: one entry per
    query shard under ``mask``).
    ``max_memory`` bounds the reading and planning (cpdispatch.plan_for_rank)."""

    def __init__(self, plan, rank=None, dedup=False, group=None, *, max_memory=cpdispatch.DEFAULT_MAX_MEMORY):
        if rank is None:
            rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
        self.rank, self.group = rank, group
        if not isinstance(plan, cpdispatch.Plan):
            plan = cpdispatch.Plan(plan, max_memory=max_memory)  # read once for the calls below
        # This rank's share, planned once: every call below (and staging, invariant_layout) reads it.
        self._share = cpdispatch._cpdispatch.RankShare(cpdispatch._core(plan), rank, dedup, max_memory)
        self.meta = cpdispatch._cpdispatch.plan_for_rank(self._share, rank, dedup, max_memory)
        self._dedup, self._max_memory = dedup, max_memory
        if "hp_attn" in self.meta:  # the same on every rank: none goes on to the collectives alone
            raise ValueError("the plan has head-parallel documents (docs/plan-format.md section 2f): "
                             "cpdispatch.torch does not support them yet; plan them as dispatched documents")
        ix = cpdispatch._cpdispatch.token_indices(self._share, rank, dedup, max_memory)
        if "kv" not in ix:
            raise ValueError("RankDispatch takes a qkv plan (queries and key-values); this is a query plan")
        self.mask = cpdispatch.mask_of(plan)
        self.position_ids = _tensor(cpdispatch.position_ids(plan, rank))
        self.q_route = _Route(ix["q"])
        self.kv_route = _Route(ix["kv"])
        self.wire_route = _Route(ix["kv_wire"]) if "kv_wire" in ix else None
        if self.wire_route is not None:
            self.fan_source = _tensor(ix["fan"]["fan_source"])
            self.wire_tokens = ix["fan"]["wire_tokens"]
        attn = self.meta["attn"]
        self.cu_seqlens_q = _tensor(attn["cu_seqlens_q"])
        self.cu_seqlens_kv = _tensor(attn["cu_seqlens_kv"])
        self.max_seqlen_q = attn["max_seqlen_q"]
        self.max_seqlen_kv = attn["max_seqlen_kv"]
        self.entries = _rank_entries(attn)
        if self.entries is None and _has_slices(plan):  # on every rank alike: none goes on to the collectives alone
            raise ValueError("the plan's documents have slices, but the planner gave no attention entries (attn.entries): "
                             "this cpdispatch module plans no slices (docs/plan-format.md section 2e)")
        self._stagings = {}
        self._invariant_layouts = {}

    @property
    def dedup(self):
        return self.wire_route is not None

    def dispatch_q(self, x):
        """Queries (or anything laid out like them), MLP -> attention layout."""
        return _Dispatch.apply(x, self.q_route, self.group)

    def dispatch_kv(self, x):
        """Keys or values, MLP layout -> KV attention layout (every KV group)."""
        if self.wire_route is not None:
            return _DedupDispatch.apply(x, self.wire_route, self.fan_source, self.wire_tokens, self.group)
        return _Dispatch.apply(x, self.kv_route, self.group)

    def undispatch(self, y):
        """Attention outputs, attention layout -> MLP layout."""
        return _Undispatch.apply(y, self.q_route, self.group)

    def invariant_layout(self, grid):
        """The invariant mode's entries over this rank's attention buffers
        and each one's phase on the grid (its first query and key row's
        packed position modulo ``grid``), as the C++ op lays them out, built
        once per grid. A collective where a process group is initialised:
        every rank raises when some rank's share has a cut off the grid."""
        if grid not in self._invariant_layouts:
            refusal = None
            try:
                layout = cpdispatch._cpdispatch.invariant_layout(self._share, self.rank, self._dedup, grid, self._max_memory)
            except ValueError as e:
                refusal = e
            world = len(self.q_route.forward.send_counts)
            if _collective(world):
                verdicts = torch.zeros(world, dtype=torch.int64)
                verdicts[self.rank] = refusal is not None
                dist.all_reduce(verdicts, group=self.group)
                if refusal is None and bool(verdicts.any()):
                    bad = torch.nonzero(verdicts).flatten().tolist()
                    raise ValueError(f"invariant=True: the share of rank(s) {bad} has a cut off the grid of {grid} tokens (their errors name it; "
                                     f"plan with cpdispatch.balance(..., grid={grid}) and an MLP layout cut on it)")
            if refusal is not None:
                raise refusal
            self._invariant_layouts[grid] = _InvariantLayout(layout["entries"], layout["phases"], grid, layout["tokens"])
        return self._invariant_layouts[grid]

    def staging(self, stages):
        """What ContextParallelAttention(stages=stages) exchanges and attends in which round, built once per stage count."""
        groups = cpdispatch._cpdispatch.stage_groups(stages, len(self.q_route.forward.send_counts))
        if groups not in self._stagings:
            self._stagings[groups] = _Staging(self, stages)
        return self._stagings[groups]


def _rank_entries(attn):
    """A rank's attn.entries (section 2e: per query shard, [q0, q1, k0, k1,
    lo, hi] in the shard's own rows and its KV group's columns) as the
    kernels' entries over the rank's buffers, (q_start, q_len, kv_start,
    kv_len, lo, hi): rows and columns moved to the shard's and the group's
    starts, the band by the difference of the two. None where the plan has none."""
    per_shard = attn.get("entries")
    if per_shard is None:
        return None
    cu_q, cu_kv = attn["cu_seqlens_q"].tolist(), attn["cu_seqlens_kv"].tolist()
    if len(per_shard) != len(cu_q) - 1:
        raise ValueError(f"attn.entries has {len(per_shard)} query shards, but cu_seqlens_q has {len(cu_q) - 1}")
    out = []
    for start_q, start_kv, shard in zip(cu_q, cu_kv, per_shard):
        s = start_kv - start_q
        for q0, q1, k0, k1, lo, hi in shard:
            out.append((start_q + q0, q1 - q0, start_kv + k0, k1 - k0, None if lo is None else lo + s, None if hi is None else hi + s))
    return out


def _has_slices(plan):
    """Whether some document of the plan carries slices (section 2e)."""
    source = plan.source if isinstance(plan, cpdispatch.Plan) else plan
    documents = source.get("documents") if isinstance(source, dict) else None
    return any(isinstance(doc, dict) and doc.get("slices") is not None for doc in documents or [])


class _Mask:
    """The plan's mask (docs/plan-format.md section 2d), read and checked by
    the library, as a band on t - p over a whole document: causal (None, 0),
    full (None, None), a sliding window of w (1 - w, 0). Inside an entry of
    lq query and lk key rows it is bottom-right aligned: the band shifted by
    lk - lq."""

    def __init__(self, mask):
        self.lo, self.hi = cpdispatch._cpdispatch.mask_band(mask)

    def band(self, shift=0):
        """(lo, hi) on t - p, None for an open end, shifted by ``shift``."""
        return tuple(None if end is None else end + shift for end in (self.lo, self.hi))


#: An open end of a band, as a number (lo = -_OPEN, hi = _OPEN): beyond any row difference.
_OPEN = 1 << 62


def _ends(lo, hi):
    """A band's ends as numbers (open ends at -_OPEN / _OPEN)."""
    return -_OPEN if lo is None else lo, _OPEN if hi is None else hi


def _entries(cu_seqlens_q, cu_seqlens_kv, queries, keys, mask):
    """The entries of a varlen layout, checked (the library's layout_entries):
    entry i's query rows against its key rows under the plan's mask,
    bottom-right aligned, as (q_start, q_len, kv_start, kv_len, lo, hi) with
    the band in the buffers' rows; empty entries left out."""
    cu_q = [int(x) for x in torch.as_tensor(cu_seqlens_q).tolist()]
    cu_kv = [int(x) for x in torch.as_tensor(cu_seqlens_kv).tolist()]
    return cpdispatch._cpdispatch.layout_entries(cu_q, cu_kv, queries, keys, mask)


def _parts(parts, queries, keys):
    """Explicit entries (q_start, q_len, kv_start, kv_len, lo, hi) as tuples
    of ints (lo, hi: int or None), checked against the rows by the library;
    those whose band holds no pair of their rectangle are left out."""
    return cpdispatch._cpdispatch.explicit_entries(parts, queries, keys)


def attention_mask(cu_seqlens_q, cu_seqlens_kv, mask=None, device=None, *, entries=None):
    """[queries, keys] bool: True where a query row sees a key row.

    Without ``entries``: entries are independent (block diagonal); inside
    entry i with lq query and lk key rows, row j sees column t by the plan's
    mask, bottom-right aligned (docs/plan-format.md section 2d): causal
    t <= j + lk - lq, sliding window j + lk - lq - w < t <= j + lk - lq,
    full always. With ``entries`` ((q_start, q_len, kv_start, kv_len, lo,
    hi), the band on t - j in the buffers' rows, None an open end), the
    union of theirs; cu_seqlens then give only the size (None: the entries'
    extent). Dense: for tests and small inputs; the kernels never build it."""
    def total(cu):
        return None if cu is None else int(torch.as_tensor(cu).reshape(-1)[-1])

    queries, keys = total(cu_seqlens_q), total(cu_seqlens_kv)
    if entries is None:
        entries = _entries(cu_seqlens_q, cu_seqlens_kv, queries, keys, mask)
    else:
        entries = list(entries)
        queries = max([queries or 0] + [int(e[0]) + int(e[1]) for e in entries])
        keys = max([keys or 0] + [int(e[2]) + int(e[3]) for e in entries])
        entries = _parts(entries, queries, keys)
    seen = torch.zeros(queries, keys, dtype=torch.bool)
    for q0, lq, k0, lk, lo, hi in entries:
        lo, hi = _ends(lo, hi)
        d = torch.arange(k0, k0 + lk)[None, :] - torch.arange(q0, q0 + lq)[:, None]
        seen[q0:q0 + lq, k0:k0 + lk] |= (d >= lo) & (d <= hi)
    return seen.to(device) if device is not None else seen


#: Default query and key block sizes of varlen_attention: large enough that
#: CPU matrix products, not Python, dominate; small enough for GPU caches.
BLOCK_Q = 256
BLOCK_KV = 512


def _accumulator(dtype):
    """Softmax and gradient sums in float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows(x, r0, r1, groups, acc):
    """Rows r0 .. r1-1 of x [tokens, heads, dim] as [heads / groups, groups * rows, dim]
    in the accumulator dtype: the queries of a GQA group stacked, so that one
    batched product per key-value head serves them all."""
    block = x[r0:r1].to(acc).transpose(0, 1)
    return block.reshape(block.shape[0] // groups, groups * block.shape[1], block.shape[2])


def _row_runs(entries):
    """The runs of query rows that entries share: [(first row, end, entry indices in order)],
    entries whose rows overlap (directly or through others) in one run."""
    order = sorted(range(len(entries)), key=lambda e: entries[e][0])
    runs = []
    for e in order:
        q0, lq = entries[e][0], entries[e][1]
        if runs and q0 < runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], q0 + lq)
            runs[-1][2].append(e)
        else:
            runs.append([q0, q0 + lq, [e]])
    return [(a, b, sorted(members)) for a, b, members in runs]


class _Problem:
    """What the forward and backward share: shapes, entries, blocks.

    Entries are (q_start, q_len, kv_start, kv_len, lo, hi): row j of
    [q_start, q_start + q_len) sees row t of [kv_start, kv_start + kv_len)
    when lo <= t - j <= hi (buffer rows; None: an open end). Entries may
    share query rows and key rows: each run of rows that entries share is
    cut into query blocks of ``block_q`` rows, and each block's online
    softmax runs over the key blocks of every entry it meets (``blocks``:
    (r0, r1, [(entry, c0, c1), ...]), only key blocks some row of the block
    sees)."""

    def __init__(self, q, k, v, entries, softmax_scale, block_q, block_kv):
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or k.shape[:2] != v.shape[:2] or q.shape[2] != k.shape[2]:
            raise ValueError(f"q [queries, heads, dim], k and v [keys, heads_kv, dim]: got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
            raise ValueError(f"heads of q ({q.shape[1]}) must be a multiple of the heads of k and v ({k.shape[1]})")
        if block_q < 1 or block_kv < 1:
            raise ValueError(f"block_q = {block_q} and block_kv = {block_kv} must be positive")
        self.entries = entries
        self.scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        self.groups = q.shape[1] // k.shape[1]
        self.acc = _accumulator(q.dtype)
        self.block_q, self.block_kv = block_q, block_kv
        self.blocks = []
        for start, end, members in _row_runs(entries):
            for r0 in range(start, end, block_q):
                r1 = min(end, r0 + block_q)
                self.blocks.append((r0, r1, [visit for e in members for visit in self._key_blocks(e, r0, r1)]))

    def _key_blocks(self, e, r0, r1):
        """(e, c0, c1) of the key blocks of entry e that some row of r0 .. r1-1 sees."""
        q0, lq, k0, lk, lo, hi = self.entries[e]
        a, b = max(r0, q0), min(r1, q0 + lq)
        lo, hi = _ends(lo, hi)
        t0, t1 = max(k0, a + lo), min(k0 + lk, b + hi)  # row j sees j + lo .. j + hi
        return [(e, c0, min(t1, c0 + self.block_kv)) for c0 in range(t0, t1, self.block_kv)] if a < b else []

    def scores(self, qb, kb, r0, r1, e, c0, c1):
        """[heads_kv, groups * rows, keys] scaled scores of rows r0 .. r1-1 against
        keys c0 .. c1-1 of entry e, -inf where it hides a key (rows outside it too)."""
        s = torch.bmm(qb, kb.transpose(1, 2)).mul_(self.scale)
        q0, lq, _, _, lo, hi = self.entries[e]
        lo, hi = _ends(lo, hi)
        inside = q0 <= r0 and r1 <= q0 + lq
        if inside and lo <= c0 - (r1 - 1) and c1 - 1 - r0 <= hi:
            return s  # every row sees every key: no mask to build
        j = torch.arange(r0, r1, device=s.device)[:, None]
        d = torch.arange(c0, c1, device=s.device)[None, :] - j
        seen = (d >= lo) & (d <= hi)
        if not inside:
            seen &= (j >= q0) & (j < q0 + lq)
        s.view(s.shape[0], -1, r1 - r0, c1 - c0).masked_fill_(~seen, float("-inf"))
        return s


def _forward(p, q, k, v):
    """Flash-attention's forward: out [queries, heads, dim_v] and lse [heads, queries]."""
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=p.acc, device=q.device)
    for r0, r1, visits in p.blocks:
        o, block_lse = _forward_block(p, _rows(q, r0, r1, p.groups, p.acc), k, v, r0, r1, visits)
        out[r0:r1] = o.reshape(q.shape[1], r1 - r0, -1).transpose(0, 1)
        lse[:, r0:r1] = block_lse.reshape(q.shape[1], r1 - r0)
    return out, lse


def _forward_block(p, qb, k, v, r0, r1, visits):
    """One query block against the key blocks it sees, of every entry, in one online softmax."""
    rows = qb.shape[:2]
    m = torch.full(rows, float("-inf"), dtype=p.acc, device=qb.device)  # running row maximum
    l = torch.zeros(rows, dtype=p.acc, device=qb.device)  # running sum of exp(s - m)
    acc = torch.zeros(rows + (v.shape[2],), dtype=p.acc, device=qb.device)
    for e, c0, c1 in visits:
        s = p.scores(qb, _rows(k, c0, c1, 1, p.acc), r0, r1, e, c0, c1)
        m_new = torch.maximum(m, s.amax(-1))
        shift = m_new.masked_fill(m_new == float("-inf"), 0.0)  # a row with no key yet: exp(-inf - 0) = 0, not nan
        s.sub_(shift[..., None]).exp_()
        alpha = torch.exp(m - shift)
        l.mul_(alpha).add_(s.sum(-1))
        acc.mul_(alpha[..., None]).baddbmm_(s, _rows(v, c0, c1, 1, p.acc))
        m = m_new
    lse = m.masked_fill(m == float("-inf"), 0.0) + l.log()  # l == 0: no key seen, lse -inf
    return acc / l.masked_fill(l == 0, 1.0)[..., None], lse


def _backward(p, q, k, v, out, lse, dout, dlse):
    """Flash-attention's backward by recomputation: dq (q's dtype), dk, dv
    (the accumulator's: the caller casts, or sums several calls first).
    ``dlse`` None: no gradient reaches lse."""
    dq = torch.zeros_like(q)
    dk = torch.zeros(k.shape, dtype=p.acc, device=k.device)  # the gradients themselves unless q is 16-bit
    dv = torch.zeros(v.shape, dtype=p.acc, device=v.device)
    for r0, r1, visits in p.blocks:
        qb, dob = _rows(q, r0, r1, p.groups, p.acc), _rows(dout, r0, r1, p.groups, p.acc)
        rows = qb.shape[:2]
        # D = rowsum(dO * O), less lse's gradient: d lse / d s is P itself, so it joins D
        d = (dob * _rows(out, r0, r1, p.groups, p.acc)).sum(-1)
        if dlse is not None:
            d.sub_(dlse[:, r0:r1].to(p.acc).reshape(rows))
        row_lse = lse[:, r0:r1].to(p.acc).reshape(rows)
        row_lse = row_lse.masked_fill(row_lse == float("-inf"), float("inf"))  # a row that sees nothing: P = 0
        dqb = torch.zeros_like(qb)
        for e, c0, c1 in visits:
            kb, vb = _rows(k, c0, c1, 1, p.acc), _rows(v, c0, c1, 1, p.acc)
            prob = p.scores(qb, kb, r0, r1, e, c0, c1).sub_(row_lse[..., None]).exp_()
            dv[c0:c1].add_(torch.bmm(prob.transpose(1, 2), dob).transpose(0, 1))
            ds = prob.mul_(torch.bmm(dob, vb.transpose(1, 2)).sub_(d[..., None]))
            dqb.baddbmm_(ds, kb)
            dk[c0:c1].add_(torch.bmm(ds.transpose(1, 2), qb).mul_(p.scale).transpose(0, 1))
        dq[r0:r1] = dqb.mul_(p.scale).reshape(q.shape[1], r1 - r0, -1).transpose(0, 1)
    return dq, dk, dv


class _FlashAttention(torch.autograd.Function):
    """Blockwise attention; backward recomputes the scores from q, k, the output and lse."""

    @staticmethod
    def forward(ctx, q, k, v, problem):
        out, lse = _forward(problem, q, k, v)
        ctx.problem = problem
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    @once_differentiable  # the backward's own ops are not differentiated again
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(ctx.problem, q, k, v, out, lse, dout, dlse)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None


def varlen_attention(q, k, v, cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None, mask=None, softmax_scale=None, *,
                     entries=None, block_q=BLOCK_Q, block_kv=BLOCK_KV, return_lse=False):
    """Variable-length attention in plain PyTorch ops, by flash-attention's
    algorithm (any device, any float dtype, differentiable).

    q [queries, heads, dim], k [keys, heads_kv, dim], v [keys, heads_kv,
    dim_v]; heads a multiple of heads_kv (grouped-query attention: query
    head h reads key-value head h // (heads / heads_kv)). Entries by
    cu_seqlens (rows past the last entry give 0); each entry's mask is the
    plan's (``mask``, default causal), bottom-right aligned (attention_mask).

    ``entries`` instead: a list of (q_start, q_len, kv_start, kv_len, lo,
    hi), query row j seeing key row t when lo <= t - j <= hi (buffer rows,
    None an open end), as a plan with slices gives them
    (RankDispatch.entries); cu_seqlens and mask are then not used. Entries
    may share query rows (a row's softmax runs over all the keys its
    entries show it) and key rows (their gradients add up).

    Queries go in blocks of ``block_q`` rows against the key blocks of
    ``block_kv`` rows that the entries leave visible, with an online
    softmax; the backward recomputes the scores block by block. Memory
    beyond the inputs and outputs is a few [heads, block_q, block_kv]
    tensors, whatever the sequence length (and, for 16-bit inputs, float32
    gradient sums of k's and v's size). Sums run in float32 (float64 for
    float64 inputs).

    ``return_lse=True`` returns (out, lse): lse [heads, queries], each row's
    natural-log log-sum-exp of its scaled scores, in the accumulator dtype,
    -inf (and output 0) for a row that sees no key; it is differentiable.
    The signature follows flash-attention's flash_attn_varlen_func, which a
    GPU caller may pass to ContextParallelAttention instead."""
    del max_seqlen_q, max_seqlen_kv  # what a fused kernel sizes its tiles by
    if entries is None:
        if cu_seqlens_q is None or cu_seqlens_kv is None:
            raise ValueError("varlen_attention needs cu_seqlens_q and cu_seqlens_kv, or entries")
        entries = _entries(cu_seqlens_q, cu_seqlens_kv, q.shape[0], k.shape[0], mask)
    else:
        entries = _parts(entries, q.shape[0], k.shape[0])
    problem = _Problem(q, k, v, entries, softmax_scale, block_q, block_kv)
    out, lse = _FlashAttention.apply(q, k, v, problem)
    return (out, lse) if return_lse else out


class BlockwiseKernel:
    """The default kernel, varlen_attention (blockwise, plain PyTorch: any
    device and float dtype), as an adapter; takes every stage count and
    entries that share rows (one online softmax per row).

    ``invariant=True``: calls run the C++ host kernel's invariant mode
    instead (CPU tensors of float32, bfloat16 or float16; ``threads`` of
    its own, 0: every core), treating the call's rows as the packed
    sequence on a grid of ``grid`` tokens: the bits of
    ContextParallelAttention(invariant=True) at any world size. Its
    invariant_forward / invariant_backward / round_exact serve that op."""

    name = "blockwise"

    def __init__(self, block_q=BLOCK_Q, block_kv=BLOCK_KV, *, invariant=False, grid=64, threads=0):
        self.block_q, self.block_kv = block_q, block_kv
        self.invariant, self.grid = bool(invariant), _checked_grid(grid)
        if isinstance(threads, bool) or not isinstance(threads, numbers.Integral) or threads < 0:
            raise ValueError(f"threads must be an int >= 0 (0: every core), not {threads!r}")
        self.threads = int(threads)

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q=None, max_seqlen_kv=None, mask=None, softmax_scale=None, *,
                 entries=None):
        if self.invariant:
            if entries is None:
                entries = _entries(cu_seqlens_q, cu_seqlens_kv, q.shape[0], k.shape[0], mask)
            else:
                entries = _parts(entries, q.shape[0], k.shape[0])
            phases = [(e[0] % self.grid, e[2] % self.grid) for e in entries]  # the call's rows are the packed sequence
            scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
            return _KernelAttention.apply(q, k, v, _OneCallInvariant(self, phases), entries, scale)
        return varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, mask, softmax_scale, entries=entries,
                                block_q=self.block_q, block_kv=self.block_kv)

    def _problem(self, q, k, v, parts, softmax_scale):
        return _Problem(q, k, v, _parts(parts, q.shape[0], k.shape[0]), softmax_scale, self.block_q, self.block_kv)

    def forward(self, q, k, v, parts, softmax_scale=None):
        """(out, lse) of the parts (no autograd); rows outside them: 0 and -inf."""
        return _forward(self._problem(q, k, v, parts, softmax_scale), q, k, v)

    def backward(self, q, k, v, out, lse, dout, parts, softmax_scale=None):
        """(dq, dk, dv) of the parts given the merged out and lse of every query row."""
        return _backward(self._problem(q, k, v, parts, softmax_scale), q, k, v, out, lse, dout, None)

    def invariant_forward(self, q, k, v, entries, phases, grid, softmax_scale):
        """The invariant mode's (out, lse) of the entries, from the C++ host
        kernel (docs/invariant-attention.md): ``phases`` gives each entry's
        first query and key row's packed position modulo ``grid``. Rows no
        entry covers: 0 and -inf. CPU tensors of float32, bfloat16 or float16."""
        element = _invariant_element(q, k, v)
        out, lse = cpdispatch._cpdispatch.invariant_forward(_host_array(q), _host_array(k), _host_array(v), entries, phases, grid,
                                                            float(softmax_scale), element, self.threads)
        return _from_host_array(out, q.dtype), torch.from_numpy(lse)

    def invariant_backward(self, q, k, v, out, lse, dout, entries, phases, grid, softmax_scale, bounds):
        """The invariant mode's gradients: (dq, dk, dv, dk_exponent,
        dv_exponent), dq rounded, dk and dv as exact int64 sums (value x *
        2^exponent) to add over copies and ranks and round once
        (round_exact). ``bounds``: (largest |q|, |v|, |dout| and the token
        count of the whole batch), the same on every rank."""
        element = _invariant_element(q, k, v)
        dq, dk, dv, ek, ev = cpdispatch._cpdispatch.invariant_backward(
            _host_array(q), _host_array(k), _host_array(v), _host_array(out), _host_array(lse), _host_array(dout), entries, phases, grid,
            float(softmax_scale), tuple(bounds), element, self.threads)
        return _from_host_array(dq, q.dtype), torch.from_numpy(dk), torch.from_numpy(dv), ek, ev

    @staticmethod
    def round_exact(exact, exponent, dtype):
        """Exact sums (int64, value x * 2^exponent) rounded once to ``dtype``."""
        element = _invariant_element(torch.empty(0, dtype=dtype))
        return _from_host_array(cpdispatch._cpdispatch.round_exact(_host_array(exact), int(exponent), element), dtype)


_INVARIANT_ELEMENTS = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _checked_grid(grid):
    if isinstance(grid, bool) or not isinstance(grid, numbers.Integral) or not 1 <= grid <= 2 ** 40:
        raise ValueError(f"grid must be an int in [1, 2**40] (the invariant mode's default is 64), not {grid!r}")
    return int(grid)


def _invariant_element(*xs):
    """The element name of the host kernel's invariant mode for these tensors, or a ValueError naming the one it cannot take."""
    for name, x in zip(("q", "k", "v"), xs):
        if x.device.type != "cpu":
            raise ValueError(f"the invariant mode runs the C++ host kernel: {name} must be a CPU tensor, not one on {x.device}")
        if x.dtype not in _INVARIANT_ELEMENTS:
            raise ValueError(f"the invariant mode takes float32, bfloat16 or float16 tensors; {name} is {x.dtype}")
    return _INVARIANT_ELEMENTS[xs[0].dtype]


def _host_array(x):
    """A tensor as the C-contiguous NumPy array the C++ kernel reads (bfloat16 as its int16 bits)."""
    x = x.detach().contiguous()
    return (x.view(torch.int16) if x.dtype == torch.bfloat16 else x).numpy()


def _from_host_array(a, dtype):
    t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def _max_abs(x):
    """The largest |x| as a float (0 for an empty tensor; NaN where x holds one)."""
    return float(x.detach().abs().max()) if x.numel() else 0.0


class _OneCallInvariant:
    """BlockwiseKernel(invariant=True)'s call as the forward / backward that
    _KernelAttention takes: the whole batch in one call, so its bounds are its own."""

    def __init__(self, kernel, phases):
        self.kernel, self.phases = kernel, phases

    def forward(self, q, k, v, entries, scale):
        return self.kernel.invariant_forward(q, k, v, entries, self.phases, self.kernel.grid, scale)

    def backward(self, q, k, v, out, lse, dout, entries, scale):
        bounds = (_max_abs(q), _max_abs(v), _max_abs(dout), q.shape[0])
        dq, dk, dv, ek, ev = self.kernel.invariant_backward(q, k, v, out, lse, dout, entries, self.phases, self.kernel.grid, scale, bounds)
        return dq, self.kernel.round_exact(dk, ek, k.dtype), self.kernel.round_exact(dv, ev, v.dtype)


def _row_disjoint(parts):
    """The parts in passes of which none has a query row twice, cut as the
    op cuts a kernel's passes (the library's query_row_passes)."""
    passes = []
    for part, p in zip(parts, cpdispatch._cpdispatch.query_row_passes(parts)):
        passes += [[] for _ in range(p + 1 - len(passes))]
        passes[p].append(part)
    return passes


class _KernelAttention(torch.autograd.Function):
    """An adapter's forward(parts) -> (out, lse) and backward(..., merged out
    and lse, parts) as one differentiable call (entries that share rows)."""

    @staticmethod
    def forward(ctx, q, k, v, kernel, parts, scale):
        out, lse = kernel.forward(q, k, v, parts, scale)
        out = out.to(q.dtype)
        ctx.kernel, ctx.parts, ctx.scale = kernel, parts, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.kernel.backward(q, k, v, out, lse, dout.contiguous(), ctx.parts, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _flash_backward():
    """flash-attention's varlen backward that takes an output and lse, with
    flash-attn 2.7's arguments (window_size_left / _right, softcap), or None:
    one stage only (flash_attn_varlen_func's own backward)."""
    try:
        backward = importlib.import_module("flash_attn.flash_attn_interface")._flash_attn_varlen_backward
    except (ImportError, AttributeError):
        return None
    try:
        # flash-attn >= 2.7 registers it as a torch custom op: its own function is _init_fn
        params = inspect.signature(getattr(backward, "_init_fn", backward)).parameters
    except (TypeError, ValueError):
        params = {}
    if {"window_size_left", "window_size_right", "softcap"} <= set(params):
        return backward
    named = [p for p in params.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return backward if not named and _flash_version() >= (2, 7) else None  # a wrapper that hides them: trust the version


def _flash_version():
    version = getattr(importlib.import_module("flash_attn"), "__version__", "0")
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])


def _flash_window(lo, hi, diagonal):
    """(causal, window_size) of a band (lo, hi) on t - j whose last row and
    last key are ``diagonal`` apart: flash-attention aligns a window
    (left, right) bottom-right (row i sees keys i + lk - lq - left ..
    i + lk - lq + right, -1 no bound), so left = diagonal - lo and
    right = hi - diagonal; right = 0 is causal=True."""
    left = -1 if lo is None else diagonal - lo
    right = -1 if hi is None else hi - diagonal
    if right == 0:
        return True, (left, 0) if left >= 0 else (-1, -1)
    return False, (left, right)


def _flash_part(part):
    """One part in flash-attention's terms: (q_start, q_len, kv_start,
    kv_len, causal, window_size), cut to the rows that see some of its keys
    and the keys that some row sees (so that left and right are >= 0: a
    negative bound would read as none), or None when it shows no pair."""
    q0, lq, k0, lk, lo, hi = part
    lo_, hi_ = _ends(lo, hi)
    j0, j1 = max(q0, k0 - hi_), min(q0 + lq, k0 + lk - lo_)  # rows that see a key of the part
    if j0 >= j1 or lo_ > hi_:
        return None
    t0, t1 = max(k0, j0 + lo_), min(k0 + lk, j1 + hi_)  # keys those rows see
    if t0 >= t1:
        return None
    return (j0, j1 - j0, t0, t1 - t0) + _flash_window(lo, hi, t1 - j1)


def _flash_groups(parts):
    """Parts grouped by their flash-attention call: {(causal, window): [(q0, lq, k0, lk)]}."""
    groups = {}
    for part in parts:
        call = _flash_part(part)
        if call is not None:
            groups.setdefault(call[4:], []).append(call[:4])
    return groups


def _rows_of(starts_lengths, device):
    """The row indices of (start, length) runs, back to back, and their int32 cu_seqlens."""
    index = torch.cat([torch.arange(s, s + n) for s, n in starts_lengths]) if starts_lengths else torch.zeros(0, dtype=torch.long)
    cu = torch.tensor([0] + [n for _, n in starts_lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return index.to(device), cu.to(device)


class FlashAttnVarlenKernel:
    """flash-attention 2's varlen kernel (``flash_attn.flash_attn_varlen_func``,
    flash-attn >= 2.3; >= 2.7 for stages > 1) as an adapter. The plan's mask becomes its
    ``causal`` / ``window_size``: causal: causal=True; a sliding window of w:
    window_size=(w - 1, 0), causal=True; full: causal=False, (-1, -1). An
    entry's or part's band (lo, hi) becomes a window aligned at its last row
    and last key (see _flash_part; one call per window), and the backward
    goes through ``flash_attn.flash_attn_interface._flash_attn_varlen_backward``
    with the merged output and lse (deterministic). Entries that share query
    rows (a plan with slices) merge by their log-sum-exps, which needs that
    backward (flash-attn >= 2.7)."""

    name = "flash_attn_varlen"

    def __init__(self):
        try:
            module = importlib.import_module("flash_attn")
        except ImportError as e:
            raise ImportError(f"kernel 'flash_attn_varlen' needs the flash_attn package (flash-attention 2), which does not import here: {e}") from e
        self.func = module.flash_attn_varlen_func
        self.varlen_backward = _flash_backward()
        self.staged = self.varlen_backward is not None

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q=None, max_seqlen_kv=None, mask=None, softmax_scale=None, *,
                 entries=None):
        if entries is not None:
            return self._entries(q, k, v, _parts(entries, q.shape[0], k.shape[0]), softmax_scale)
        causal, window = _flash_window(*_Mask(mask).band(), 0)  # whole entries: bottom-right
        cu_q, cu_kv = (torch.as_tensor(c).to(device=q.device, dtype=torch.int32) for c in (cu_seqlens_q, cu_seqlens_kv))
        if cu_q.numel() < 2:  # flash-attention refuses a batch of no sequences; a rank may attend nothing
            return q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
        max_q = max_seqlen_q if max_seqlen_q is not None else _longest(cu_q)
        max_kv = max_seqlen_kv if max_seqlen_kv is not None else _longest(cu_kv)
        return self.func(q, k, v, cu_q, cu_kv, max_q, max_kv, dropout_p=0.0, softmax_scale=softmax_scale, causal=causal, window_size=window)

    def _entries(self, q, k, v, parts, softmax_scale):
        """One differentiable call over entries with bands: through forward and
        backward (merged by lse) where the backward is there; else, entries
        that share no query row, one autograd call of flash_attn_varlen_func per window."""
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        if self.staged:
            return _KernelAttention.apply(q, k, v, self, parts, scale)
        if len(_row_disjoint(parts)) > 1:
            raise ValueError("kernel 'flash_attn_varlen': these entries share query rows (a plan with slices), which merge by their "
                             "log-sum-exps through flash-attn 2.7's _flash_attn_varlen_backward; this flash-attn lacks it "
                             "(use flash-attn >= 2.7, or the 'blockwise' kernel)")
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2]) + q[:0].sum() + k[:0].sum() + v[:0].sum()  # seen by autograd
        for (causal, window), group in _flash_groups(parts).items():
            (qi, cu_q, max_q), (ki, cu_kv, max_kv) = _flash_rows(group, q.device)
            max_kv = max(max_kv, window[0] + 1, window[1] + 1)  # flash drops a bound >= max_seqlen_k
            o = self.func(q[qi], k[ki], v[ki], cu_q, cu_kv, max_q, max_kv, dropout_p=0.0, softmax_scale=scale, causal=causal, window_size=window)
            out = out.index_copy(0, qi, o.to(out.dtype))
        return out

    def _pass(self, q, k, v, parts, scale, acc):
        """(out, lse) of parts of which none shares a query row with another."""
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=acc, device=q.device)
        for (causal, window), group in _flash_groups(parts).items():
            (qi, cu_q, max_q), (ki, cu_kv, max_kv) = _flash_rows(group, q.device)
            max_kv = max(max_kv, window[0] + 1, window[1] + 1)  # flash drops a bound >= max_seqlen_k
            o, part_lse, _ = self.func(q[qi], k[ki], v[ki], cu_q, cu_kv, max_q, max_kv, dropout_p=0.0, softmax_scale=scale, causal=causal,
                                       window_size=window, return_attn_probs=True)
            if part_lse.shape != (q.shape[1], len(qi)):
                raise RuntimeError(f"flash_attn_varlen_func gave softmax_lse of shape {tuple(part_lse.shape)}, not [heads, total_q] "
                                   "(flash-attn >= 2.6 gives that)")
            out[qi] = o
            lse[:, qi] = part_lse.to(lse.dtype).masked_fill(part_lse == float("inf"), float("-inf"))  # flash marks a row without keys +inf
        return out, lse

    def forward(self, q, k, v, parts, softmax_scale=None):
        """(out, lse) of the parts (no autograd); rows outside them: 0 and -inf.
        Parts that share query rows go in several passes merged by lse."""
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        acc = _accumulator(q.dtype)
        passes = _row_disjoint(_parts(parts, q.shape[0], k.shape[0]))
        if len(passes) <= 1:
            return self._pass(q, k, v, passes[0] if passes else [], scale, acc)
        out = torch.zeros((q.shape[0], q.shape[1], v.shape[2]), dtype=acc, device=q.device)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=acc, device=q.device)
        for one in passes:
            _merge(out, lse, *self._pass(q, k, v, one, scale, acc))
        return out.to(q.dtype), lse

    def backward(self, q, k, v, out, lse, dout, parts, softmax_scale=None):
        """(dq, dk, dv) of the parts given the merged out and lse of every query row
        (in the accumulator dtype; parts may share query and key rows: their gradients add up)."""
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        dq = torch.zeros(q.shape, dtype=_accumulator(q.dtype), device=q.device)
        dk = torch.zeros(k.shape, dtype=_accumulator(k.dtype), device=k.device)
        dv = torch.zeros(v.shape, dtype=_accumulator(v.dtype), device=v.device)
        out = out.to(q.dtype)
        for (causal, window), group in _flash_groups(_parts(parts, q.shape[0], k.shape[0])).items():
            (qi, cu_q, max_q), (ki, cu_kv, max_kv) = _flash_rows(group, q.device)
            max_kv = max(max_kv, window[0] + 1, window[1] + 1)  # flash drops a bound >= max_seqlen_k
            gq, gk, gv = q.new_empty((len(qi),) + q.shape[1:]), k.new_empty((len(ki),) + k.shape[1:]), v.new_empty((len(ki),) + v.shape[1:])
            row_lse = lse[:, qi].contiguous()
            row_lse.masked_fill_(row_lse == float("-inf"), float("inf"))  # back to flash's mark of a row without keys
            self.varlen_backward(dout[qi], q[qi], k[ki], v[ki], out[qi], row_lse, gq, gk, gv, cu_q, cu_kv, max_q, max_kv,
                                 dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=window[0], window_size_right=window[1],
                                 softcap=0.0, alibi_slopes=None, deterministic=True, rng_state=None)
            dq.index_add_(0, qi, gq.to(dq.dtype))
            dk.index_add_(0, ki, gk.to(dk.dtype))
            dv.index_add_(0, ki, gv.to(dv.dtype))
        return dq, dk, dv


def _longest(cu_seqlens):
    cu = cu_seqlens.tolist()
    return max((b - a for a, b in zip(cu, cu[1:])), default=0)


def _flash_rows(group, device):
    """((query rows, cu_seqlens_q, max_seqlen_q), (key rows, cu_seqlens_k, max_seqlen_k)) of a group of parts."""
    qi, cu_q = _rows_of([(q0, lq) for q0, lq, _, _ in group], device)
    ki, cu_kv = _rows_of([(k0, lk) for _, _, k0, lk in group], device)
    return (qi, cu_q, max(lq for _, lq, _, _ in group)), (ki, cu_kv, max(lk for _, _, _, lk in group))


class SdpaKernel:
    """torch.nn.functional.scaled_dot_product_attention (PyTorch >= 2.1) per
    group of entries of equal lengths, as an adapter for stages = 1 only: it
    gives no log-sum-exp to merge parts by, nor a backward that takes one.
    Its is_causal aligns top-left, so only square causal entries use it; the
    others get the plan's mask, bottom-right aligned, as a bool attn_mask.
    With ``entries`` (a plan with slices) each query shard (by cu_seqlens)
    gets the union of its entries' bands as its attn_mask."""

    name = "sdpa"
    staged = False

    def __init__(self):
        self.func = getattr(torch.nn.functional, "scaled_dot_product_attention", None)
        if self.func is None:
            raise ImportError("kernel 'sdpa' needs torch.nn.functional.scaled_dot_product_attention (PyTorch 2.1 or later); "
                              f"this is PyTorch {torch.__version__}")

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q=None, max_seqlen_kv=None, mask=None, softmax_scale=None, *,
                 entries=None):
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"heads of q ({q.shape[1]}) must be a multiple of the heads of k and v ({k.shape[1]})")
        groups = q.shape[1] // k.shape[1]
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        shards = _entries(cu_seqlens_q, cu_seqlens_kv, q.shape[0], k.shape[0], mask if entries is None else {"type": "full"})
        seen = self._seen(shards, None if entries is None else _parts(entries, q.shape[0], k.shape[0]), _Mask(mask), q.device)
        by_shape = {}
        for i, (q0, lq, k0, lk, _, _) in enumerate(shards):
            by_shape.setdefault((lq, lk), []).append(i)
        rows, outs = [], []
        for (lq, lk), members in by_shape.items():
            qi = torch.tensor([shards[i][0] for i in members], device=q.device)[:, None] + torch.arange(lq, device=q.device)
            ki = torch.tensor([shards[i][2] for i in members], device=q.device)[:, None] + torch.arange(lk, device=q.device)
            rows.append(qi.reshape(-1))
            masks = None if seen is None else torch.stack([seen[i] for i in members])
            outs.append(self._group(q, k, v, qi, ki, masks, _Mask(mask), groups, scale).reshape(-1, q.shape[1], v.shape[2]))
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
        return out.index_copy(0, torch.cat(rows), torch.cat(outs)) if rows else out + q[:0].sum()  # tied to q even without entries

    @staticmethod
    def _seen(shards, entries, m, device):
        """Per query shard its [lq, lk] bool mask, the union of its entries' bands; None: the plan's mask (no entries)."""
        if entries is None:
            return None
        seen = [torch.zeros(lq, lk, dtype=torch.bool, device=device) for _, lq, _, lk, _, _ in shards]
        starts = [s[0] for s in shards]
        for q0, lq, k0, lk, lo, hi in entries:
            i = bisect.bisect_right(starts, q0) - 1
            sq, slq, sk, slk = shards[i][:4] if i >= 0 else (0, 0, 0, 0)
            if i < 0 or q0 + lq > sq + slq or k0 < sk or k0 + lk > sk + slk:
                raise ValueError(f"kernel 'sdpa': entry {(q0, lq, k0, lk, lo, hi)} does not lie inside one query shard and its KV group "
                                 "(cu_seqlens_q / cu_seqlens_kv)")
            lo, hi = _ends(lo, hi)
            d = torch.arange(k0, k0 + lk, device=device)[None, :] - torch.arange(q0, q0 + lq, device=device)[:, None]
            seen[i][q0 - sq:q0 - sq + lq, k0 - sk:k0 - sk + lk] |= (d >= lo) & (d <= hi)
        return seen

    def _group(self, q, k, v, qi, ki, masks, m, groups, scale):
        """Entries of one shape, batched: [entries, lq, heads, dim_v]. ``masks``
        [entries, lq, lk] or None: the plan's mask, bottom-right aligned."""
        lq, lk = qi.shape[1], ki.shape[1]
        if masks is None:
            lo, hi = _ends(*m.band(lk - lq))
            d = torch.arange(lk, device=q.device)[None, :] - torch.arange(lq, device=q.device)[:, None]
            seen = ((d >= lo) & (d <= hi))[None]
            square_causal = m.band() == (None, 0) and lq == lk
        else:
            seen, square_causal = masks, False
        blind = ~seen.any(-1)  # [entries or 1, lq]: rows that see no key: sdpa would give nan, we give 0
        qb = q[qi].transpose(1, 2)  # [entries, heads, lq, dim]
        kb, vb = (x[ki].repeat_interleave(groups, dim=2).transpose(1, 2) for x in (k, v))  # query head h reads h // groups
        if square_causal:
            how = {"is_causal": True}  # square: top-left is bottom-right
        elif bool(seen.all()):
            how = {}
        else:
            how = {"attn_mask": (seen | blind[..., None])[:, None] if masks is not None else (seen | blind[..., None])[0]}
        o = self.func(qb, kb, vb, dropout_p=0.0, scale=scale, **how).transpose(1, 2)
        return o.masked_fill(blind[:, :, None, None], 0.0) if bool(blind.any()) else o


#: The kernels ContextParallelAttention takes by name.
KERNELS = {"blockwise": BlockwiseKernel, "flash_attn_varlen": FlashAttnVarlenKernel, "sdpa": SdpaKernel}


def kernel_adapter(kernel):
    """The kernel a name stands for (KERNELS; None: "blockwise"), or ``kernel`` itself when callable."""
    if kernel is None:
        return BlockwiseKernel()
    if isinstance(kernel, str):
        if kernel not in KERNELS:
            raise ValueError(f"kernel: unknown kernel {kernel!r} (one of {', '.join(KERNELS)}, or a callable)")
        return KERNELS[kernel]()
    if not callable(kernel):
        raise TypeError(f"kernel must be a name ({', '.join(KERNELS)}) or a callable, not {type(kernel).__name__}")
    return kernel


def _takes_stages(kernel):
    """Whether a kernel has the forward / backward that stages > 1 need."""
    return getattr(kernel, "staged", True) and callable(getattr(kernel, "forward", None)) and callable(getattr(kernel, "backward", None))


def _takes_entries(kernel):
    """Whether a kernel's call takes ``entries=`` (a plan with slices): the adapters, or a callable with that keyword (or **kwargs)."""
    if isinstance(kernel, (BlockwiseKernel, FlashAttnVarlenKernel, SdpaKernel)):
        return True
    try:
        params = inspect.signature(kernel).parameters
    except (TypeError, ValueError):
        return False
    return "entries" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def _kernel_name(kernel):
    return getattr(kernel, "name", None) or getattr(kernel, "__name__", type(kernel).__name__)


def _collective(world):
    """Whether exchanges go through torch.distributed (one rank without a process group: a local copy)."""
    if dist.is_available() and dist.is_initialized():
        return True
    if world == 1:
        return False
    raise RuntimeError("cpdispatch.torch: a plan of several ranks needs torch.distributed initialised")


class _Staging:
    """How ContextParallelAttention(stages=S) moves and attends one rank's
    share, as the C++ op plans it (cpdispatch's stage plan, through the
    module: one implementation).

    ``groups`` = min(S - 1, W - 1) groups of remote peers by ring distance.
    Round 0 is what this rank holds itself (its own query shards and
    key-value shards), round g + 1 what the peers of group g send; each
    group is ONE joint exchange of queries and key-values. A part is an
    entry's query rows against a run of its key rows that all arrive by the
    same round, with the entry's band (bands are in the buffers' rows, so a
    run keeps it). ``passes[r]``: round r's kernel calls (lists of parts; the
    kernels fold parts that share a query row). ``kv_ready[g]``: the round
    after which every part reading group g's key-values is done, so their
    gradients can go home."""

    def __init__(self, d, stages):
        self.world, me = len(d.q_route.forward.send_counts), d.rank
        self.groups = cpdispatch._cpdispatch.stage_groups(stages, self.world)
        self.land = d.wire_route if d.wire_route is not None else d.kv_route  # the key-value route on the wire
        self.fan_source = d.fan_source if d.wire_route is not None else None
        fwd = [d.q_route.forward, self.land.forward]
        if self.groups == 0:
            everyone = [True] * self.world
            self.forward = _Joint(fwd, everyone, everyone)
            self.reverse = _Joint([d.q_route.reverse, self.land.reverse], everyone, everyone)
            return
        plan = cpdispatch._cpdispatch.stage_plan(d._share, me, d._dedup, stages, d.entries, d._max_memory)
        mine = [p == me for p in range(self.world)]
        as_home = plan["send_group"]  # per peer: the group of what this rank sends it (-1: this rank)
        as_attention = [r - 1 for r in plan["recv_round"]]  # per peer: the group of what it sends this rank
        self.local = _Joint(fwd, mine, mine)
        self.stages = [_Joint(fwd, [h == g for h in as_home], [a == g for a in as_attention]) for g in range(self.groups)]
        self.kv_local = _Joint([self.land.reverse], mine, mine)
        self.kv_stages = [_Joint([self.land.reverse], [a == g for a in as_attention], [h == g for h in as_home]) for g in range(self.groups)]
        parts = plan["parts"]
        self.passes = [[] for _ in range(self.groups + 1)]
        for r, begin, end in plan["passes"]:
            self.passes[r].append(parts[begin:end])
        self.kv_ready = plan["kv_ready"]
        if self.fan_source is not None:
            kv_round = self._rounds(self.land.forward, plan["recv_round"])[self.fan_source]
            self.fan_rows = [torch.nonzero(kv_round == r).flatten() for r in range(self.groups + 1)]

    def _rounds(self, exchange, recv_round):
        """The round in which each output row of a forward exchange arrives (rows no peer sends: round 0)."""
        rounds = torch.zeros(exchange.output_tokens, dtype=torch.long)
        rounds[exchange.recv_index] = torch.repeat_interleave(torch.as_tensor(recv_round, dtype=torch.long),
                                                              torch.as_tensor(exchange.recv_counts, dtype=torch.long))
        return rounds

    def fan_out(self, landed, kva, rows=None):
        """Key-value rows of the attention layout from the wire (dedup); ``rows`` None: all."""
        if self.fan_source is None:
            return landed
        if rows is None:
            return landed.index_select(0, _at(self.fan_source, landed))
        return kva.index_copy_(0, _at(rows, kva), landed.index_select(0, _at(self.fan_source[rows], landed)))

    def fan_in(self, grad, wire, rows=None):
        """Key-value gradients of the attention layout summed per wire row (dedup); ``rows`` None: all."""
        if self.fan_source is None:
            return grad
        if rows is None:
            return wire.index_add_(0, _at(self.fan_source, grad), grad)
        return wire.index_add_(0, _at(self.fan_source[rows], grad), grad.index_select(0, _at(rows, grad)))


class _JointDispatch(torch.autograd.Function):
    """stages = 1: queries, keys and values to the attention layout in ONE
    exchange (the key-values fanned out with dedup); backward: their
    gradients home in ONE exchange, the fan-in first, the copy combine last."""

    @staticmethod
    def forward(ctx, q, k, v, d, st):
        ctx.d, ctx.st, ctx.dim = d, st, k.shape[-1]
        qa, kva = _dispatch_joint(q, k, v, d, st)
        return qa, kva[..., :ctx.dim], kva[..., ctx.dim:]

    @staticmethod
    @once_differentiable
    def backward(ctx, dqa, dka, dva):
        d, st = ctx.d, ctx.st
        dkva = torch.cat([dka, dva], -1)
        wire = dkva.new_zeros((st.land.forward.output_tokens,) + tuple(dkva.shape[1:]))
        dland = st.fan_in(dkva, wire)
        dq = dqa.new_zeros((d.q_route.reverse.output_tokens,) + tuple(dqa.shape[1:]))
        replica = dland.new_zeros((st.land.reverse.output_tokens,) + tuple(dland.shape[1:]))
        st.reverse.post([dqa.contiguous(), dland], d.group, _collective(st.world)).land([dq, replica])
        dkv = st.land.combine(replica)
        return dq, dkv[..., :ctx.dim], dkv[..., ctx.dim:], None, None


def _dispatch_joint(q, k, v, d, st):
    """(queries, key-values side by side) in the attention layout, in ONE exchange (the key-values fanned out with dedup)."""
    kv = torch.cat([k, v], -1)
    qa = q.new_zeros((d.q_route.forward.output_tokens,) + tuple(q.shape[1:]))
    landed = kv.new_zeros((st.land.forward.output_tokens,) + tuple(kv.shape[1:]))
    st.forward.post([q, kv], d.group, _collective(st.world)).land([qa, landed])
    return qa, st.fan_out(landed, None)


class _InvariantLayout:
    """A rank's entries for the invariant mode, their phases, the grid and the batch's token count."""

    def __init__(self, entries, phases, grid, tokens):
        self.entries, self.phases, self.grid, self.tokens = entries, phases, grid, tokens


class _InvariantAttention(torch.autograd.Function):
    """invariant=True: queries and key-values to the attention layout in one
    exchange and the kernel's invariant mode over the rank's entries (every
    key of a query row is here, so out, lse and dq are whole). Backward: the
    key-value gradients as exact sums (int64 at one scale for the batch,
    from bounds the ranks agree on) through the same fan-in, exchange and
    copy sum as the default path's, as integers, rounded once at home."""

    @staticmethod
    def forward(ctx, q, k, v, d, st, kernel, scale, layout):
        dim = k.shape[-1]
        qa, kva = _dispatch_joint(q, k, v, d, st)
        out, lse = kernel.invariant_forward(qa, kva[..., :dim], kva[..., dim:], layout.entries, layout.phases, layout.grid, scale)
        ctx.d, ctx.st, ctx.kernel, ctx.scale, ctx.layout, ctx.dim = d, st, kernel, scale, layout, dim
        ctx.maxima, ctx.dtypes = (_max_abs(q), _max_abs(v)), (q.dtype, k.dtype, v.dtype)
        ctx.save_for_backward(qa, kva, out, lse)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        qa, kva, out, lse = ctx.saved_tensors
        d, st, layout, dim = ctx.d, ctx.st, ctx.layout, ctx.dim
        dout = dout.contiguous()
        bounds = _agreed_bounds(ctx.maxima + (_max_abs(dout),), layout.tokens, d.group, st.world)
        dqa, dk, dv, ek, ev = ctx.kernel.invariant_backward(qa, kva[..., :dim], kva[..., dim:], out, lse, dout, layout.entries, layout.phases,
                                                            layout.grid, ctx.scale, bounds)
        exact = torch.cat([dk, dv], -1)
        if st.fan_source is not None:
            exact = st.fan_in(exact, exact.new_zeros((st.land.forward.output_tokens,) + tuple(exact.shape[1:])))
        home = st.land.combine(st.land.reverse(exact, d.group))  # integer sums: the same whatever the order
        dq = d.q_route.reverse(dqa, d.group)
        dk = ctx.kernel.round_exact(home[..., :dim], ek, ctx.dtypes[1])
        dv = ctx.kernel.round_exact(home[..., dim:], ev, ctx.dtypes[2])
        return dq, dk, dv, None, None, None, None, None


def _agreed_bounds(maxima, tokens, group, world):
    """(largest |q|, |v|, |dout| over every rank, the batch's tokens): a NaN
    counts as infinity, so every rank refuses it alike."""
    local = torch.tensor(maxima, dtype=torch.float64).nan_to_num(nan=math.inf)
    if _collective(world):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    return tuple(local.tolist()) + (tokens,)


def _merge(out, lse, part_out, part_lse):
    """Folds one part's attention into the running (out, lse), in place, in
    the accumulator dtype: the softmax over the union of their keys."""
    new = torch.logaddexp(lse, part_lse.to(lse.dtype))
    base = new.masked_fill(new == float("-inf"), 0.0)  # a row no part showed a key: weights exp(-inf) = 0, not nan
    out.mul_(torch.exp(lse - base).t()[..., None])
    out.add_(part_out.to(out.dtype) * torch.exp(part_lse.to(lse.dtype) - base).t()[..., None])
    lse.copy_(new)


class _StagedAttention(torch.autograd.Function):
    """stages > 1: the exchange by stages behind the attention.

    Forward: every remote stage is posted at once; the local part is attended
    while they travel, then each stage's parts as it lands, the parts'
    outputs merged by their log-sum-exps. Backward: each part through the
    kernel's backward with the MERGED output and lse (a part's own lse is not
    its softmax's normaliser, and a kernel's lse carries no gradient, so
    autograd through the merge would be wrong); a stage's key-value
    gradients go home as soon as every part reading them is done, dq last."""

    @staticmethod
    def forward(ctx, q, k, v, d, st, kernel, scale):
        kv = torch.cat([k, v], -1)
        posted = [stage.post([q, kv], d.group) for stage in st.stages]
        qa = q.new_zeros((d.q_route.forward.output_tokens,) + tuple(q.shape[1:]))
        landed = kv.new_zeros((st.land.forward.output_tokens,) + tuple(kv.shape[1:]))
        st.local.post([q, kv], None, collective=False).land([qa, landed])
        kva = landed if st.fan_source is None else kv.new_zeros((len(st.fan_source),) + tuple(kv.shape[1:]))
        acc = _accumulator(q.dtype)
        out = torch.zeros((qa.shape[0], q.shape[1], v.shape[2]), dtype=acc, device=q.device)
        lse = torch.full((q.shape[1], qa.shape[0]), float("-inf"), dtype=acc, device=q.device)
        dim = k.shape[-1]
        for r, passes in enumerate(st.passes):
            if r:
                posted[r - 1].land([qa, landed])
            if st.fan_source is not None:
                st.fan_out(landed, kva, st.fan_rows[r])
            for parts in passes:
                _merge(out, lse, *kernel.forward(qa, kva[..., :dim], kva[..., dim:], parts, scale))
        out = out.to(q.dtype)
        ctx.d, ctx.st, ctx.kernel, ctx.scale, ctx.dim = d, st, kernel, scale, dim
        ctx.save_for_backward(qa, kva, out, lse)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        qa, kva, out, lse = ctx.saved_tensors
        d, st, dim = ctx.d, ctx.st, ctx.dim
        dout = dout.contiguous()
        dqa = torch.zeros(qa.shape, dtype=lse.dtype, device=qa.device)
        dkva = torch.zeros(kva.shape, dtype=lse.dtype, device=kva.device)
        wire = torch.zeros((st.land.forward.output_tokens,) + tuple(kva.shape[1:]), dtype=lse.dtype, device=kva.device)
        posted = []
        for r, passes in enumerate(st.passes):
            for parts in passes:
                dq, dk, dv = ctx.kernel.backward(qa, kva[..., :dim], kva[..., dim:], out, lse, dout, parts, ctx.scale)
                dqa += dq
                dkva[..., :dim] += dk
                dkva[..., dim:] += dv
            while len(posted) < st.groups and st.kv_ready[len(posted)] <= r:
                g = len(posted)
                posted.append(st.kv_stages[g].post([_home_bound(st, dkva, wire, g + 1, kva.dtype)], d.group))
        dq_home = d.q_route.reverse(dqa.to(qa.dtype), d.group)
        replica = kva.new_zeros((st.land.reverse.output_tokens,) + tuple(kva.shape[1:]))
        st.kv_local.post([_home_bound(st, dkva, wire, 0, kva.dtype)], None, collective=False).land([replica])
        for p in posted:
            p.land([replica])
        dkv = st.land.combine(replica)
        return dq_home, dkv[..., :dim], dkv[..., dim:], None, None, None, None


def _home_bound(st, dkva, wire, r, dtype):
    """The key-value gradients that round r's senders get back, in the input
    dtype: with dedup, round r's rows summed per wire row first (fp32)."""
    if st.fan_source is None:
        return dkva.to(dtype)
    return st.fan_in(dkva, wire, st.fan_rows[r]).to(dtype)


class _Tie(torch.autograd.Function):
    """A kernel's output that autograd does not see (a kernel may return a
    fresh tensor for a rank without query rows), tied to q, k and v with zero
    gradients, so that this rank still makes the backward's collectives."""

    @staticmethod
    def forward(ctx, out, *inputs):
        ctx.like = [(x.shape, x.dtype, x.device) for x in inputs]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return (None,) + tuple(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.like)


class ContextParallelAttention(torch.nn.Module):
    """Context-parallel attention: dispatch the queries and key-values of the
    MLP layout to the attention ranks, attend each query shard to its KV group
    under the plan's mask, and bring the outputs home.

    ``kernel``: a name of KERNELS ("blockwise", the default; "flash_attn_varlen";
    "sdpa"), an adapter (BlockwiseKernel(block_q=..., block_kv=...), ...) or
    any callable ``kernel(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
    max_seqlen_kv, mask, softmax_scale)`` that returns the output
    (differentiable), e.g. functools.partial(varlen_attention, block_q=...).
    A plan with slices attends by its entries (RankDispatch.entries), which
    the call then passes as ``entries=``: the adapters and varlen_attention
    take them; a callable without that keyword is refused.

    ``stages`` (default 1): with 1, queries, keys and values travel in one
    exchange and the kernel attends the whole layout (bitwise reproducible
    run to run). With S > 1 the remote peers fall in min(S - 1, W - 1) groups
    by ring distance, each one exchange posted at once; the key-values this
    rank holds are attended while they travel and the partial outputs merge
    by their log-sum-exps. That needs a kernel with ``forward(q, k, v, parts,
    softmax_scale) -> (out, lse)`` and ``backward(q, k, v, out, lse, dout,
    parts, softmax_scale) -> (dq, dk, dv)`` taking the merged output and lse,
    a part being (q_start, q_len, kv_start, kv_len, lo, hi) (an entry's
    query rows, a run of its key rows and its band): "blockwise" and
    "flash_attn_varlen" have them.

    ``invariant=True`` (with ``grid``, default 64): out, dq, dk and dv
    bitwise the same at every world size, plan, stage count and kernel
    thread count whose cuts lie on the grid (cpdispatch.balance(...,
    grid=)), by the C++ host kernel's invariant mode: CPU tensors of
    float32, bfloat16 or float16, a kernel with the mode ("blockwise"), one
    exchange whatever ``stages`` is, and the key-value gradients home as
    exact sums rounded once (docs/invariant-attention.md)."""

    def __init__(self, softmax_scale=None, kernel="blockwise", stages=1, *, invariant=False, grid=64):
        super().__init__()
        if isinstance(stages, bool) or not isinstance(stages, numbers.Integral) or stages < 1:
            raise ValueError(f"stages must be an int of at least 1, not {stages!r}")
        self.softmax_scale, self.stages = softmax_scale, int(stages)
        self.invariant, self.grid = bool(invariant), _checked_grid(grid)
        self.kernel = kernel_adapter(kernel)
        if self.invariant and not callable(getattr(self.kernel, "invariant_forward", None)):
            raise ValueError(f"invariant=True needs a kernel with the invariant mode ('blockwise', or an adapter with invariant_forward, "
                             f"invariant_backward and round_exact); {_kernel_name(self.kernel)!r} cannot promise the same bits for every split")
        if self.stages > 1 and not _takes_stages(self.kernel):
            name = _kernel_name(self.kernel)
            raise ValueError(f"stages = {stages} needs a kernel whose forward gives the log-sum-exp and whose backward takes the merged "
                             f"output and log-sum-exp ('blockwise', 'flash_attn_varlen' or such an adapter); {name!r} runs stages = 1 only")

    def forward(self, q, k, v, dispatch):
        if not q.dtype == k.dtype == v.dtype:
            raise ValueError(f"q, k and v travel in one exchange and need one dtype, not {q.dtype}, {k.dtype}, {v.dtype}")
        if self.invariant:
            _invariant_element(q, k, v)  # before any collective: every rank refuses alike
            layout = dispatch.invariant_layout(self.grid)
            scale = self.softmax_scale if self.softmax_scale is not None else q.shape[-1] ** -0.5
            out = _InvariantAttention.apply(q, k, v, dispatch, dispatch.staging(1), self.kernel, scale, layout)
            return dispatch.undispatch(out)
        staging = dispatch.staging(self.stages)
        if staging.groups:
            out = _StagedAttention.apply(q, k, v, dispatch, staging, self.kernel, self.softmax_scale)
        else:
            qa, ka, va = _JointDispatch.apply(q, k, v, dispatch, staging)
            cu_q = dispatch.cu_seqlens_q.to(q.device)
            cu_kv = dispatch.cu_seqlens_kv.to(q.device)
            args = (qa, ka, va, cu_q, cu_kv, dispatch.max_seqlen_q, dispatch.max_seqlen_kv, dispatch.mask, self.softmax_scale)
            if dispatch.entries is None:
                out = self.kernel(*args)
            elif _takes_entries(self.kernel):
                out = self.kernel(*args, entries=dispatch.entries)
            else:
                raise ValueError(f"the plan's documents have slices: their attention entries (RankDispatch.entries) need a kernel that takes "
                                 f"entries ('blockwise', 'flash_attn_varlen', 'sdpa', or a callable with an entries keyword, as "
                                 f"varlen_attention has); {_kernel_name(self.kernel)!r} takes cu_seqlens and one mask")
            out = out[0] if isinstance(out, tuple) else out  # a kernel may give (out, lse)
            if torch.is_grad_enabled() and not out.requires_grad and any(x.requires_grad for x in (qa, ka, va)):
                out = _Tie.apply(out, qa, ka, va)
        return dispatch.undispatch(out)
