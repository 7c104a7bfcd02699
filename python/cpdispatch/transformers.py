"""cpdispatch for Hugging Face transformers: context-parallel attention as the
attention implementation "cpdispatch", and each rank's share of a packed batch.

    import cpdispatch.transformers as cpt        # registers "cpdispatch" with transformers

    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="cpdispatch")
    shard = cpt.PackedShard(cu_seqlens)          # every rank the same call; the rank and W from torch.distributed
    out = model(input_ids=shard.take(input_ids), position_ids=shard.position_ids, cp_shard=shard)
    loss = shard.loss(out.logits, input_ids)     # labels shifted across ranks, document ends ignored
    loss.backward()
    shard.reduce_gradients(model.parameters())   # the ranks' parameter gradients summed

The packed sequence (all documents back to back, ``cu_seqlens`` their
boundaries) is cut evenly over the ranks: rank r holds tokens
[r T / W, (r + 1) T / W) of the sequence padded to a multiple of W (the
padding is a document of its own whose labels are ignored). Every layer but
attention runs on these tokens; the attention layers run through
ContextParallelAttention under a balanced plan, one plan per kind of mask
(causal, and each sliding window the model's layers use), planned the
first time a layer asks for it.

Under torch.compile the attention is the custom op ``cpdispatch::attention``
(with a fake implementation, so the graph does not break inside it); it
finds the batch through ``with shard:`` rather than a keyword argument,
since the compiled graph carries tensors, not Python objects (the backward
may run after the ``with`` block: it takes the batch of the latest forward).
"""

import numbers
from typing import Optional

import torch
import torch.distributed as dist

import cpdispatch
from cpdispatch.torch import ContextParallelAttention, RankDispatch

__all__ = ["NAME", "IGNORE_INDEX", "PackedShard", "attention_forward", "register", "active_shard"]

NAME = "cpdispatch"
IGNORE_INDEX = -100  # what transformers' and PyTorch's cross-entropy ignore

_ACTIVE = []  # the shards entered with `with shard:`, innermost last


