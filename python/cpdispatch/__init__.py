"""cpdispatch from Python: context-parallel dispatch planning and balancing.

The planning runs in cpdispatch's C++ core (the same code as the
``cpdispatch-plan`` CLI); this package only converts. Plans are the JSON
contract's dicts (docs/plan-format.md, section 3), or JSON text:

    import cpdispatch
    meta = cpdispatch.plan({"world_size": 2, "ranks": [
        {"docs": [{"shard_len": [4, 2], "dst": [1, 0]}]},
        {"docs": [{"shard_len": [5], "dst": [1]}]}]})
    meta["kv_fwd"]["dst_offset"]        # numpy.int64 array, [W][S][C]

Results have exactly the keys of ``cpdispatch-plan``'s JSON output, nested the
same way; every array is a NumPy int64 array (the metadata tensors own the
planner's storage: moved, not copied), ragged per-rank rows (``attn``) are
lists of arrays (views into one array), scalars are ints, absent fields None.
plan_for_rank of a QKV plan adds ``"varlen"``: the rank's ``cu_seqlens_q`` /
``cu_seqlens_kv`` as int32 arrays (flash-attention's varlen dtype;
``torch.from_numpy`` shares them) and ``max_seqlen_q`` / ``max_seqlen_kv``.

Bad input raises ValueError with the library's message, naming the field
(e.g. ``ranks[1].docs[0].dst[0]: ...``).

Every call that reads, plans or balances takes ``max_memory`` (keyword only;
bytes, default DEFAULT_MAX_MEMORY = 4 GiB): the most it may allocate (outputs,
working memory, parsed JSON text), estimated from the plan's sizes before
anything of that size is allocated. A plan beyond it (say, a tiny dict
naming a billion ranks) raises ValueError naming its sizes and the budget.
"""

import copy as _copy
import json as _json

from . import _cpdispatch

__all__ = ["Plan", "plan", "plan_for_rank", "balance", "token_indices", "position_ids", "mask_of", "CAUSAL", "DEFAULT_MAX_MEMORY"]

#: The mask a plan without "mask" has (docs/plan-format.md, section 2d).
CAUSAL = {"type": "causal"}

#: The budget of one call when ``max_memory`` is not given: the C++ library's, 4 GiB.
DEFAULT_MAX_MEMORY = _cpdispatch.default_max_memory


class Plan:
    """A plan read once, for repeated calls: plan(), plan_for_rank(),
    token_indices(), position_ids() and cpdispatch.torch.RankDispatch take it
    in place of the dict (or JSON text) and skip reading it again, which for
    per-rank planning costs more than the planning. Malformed input (types,
    keys, shapes) raises ValueError here, bad values (ranks, lengths) when
    planned. ``dedup=True`` makes every call plan the deduplicated
    KV exchange. ``max_memory`` bounds the reading of JSON text here; each
    planning call takes its own. Keep the source unchanged while the Plan is in use."""

    def __init__(self, plan, dedup=False, *, max_memory=DEFAULT_MAX_MEMORY):
        self.parsed = _cpdispatch.ParsedPlan(plan, dedup, max_memory)  # first: it bounds the text json.loads reads next
        self.source = _json.loads(plan) if isinstance(plan, (str, bytes)) else plan
        self.mask = mask_of(self.source)

    @property
    def world_size(self):
        return self.parsed.world_size

    @property
    def kind(self):
        """"query" or "qkv"."""
        return self.parsed.kind

    @property
    def dedup(self):
        return self.parsed.dedup


def _core(plan):
    return plan.parsed if isinstance(plan, Plan) else plan


def _source(plan):
    if isinstance(plan, Plan):
        return plan.source
    return _json.loads(plan) if isinstance(plan, (str, bytes)) else plan


def plan(plan, dedup=False, *, max_memory=DEFAULT_MAX_MEMORY):
    """Plans a whole plan: cpdispatch-plan's output as a dict (see the module doc).

    ``dedup=True`` (or ``"dedup": true`` in the plan) adds ``kv_wire_fwd`` and
    ``kv_wire_rev``, the deduplicated KV exchange."""
    return _cpdispatch.plan(_core(plan), dedup, max_memory)


def plan_for_rank(plan, rank, dedup=False, *, max_memory=DEFAULT_MAX_MEMORY):
    """One rank's share, planned without the global metadata (as
    ``cpdispatch-plan --rank R``): ``rank``, each metadata's slice (its rows
    without padding), ``attn`` (this rank's seqlens, cu_seqlens, max_seqlen),
    ``varlen`` (int32 cu_seqlens), and with dedup its ``kv_wire_fwd`` / ``kv_wire_rev`` slices."""
    return _cpdispatch.plan_for_rank(_core(plan), rank, dedup, max_memory)


def balance(batch, dedup=False, *, max_memory=DEFAULT_MAX_MEMORY, **options):
    """A load-balanced qkv plan (dict) for a batch, as ``cpdispatch-plan balance``.

    ``batch`` is balance's input: ``{"world_size": W, "max_cp_degree": C,
    "documents": [{"pieces": [{"rank": r, "len": n}, ...]}, ...]}`` (a packed
    batch: documents may span ranks) or ``"ranks": [{"docs": [len, ...]}, ...]``.
    Keyword options are added to it (``max_cp_degree``, ``q_bytes``,
    ``kv_bytes``, ``recv_capacity``, ``mask``...). The result is a plan that
    plan() and plan_for_rank() take."""
    if options:
        batch = dict(batch, **options)
    return _cpdispatch.balance(batch, dedup, max_memory)


def token_indices(plan, rank, dedup=False, *, max_memory=DEFAULT_MAX_MEMORY):
    """Rank ``rank``'s gather/scatter token indices from the C++ dispatcher's
    plan: ``"q"`` and ``"kv"`` (and with dedup ``"kv_wire"``, ``"fan"``), each
    with its ``forward`` / ``reverse`` exchange (``send_index``,
    ``send_counts``, ``recv_index``, ``recv_counts``) and the copy combine
    (``combine_source`` -> ``combine_target``). cpdispatch.torch runs them."""
    return _cpdispatch.token_indices(_core(plan), rank, dedup, max_memory)


def mask_of(plan):
    """The plan's attention mask dict (causal when the plan has none)."""
    plan = _source(plan)
    mask = plan.get("mask") if isinstance(plan, dict) else None
    return _copy.deepcopy(mask) if mask is not None else dict(CAUSAL)


def _rank_shards(plan, rank):
    """(document index, shard start within the document, length) of each of
    rank ``rank``'s shards in its MLP-layout order."""
    plan = _source(plan)
    shards = []
    if "documents" in plan:
        for d, doc in enumerate(plan["documents"]):
            start = 0
            for s in doc["shards"]:
                if int(s["rank"]) == rank:
                    shards.append((d, start, int(s["len"])))
                start += int(s["len"])
    else:
        for d, doc in enumerate(plan["ranks"][rank]["docs"]):
            start = 0
            for n in doc["shard_len"]:
                shards.append((d, start, int(n)))
                start += int(n)
    return shards


def position_ids(plan, rank):
    """Position of each of rank ``rank``'s tokens (MLP layout) within its
    document, counted from 0: the positions RoPE rotates by. A NumPy int64 array."""
    import numpy as np

    pieces = [np.arange(start, start + n, dtype=np.int64) for _, start, n in _rank_shards(plan, rank)]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
