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
attention, the log-sum-exp on request.
"""

import numbers

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

import cpdispatch

__all__ = ["RankDispatch", "ContextParallelAttention", "varlen_attention", "attention_mask", "BLOCK_Q", "BLOCK_KV"]


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


class RankDispatch:
    """One rank's share of a qkv plan, ready to run.

    ``plan``: the plan every rank holds (a dict or JSON text, e.g. from
    cpdispatch.balance, or a cpdispatch.Plan). ``rank`` defaults to ``dist.get_rank(group)``.
    ``dedup`` (default: the plan's "dedup") sends each key-value shard once per
    destination rank. Attributes: ``meta`` (cpdispatch.plan_for_rank),
    ``mask`` (the plan's attention mask), ``position_ids`` (int64 tensor: each
    MLP-layout token's position within its document, for RoPE).
    ``max_memory`` bounds the reading and planning (cpdispatch.plan_for_rank)."""

    def __init__(self, plan, rank=None, dedup=False, group=None, *, max_memory=cpdispatch.DEFAULT_MAX_MEMORY):
        if rank is None:
            rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
        self.rank, self.group = rank, group
        if not isinstance(plan, cpdispatch.Plan):
            plan = cpdispatch.Plan(plan, max_memory=max_memory)  # read once for the calls below
        ix = cpdispatch.token_indices(plan, rank, dedup, max_memory=max_memory)
        if "kv" not in ix:
            raise ValueError("RankDispatch takes a qkv plan (queries and key-values); this is a query plan")
        self.meta = cpdispatch.plan_for_rank(plan, rank, dedup, max_memory=max_memory)
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


class _Mask:
    """The plan's mask inside one attention entry, bottom-right aligned
    (docs/plan-format.md section 2d): query row j sees key column t with
    ``off = lk - lq``: causal t <= j + off, sliding window
    j + off - w < t <= j + off, full always."""

    def __init__(self, mask):
        mask = cpdispatch.CAUSAL if mask is None else mask
        self.kind = mask.get("type", "causal")
        if self.kind not in ("causal", "full", "sliding_window"):
            raise ValueError(f"mask.type: unknown mask {self.kind!r} (causal, full or sliding_window)")
        self.window = mask.get("window") if self.kind == "sliding_window" else None
        if self.kind == "sliding_window" and (not isinstance(self.window, numbers.Integral) or isinstance(self.window, bool) or self.window < 1):
            raise ValueError(f"mask.window: a sliding window needs an integer window of at least 1, not {self.window!r}")

    def allows(self, j, t, off):
        """Bool tensor, broadcast over j, t and off: row j sees column t."""
        if self.kind == "full":
            return torch.ones(torch.broadcast_shapes(j.shape, t.shape), dtype=torch.bool, device=j.device)
        seen = t <= j + off
        if self.window is not None:
            seen &= t > j + off - self.window
        return seen

    def keys(self, j0, j1, lk, off):
        """[lo, hi): the columns that some row of j0 .. j1-1 sees (lo == hi: none)."""
        if self.kind == "full":
            return 0, lk
        hi = min(lk, j1 + off)
        lo = max(0, j0 + off - self.window + 1) if self.window is not None else 0
        return lo, max(lo, hi)

    def sees_all(self, j0, j1, t0, t1, off):
        """Whether every row of j0 .. j1-1 sees every column of t0 .. t1-1 (no mask to apply)."""
        if self.kind == "full":
            return True
        if t1 - 1 > j0 + off:
            return False
        return self.window is None or t0 > j1 - 1 + off - self.window


def attention_mask(cu_seqlens_q, cu_seqlens_kv, mask, device=None):
    """[queries, keys] bool: True where a query row sees a key row. Entries
    are independent (block diagonal); inside entry i with lq query and lk key
    rows, row j sees column t by the plan's mask, bottom-right aligned
    (docs/plan-format.md section 2d): causal t <= j + lk - lq, sliding window
    j + lk - lq - w < t <= j + lk - lq, full always. Dense: for tests and
    small inputs; varlen_attention never builds it."""
    cu_q = torch.as_tensor(cu_seqlens_q).to(torch.int64).cpu()
    cu_kv = torch.as_tensor(cu_seqlens_kv).to(torch.int64).cpu()
    lq, lk = cu_q[1:] - cu_q[:-1], cu_kv[1:] - cu_kv[:-1]
    entries = torch.arange(lq.numel())
    q_entry = torch.repeat_interleave(entries, lq)
    k_entry = torch.repeat_interleave(entries, lk)
    j = (torch.arange(int(cu_q[-1])) - cu_q[:-1][q_entry])[:, None]
    t = (torch.arange(int(cu_kv[-1])) - cu_kv[:-1][k_entry])[None, :]
    seen = (q_entry[:, None] == k_entry[None, :]) & _Mask(mask).allows(j, t, (lk - lq)[q_entry][:, None])
    return seen.to(device) if device is not None else seen


#: Default query and key block sizes of varlen_attention: large enough that
#: CPU matrix products, not Python, dominate; small enough for GPU caches.
BLOCK_Q = 256
BLOCK_KV = 512


def _accumulator(dtype):
    """Softmax and gradient sums in float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _entries(cu_seqlens_q, cu_seqlens_kv, queries, keys):
    """(first query, lq, first key, lk) of every non-empty entry, checked."""
    cu_q = [int(x) for x in torch.as_tensor(cu_seqlens_q).tolist()]
    cu_kv = [int(x) for x in torch.as_tensor(cu_seqlens_kv).tolist()]
    if len(cu_q) != len(cu_kv) or not cu_q:
        raise ValueError(f"cu_seqlens_q has {len(cu_q)} values and cu_seqlens_kv {len(cu_kv)}: they need the same number, at least 1")
    for name, cu, total in (("cu_seqlens_q", cu_q, queries), ("cu_seqlens_kv", cu_kv, keys)):
        if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] > total:
            raise ValueError(f"{name} must start at 0, never decrease and end at most at {total} rows: {cu[:8]}...")
    return [(cu_q[i], cu_q[i + 1] - cu_q[i], cu_kv[i], cu_kv[i + 1] - cu_kv[i]) for i in range(len(cu_q) - 1) if cu_q[i + 1] > cu_q[i]]


def _rows(x, r0, r1, groups, acc):
    """Rows r0 .. r1-1 of x [tokens, heads, dim] as [heads / groups, groups * rows, dim]
    in the accumulator dtype: the queries of a GQA group stacked, so that one
    batched product per key-value head serves them all."""
    block = x[r0:r1].to(acc).transpose(0, 1)
    return block.reshape(block.shape[0] // groups, groups * block.shape[1], block.shape[2])


def _scores(qb, kb, scale, mask, j0, j1, t0, t1, off):
    """[heads_kv, groups * rows, keys] scaled scores, -inf where the mask hides a key."""
    s = torch.bmm(qb, kb.transpose(1, 2)).mul_(scale)
    if not mask.sees_all(j0, j1, t0, t1, off):
        j = torch.arange(j0, j1, device=s.device)[:, None]
        t = torch.arange(t0, t1, device=s.device)[None, :]
        s.view(s.shape[0], -1, j1 - j0, t1 - t0).masked_fill_(~mask.allows(j, t, off), float("-inf"))
    return s


class _Problem:
    """What the forward and backward share: shapes, entries, mask, blocks."""

    def __init__(self, q, k, v, cu_seqlens_q, cu_seqlens_kv, mask, softmax_scale, block_q, block_kv):
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or k.shape[:2] != v.shape[:2] or q.shape[2] != k.shape[2]:
            raise ValueError(f"q [queries, heads, dim], k and v [keys, heads_kv, dim]: got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
            raise ValueError(f"heads of q ({q.shape[1]}) must be a multiple of the heads of k and v ({k.shape[1]})")
        if block_q < 1 or block_kv < 1:
            raise ValueError(f"block_q = {block_q} and block_kv = {block_kv} must be positive")
        self.entries = _entries(cu_seqlens_q, cu_seqlens_kv, q.shape[0], k.shape[0])
        self.mask = _Mask(mask)
        self.scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        self.groups = q.shape[1] // k.shape[1]
        self.acc = _accumulator(q.dtype)
        self.block_q, self.block_kv = block_q, block_kv

    def blocks(self):
        """(first query, first key, j0, j1, lk, off) of every query block of every entry."""
        for q0, lq, k0, lk in self.entries:
            for j0 in range(0, lq, self.block_q):
                yield q0, k0, j0, min(lq, j0 + self.block_q), lk, lk - lq

    def key_blocks(self, j0, j1, lk, off):
        """(t0, t1) of the key blocks rows j0 .. j1-1 see some key of."""
        lo, hi = self.mask.keys(j0, j1, lk, off)
        return [(t0, min(hi, t0 + self.block_kv)) for t0 in range(lo, hi, self.block_kv)]


def _forward(p, q, k, v):
    """Flash-attention's forward: out [queries, heads, dim_v] and lse [heads, queries]."""
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=p.acc, device=q.device)
    for q0, k0, j0, j1, lk, off in p.blocks():
        o, block_lse = _forward_block(p, _rows(q, q0 + j0, q0 + j1, p.groups, p.acc), k, v, k0, j0, j1, lk, off)
        out[q0 + j0:q0 + j1] = o.reshape(q.shape[1], j1 - j0, -1).transpose(0, 1)
        lse[:, q0 + j0:q0 + j1] = block_lse.reshape(q.shape[1], j1 - j0)
    return out, lse


def _forward_block(p, qb, k, v, k0, j0, j1, lk, off):
    """One query block against its entry's visible key blocks, online softmax."""
    rows = qb.shape[:2]
    m = torch.full(rows, float("-inf"), dtype=p.acc, device=qb.device)  # running row maximum
    l = torch.zeros(rows, dtype=p.acc, device=qb.device)  # running sum of exp(s - m)
    acc = torch.zeros(rows + (v.shape[2],), dtype=p.acc, device=qb.device)
    for t0, t1 in p.key_blocks(j0, j1, lk, off):
        s = _scores(qb, _rows(k, k0 + t0, k0 + t1, 1, p.acc), p.scale, p.mask, j0, j1, t0, t1, off)
        m_new = torch.maximum(m, s.amax(-1))
        shift = m_new.masked_fill(m_new == float("-inf"), 0.0)  # a row with no key yet: exp(-inf - 0) = 0, not nan
        s.sub_(shift[..., None]).exp_()
        alpha = torch.exp(m - shift)
        l.mul_(alpha).add_(s.sum(-1))
        acc.mul_(alpha[..., None]).baddbmm_(s, _rows(v, k0 + t0, k0 + t1, 1, p.acc))
        m = m_new
    lse = m.masked_fill(m == float("-inf"), 0.0) + l.log()  # l == 0: no key seen, lse -inf
    return acc / l.masked_fill(l == 0, 1.0)[..., None], lse


def _backward(p, q, k, v, out, lse, dout, dlse):
    """Flash-attention's backward by recomputation: dq, dk, dv."""
    dq = torch.zeros_like(q)
    dk = torch.zeros(k.shape, dtype=p.acc, device=k.device)  # the gradients themselves unless q is 16-bit
    dv = torch.zeros(v.shape, dtype=p.acc, device=v.device)
    for q0, k0, j0, j1, lk, off in p.blocks():
        r0, r1 = q0 + j0, q0 + j1
        qb, dob = _rows(q, r0, r1, p.groups, p.acc), _rows(dout, r0, r1, p.groups, p.acc)
        rows = qb.shape[:2]
        # D = rowsum(dO * O), less lse's gradient: d lse / d s is P itself, so it joins D
        d = (dob * _rows(out, r0, r1, p.groups, p.acc)).sum(-1).sub_(dlse[:, r0:r1].to(p.acc).reshape(rows))
        row_lse = lse[:, r0:r1].reshape(rows)
        row_lse = row_lse.masked_fill(row_lse == float("-inf"), float("inf"))  # a row that sees nothing: P = 0
        dqb = torch.zeros_like(qb)
        for t0, t1 in p.key_blocks(j0, j1, lk, off):
            kb, vb = _rows(k, k0 + t0, k0 + t1, 1, p.acc), _rows(v, k0 + t0, k0 + t1, 1, p.acc)
            prob = _scores(qb, kb, p.scale, p.mask, j0, j1, t0, t1, off).sub_(row_lse[..., None]).exp_()
            dv[k0 + t0:k0 + t1].add_(torch.bmm(prob.transpose(1, 2), dob).transpose(0, 1))
            ds = prob.mul_(torch.bmm(dob, vb.transpose(1, 2)).sub_(d[..., None]))
            dqb.baddbmm_(ds, kb)
            dk[k0 + t0:k0 + t1].add_(torch.bmm(ds.transpose(1, 2), qb).mul_(p.scale).transpose(0, 1))
        dq[r0:r1] = dqb.mul_(p.scale).reshape(q.shape[1], r1 - r0, -1).transpose(0, 1)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


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
        return dq, dk, dv, None


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q=None, max_seqlen_kv=None, mask=None, softmax_scale=None, *,
                     block_q=BLOCK_Q, block_kv=BLOCK_KV, return_lse=False):
    """Variable-length attention in plain PyTorch ops, by flash-attention's
    algorithm (any device, any float dtype, differentiable).

    q [queries, heads, dim], k [keys, heads_kv, dim], v [keys, heads_kv,
    dim_v]; heads a multiple of heads_kv (grouped-query attention: query
    head h reads key-value head h // (heads / heads_kv)). Entries by
    cu_seqlens (rows past the last entry give 0); each entry's mask is the
    plan's (``mask``, default causal), bottom-right aligned (attention_mask).
    Queries go in blocks of ``block_q`` rows against the key blocks of
    ``block_kv`` rows of their own entry that the mask leaves visible, with
    an online softmax; the backward recomputes the scores block by block.
    Memory beyond the inputs and outputs is a few [heads, block_q, block_kv]
    tensors, whatever the sequence length (and, for 16-bit inputs, float32
    gradient sums of k's and v's size). Sums run in float32 (float64 for
    float64 inputs).

    ``return_lse=True`` returns (out, lse): lse [heads, queries], each row's
    natural-log log-sum-exp of its scaled scores, in the accumulator dtype,
    -inf (and output 0) for a row that sees no key; it is differentiable.
    The signature follows flash-attention's flash_attn_varlen_func, which a
    GPU caller may pass to ContextParallelAttention instead."""
    del max_seqlen_q, max_seqlen_kv  # what a fused kernel sizes its tiles by
    problem = _Problem(q, k, v, cu_seqlens_q, cu_seqlens_kv, mask, softmax_scale, block_q, block_kv)
    out, lse = _FlashAttention.apply(q, k, v, problem)
    return (out, lse) if return_lse else out


class ContextParallelAttention(torch.nn.Module):
    """Context-parallel attention: dispatch the queries and key-values of the
    MLP layout to the attention ranks, attend each query shard to its KV group
    under the plan's mask, and bring the outputs home.

    ``kernel`` (default varlen_attention with its default blocks) is called as
    ``kernel(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, mask, softmax_scale)``
    and returns the output; ``functools.partial(varlen_attention, block_q=..., block_kv=...)``
    sets other blocks."""

    def __init__(self, softmax_scale=None, kernel=None):
        super().__init__()
        self.softmax_scale = softmax_scale
        self.kernel = kernel or varlen_attention

    def forward(self, q, k, v, dispatch):
        qa = dispatch.dispatch_q(q)
        ka = dispatch.dispatch_kv(k)
        va = dispatch.dispatch_kv(v)
        cu_q = dispatch.cu_seqlens_q.to(q.device)
        cu_kv = dispatch.cu_seqlens_kv.to(q.device)
        out = self.kernel(qa, ka, va, cu_q, cu_kv, dispatch.max_seqlen_q, dispatch.max_seqlen_kv, dispatch.mask, self.softmax_scale)
        return dispatch.undispatch(out)