def active_shard():
    """The innermost shard entered with ``with shard:``, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


class PackedShard:
    """One rank's share of a packed batch.

    ``cu_seqlens``: the documents' boundaries in the packed sequence (a list,
    NumPy array or tensor, from 0 to its length L), the same on every rank.
    ``group``, ``rank``, ``world_size``: the context-parallel group (default:
    torch.distributed's default group; without one, a single rank).
    ``max_cp_degree``, ``dedup``: as in cpdispatch.balance and RankDispatch.
    ``kernel``, ``stages``: as in ContextParallelAttention (the blockwise
    kernel by default).

    Attributes: ``length`` (L), ``tokens`` (L padded to a multiple of W),
    ``indices`` (int64: the packed-sequence positions of this rank's tokens,
    in the order the model sees them), ``position_ids`` (int64 ``[1, T_r]``:
    each token's position within its document, for RoPE, from the planner)."""

    def __init__(self, cu_seqlens, group=None, *, rank=None, world_size=None, max_cp_degree=None, dedup=False, kernel="blockwise",
                 stages=1, max_memory=cpdispatch.DEFAULT_MAX_MEMORY):
        distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        self.world = int(world_size) if world_size is not None else (dist.get_world_size(group) if distributed else 1)
        self.rank = int(rank) if rank is not None else (dist.get_rank(group) if distributed else 0)
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside [0, {self.world})")
        cu = cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else list(cu_seqlens)
        if not cu or cu[-1] <= 0:
            raise ValueError(f"cu_seqlens must end at the sequence's length (at least 1 token), not {cu!r}")
        self.length = int(cu[-1])
        self.tokens = -(-self.length // self.world) * self.world
        padded = cu + [self.tokens] if self.tokens > self.length else cu
        # batch_from_cu_seqlens checks the values (from 0, not decreasing, integers) and names a bad one.
        self._batch = cpdispatch.batch_from_cu_seqlens(padded, self.world, max_cp_degree=max_cp_degree)
        share = self.tokens // self.world
        self.indices = torch.arange(self.rank * share, (self.rank + 1) * share, dtype=torch.int64)
        # The last token of each document (and the padding) has no next token to predict.
        bounds = torch.tensor(padded, dtype=torch.int64)
        ends = torch.unique(bounds[bounds > 0])
        self._no_next = ends - 1
        self._dedup, self._max_memory = dedup, max_memory
        self._kernel, self._stages = kernel, stages
        self._dispatches, self._attentions = {}, {}
        self.position_ids = self.dispatch(None).position_ids.view(1, -1)

    def dispatch(self, sliding_window=None):
        """The RankDispatch of the plan for one kind of layer: causal
        (``sliding_window`` None or 0) or a sliding window of that many tokens
        (a query sees itself and the window - 1 tokens before it, as
        transformers' sliding_window). Balanced once per kind; every rank's
        layers ask in the same order, and balancing needs no collective."""
        window = _window(sliding_window)
        if window not in self._dispatches:
            mask = {"type": "causal"} if window is None else {"type": "sliding_window", "window": window}
            plan = cpdispatch.Plan(cpdispatch.balance(self._batch, mask=mask, max_memory=self._max_memory), max_memory=self._max_memory)
            self._dispatches[window] = RankDispatch(plan, self.rank, self._dedup, self.group, max_memory=self._max_memory)
        return self._dispatches[window]

    def attention(self, q, k, v, sliding_window=None, softmax_scale=None):
        """Context-parallel attention of this rank's tokens: ``q`` of shape
        ``[T_r, heads, dim]``, ``k`` and ``v`` of ``[T_r, heads_kv, dim]``
        (grouped-query attention: heads_kv divides heads); the output is
        ``[T_r, heads, dim_v]`` in the same token order."""
        key = None if softmax_scale is None else float(softmax_scale)
        if key not in self._attentions:
            self._attentions[key] = ContextParallelAttention(softmax_scale=key, kernel=self._kernel, stages=self._stages)
        return self._attentions[key](q, k, v, self.dispatch(sliding_window))

    def take(self, x, dim=-1, pad=0):
        """This rank's tokens of ``x`` (the whole packed sequence along
        ``dim``: L or the padded length), padding filled with ``pad``."""
        dim = dim % x.dim()
        n = x.shape[dim]
        if n not in (self.length, self.tokens):
            raise ValueError(f"x has {n} tokens along dim {dim}; the packed sequence has {self.length} tokens ({self.tokens} padded)")
        if n < self.tokens:
            shape = list(x.shape)
            shape[dim] = self.tokens - n
            x = torch.cat([x, x.new_full(shape, pad)], dim)
        return x.index_select(dim, self.indices.to(x.device))

    def shifted_labels(self, labels):
        """The whole sequence's labels shifted by one (token i learns token
        i + 1 of its document): IGNORE_INDEX at each document's last token and
        on the padding; ``labels`` (e.g. the input ids, or them with
        IGNORE_INDEX where no loss is wanted) of L or padded length, the last
        dimension the sequence."""
        flat = labels.reshape(-1, labels.shape[-1])
        if flat.shape[0] != 1 or flat.shape[1] not in (self.length, self.tokens):
            raise ValueError(f"labels of shape {tuple(labels.shape)}: one packed sequence of {self.length} tokens expected")
        shifted = flat.new_full((self.tokens,), IGNORE_INDEX)
        shifted[:self.length - 1] = flat[0, 1:self.length]
        shifted[self._no_next.to(shifted.device)] = IGNORE_INDEX
        shifted[self.length:] = IGNORE_INDEX
        return shifted

    def labels(self, labels):
        """This rank's shifted labels, ``[1, T_r]``: the next token of a rank's
        last token is the first of the next rank's (the whole sequence's labels
        are on every rank, as the data loader made them)."""
        return self.take(self.shifted_labels(labels)).view(1, -1)

    def num_labels(self, labels):
        """How many tokens of the whole sequence have a label (not ignored)."""
        return int((self.shifted_labels(labels) != IGNORE_INDEX).sum())

    def loss(self, logits, labels):
        """This rank's part of the mean next-token cross-entropy over the whole
        batch: its tokens' summed loss over the number of labels of all ranks
        (so the ranks' losses, and their gradients, add up to the mean)."""
        mine = self.labels(labels).to(logits.device).view(-1)
        total = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), mine,
                                                  ignore_index=IGNORE_INDEX, reduction="sum")
        return total / max(self.num_labels(labels), 1)

    def reduce_gradients(self, parameters):
        """Sums each parameter's gradient over the group's ranks (the ranks
        hold different tokens of one batch)."""
        if self.world == 1:
            return
        for p in parameters:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)

    def __enter__(self):
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        return False


