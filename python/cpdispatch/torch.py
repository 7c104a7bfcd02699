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
"""

import torch
import torch.distributed as dist

import cpdispatch

__all__ = ["RankDispatch", "ContextParallelAttention", "varlen_attention", "attention_mask"]


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


def attention_mask(cu_seqlens_q, cu_seqlens_kv, mask, device=None):
    """[queries, keys] bool: True where a query row sees a key row. Entries
    are independent (block diagonal); inside entry i with lq query and lk key
    rows, row j sees column t by the plan's mask, bottom-right aligned
    (docs/plan-format.md section 2d): causal t <= j + lk - lq, sliding window
    j + lk - lq - w < t <= j + lk - lq, full always."""
    cu_q = cu_seqlens_q.to(torch.int64)
    cu_kv = cu_seqlens_kv.to(torch.int64)
    lq, lk = cu_q[1:] - cu_q[:-1], cu_kv[1:] - cu_kv[:-1]
    entries = torch.arange(lq.numel())
    q_entry = torch.repeat_interleave(entries, lq)
    k_entry = torch.repeat_interleave(entries, lk)
    j = torch.arange(int(cu_q[-1])) - cu_q[:-1][q_entry]
    t = torch.arange(int(cu_kv[-1])) - cu_kv[:-1][k_entry]
    seen = q_entry[:, None] == k_entry[None, :]
    kind = mask.get("type", "causal")
    if kind != "full":
        diagonal = (j + (lk - lq)[q_entry])[:, None]
        seen &= t[None, :] <= diagonal
        if kind == "sliding_window":
            seen &= t[None, :] > diagonal - int(mask["window"])
        elif kind != "causal":
            raise ValueError(f"mask.type: unknown mask {kind!r} (causal, full or sliding_window)")
    return seen.to(device) if device is not None else seen


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, mask, softmax_scale=None):
    """Variable-length attention in plain PyTorch ops (any device, any float
    dtype): q [queries, heads, dim], k and v [keys, heads, dim], entries by
    cu_seqlens, the plan's mask. The signature follows flash-attention's
    flash_attn_varlen_func, which a GPU caller may pass to
    ContextParallelAttention instead (with causal / window_size from the mask)."""
    del max_seqlen_q, max_seqlen_kv  # what a fused kernel sizes its tiles by
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    seen = attention_mask(cu_seqlens_q, cu_seqlens_kv, mask, device=q.device)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~seen, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees nothing (no keys) gives 0
    return torch.einsum("hqk,khd->qhd", weights, v)


class ContextParallelAttention(torch.nn.Module):
    """Context-parallel attention: dispatch the queries and key-values of the
    MLP layout to the attention ranks, attend each query shard to its KV group
    under the plan's mask, and bring the outputs home.

    ``kernel`` (default varlen_attention) is called as
    ``kernel(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, mask, softmax_scale)``."""

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