def _window(sliding_window):
    if sliding_window is None or sliding_window == 0:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral) or sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int or None, not {sliding_window!r}")
    return int(sliding_window)


_LAST_FORWARD = [None]  # the shard of the op's latest forward: its backward may run after `with shard:` has closed


def _shard_for_op(forward):
    shard = active_shard()
    if shard is None and not forward:
        shard = _LAST_FORWARD[0]
    if shard is None:
        raise RuntimeError("cpdispatch::attention runs inside `with shard:` (a cpdispatch.transformers.PackedShard)")
    if forward:
        _LAST_FORWARD[0] = shard
    return shard


# The compiled path: one opaque op per attention call, its backward a second
# op that attends again with autograd (the exchange's state lives in Python
# objects that a traced graph cannot hold).
@torch.library.custom_op("cpdispatch::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding_window: int, softmax_scale: Optional[float]) -> torch.Tensor:
    with torch.no_grad():
        return _shard_for_op(True).attention(q, k, v, sliding_window, softmax_scale)


@_attention_op.register_fake
def _attention_fake(q, k, v, sliding_window, softmax_scale):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))


@torch.library.custom_op("cpdispatch::attention_backward", mutates_args=())
def _attention_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, sliding_window: int,
                           softmax_scale: Optional[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out = _shard_for_op(False).attention(*leaves, sliding_window, softmax_scale)
        # Cloned: dk and dv are views of one buffer, and an op's outputs may not alias.
        return tuple(g.clone() for g in torch.autograd.grad(out, leaves, grad))


@_attention_backward_op.register_fake
def _attention_backward_fake(q, k, v, grad, sliding_window, softmax_scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, ctx.sliding_window, ctx.softmax_scale = inputs
    ctx.save_for_backward(q, k, v)


def _backward(ctx, grad):
    q, k, v = ctx.saved_tensors
    dq, dk, dv = _attention_backward_op(q, k, v, grad.contiguous(), ctx.sliding_window, ctx.softmax_scale)
    return dq, dk, dv, None, None


_attention_op.register_autograd(_backward, setup_context=_setup_context)


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, softcap=None,
                      cp_shard=None, **kwargs):
    """transformers' attention interface: ``query`` ``[1, heads, T_r, dim]``,
    ``key``, ``value`` ``[1, heads_kv, T_r, dim]`` of this rank's tokens;
    returns ``([1, T_r, heads, dim_v], None)``. The batch is ``cp_shard`` (a
    keyword argument of the model's forward) or the one entered with
    ``with shard:``."""
    if query.shape[0] != 1:
        raise ValueError(f"the cpdispatch attention takes one packed sequence (batch size 1), not {query.shape[0]}")
    if attention_mask is not None:
        raise ValueError("the cpdispatch attention takes no attention_mask: the documents come from cu_seqlens (PackedShard), "
                         "padding is a document of its own")
    if dropout:
        raise ValueError(f"the cpdispatch attention has no dropout (attention_dropout = {dropout})")
    if softcap:
        raise ValueError(f"the cpdispatch attention has no logit soft-capping (softcap = {softcap})")
    if not getattr(module, "is_causal", True):
        raise ValueError("the cpdispatch attention plans causal (and sliding-window) attention; this layer is not causal")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    if torch.compiler.is_compiling():
        out = _attention_op(q, k, v, sliding_window or 0, scaling)
    else:
        shard = cp_shard if cp_shard is not None else active_shard()
        if shard is None:
            raise RuntimeError("the cpdispatch attention needs the batch: pass cp_shard=shard (a PackedShard) to the model, "
                               "or run it inside `with shard:`")
        out = shard.attention(q, k, v, sliding_window, scaling)
    return out.unsqueeze(0), None


def register(name=NAME):
    """Registers attention_forward with transformers' AttentionInterface
    under ``name`` (done on import). Masks are not registered: the model
    then builds none, and the plan's mask is the one applied."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, attention_forward)


register()
