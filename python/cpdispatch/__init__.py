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
lists of arrays (views into one array), scalars are ints, absent fields None;
``attn["entries"]`` (plans whose documents carry slices) is nested lists as
the JSON has them.
plan_for_rank of a QKV plan adds ``"varlen"``: the rank's ``cu_seqlens_q`` /
``cu_seqlens_kv`` as int32 arrays (flash-attention's varlen dtype;
``torch.from_numpy`` shares them) and ``max_seqlen_q`` / ``max_seqlen_kv``.

batch_from_cu_seqlens turns flash-attention's cu_seqlens (one packed
sequence cut evenly over the ranks, or each rank's own) into balance's input.

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
import numbers as _numbers

from . import _cpdispatch

__all__ = ["Plan", "plan", "plan_for_rank", "balance", "batch_from_cu_seqlens", "token_indices", "position_ids", "mask_of", "CAUSAL",
           "DEFAULT_MAX_MEMORY"]

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
    ``kv_wire_rev``, the deduplicated KV exchange. A plan with head-parallel
    documents (``"head_parallel": true``, docs/plan-format.md section 2f) adds
    ``hp_fwd``, ``hp_rev`` and ``hp_attn``."""
    return _cpdispatch.plan(_core(plan), dedup, max_memory)


def plan_for_rank(plan, rank, dedup=False, *, max_memory=DEFAULT_MAX_MEMORY):
    """One rank's share, planned without the global metadata (as
    ``cpdispatch-plan --rank R``): ``rank``, each metadata's slice (its rows
    without padding), ``attn`` (this rank's seqlens, cu_seqlens, max_seqlen;
    for a plan whose documents carry slices also ``entries``: per query
    shard a list of [q0, q1, k0, k1, lo, hi], None an open end),
    ``varlen`` (int32 cu_seqlens), with dedup its ``kv_wire_fwd`` / ``kv_wire_rev`` slices,
    and with head-parallel documents (section 2f) its ``hp_fwd`` / ``hp_rev`` slices and ``hp_attn`` row."""
    return _cpdispatch.plan_for_rank(_core(plan), rank, dedup, max_memory)


def balance(batch, dedup=False, *, grid=1, max_memory=DEFAULT_MAX_MEMORY, **options):
    """A load-balanced qkv plan (dict) for a batch, as ``cpdispatch-plan balance``.

    ``batch`` is balance's input: ``{"world_size": W, "max_cp_degree": C,
    "documents": [{"pieces": [{"rank": r, "len": n}, ...]}, ...]}`` (a packed
    batch: documents may span ranks) or ``"ranks": [{"docs": [len, ...]}, ...]``.
    Keyword options are added to it (``max_cp_degree``, ``q_bytes``,
    ``kv_bytes``, ``recv_capacity``, ``mask``, ``head_parallel="auto"`` with
    ``heads_q`` and optionally ``heads_kv`` and ``head_parallel_degree``:
    documents spread over ranks may go head-parallel...). ``grid=G`` (as
    ``--grid G``; an integer in [1, 2**40]) cuts documents only at multiples
    of G tokens in the packed coordinate, as the invariant mode needs (its
    default grid is 64); 1 cuts anywhere, and leaves the batch's own
    ``"grid"`` in force. The result is a plan that plan() and plan_for_rank() take."""
    if options:
        batch = dict(batch, **options)
    if isinstance(grid, bool) or not isinstance(grid, _numbers.Integral):
        raise ValueError(f"grid must be an integer in [1, 2**40], not {grid!r}")
    if not 1 <= grid <= 2**40:
        raise ValueError(f"grid = {grid} must be in [1, 2**40] (1: no grid; the invariant mode's default is 64)")
    return _cpdispatch.balance(batch, dedup, max_memory, int(grid))


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


def position_ids(plan, rank, *, max_memory=DEFAULT_MAX_MEMORY):
    """Position of each of rank ``rank``'s tokens (MLP layout) within its
    document, counted from 0: the positions RoPE rotates by. A NumPy int64
    array, from the C++ planner's shard table (a qkv plan's; a query plan has
    no documents and raises ValueError, as do malformed plans and ranks outside it)."""
    return _cpdispatch.position_ids(_core(plan), rank, max_memory)


def _offsets(cu_seqlens, name):
    """cu_seqlens (a list, NumPy array or integer tensor) as a 1-D NumPy
    int64 array that starts at 0 and never decreases; ValueError naming ``name``."""
    import numpy as np

    if hasattr(cu_seqlens, "detach") and hasattr(cu_seqlens, "cpu"):  # a torch tensor, without importing torch here
        cu_seqlens = cu_seqlens.detach().cpu().numpy()
    try:
        array = np.asarray(cu_seqlens)
    except ValueError as e:  # ragged nesting
        raise ValueError(f"{name} must be a 1-D sequence of integers: {e}") from None
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{name} must be 1-D with at least one value (0), not of shape {array.shape} "
                         "(per-rank cu_seqlens go in a list, one 1-D sequence a rank)")
    if array.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers (int32 or int64), not {array.dtype}")
    array = array.astype(np.int64)
    if array[0] != 0:
        raise ValueError(f"{name}[0] = {array[0]} must be 0")
    drops = np.flatnonzero(array[1:] < array[:-1])
    if drops.size:
        i = int(drops[0]) + 1
        raise ValueError(f"{name}[{i}] = {array[i]} is below {name}[{i - 1}] = {array[i - 1]}: cu_seqlens never decreases")
    return array


def _check_tokens(cu, tokens, name):
    if tokens is not None and int(cu[-1]) != int(tokens):
        raise ValueError(f"{name} ends at {int(cu[-1])}, but the sequence has {tokens} tokens")


def _pieces(start, end, per_rank):
    """A document's tokens [start, end) of a sequence cut into ranks of per_rank tokens, as balance's pieces."""
    pieces = []
    while start < end:
        rank = start // per_rank
        stop = min(end, (rank + 1) * per_rank)
        pieces.append({"rank": rank, "len": stop - start})
        start = stop
    return pieces


def _per_rank_form(cu_seqlens):
    """Whether cu_seqlens is a list (or tuple) of per-rank cu_seqlens rather than one sequence's."""
    if not isinstance(cu_seqlens, (list, tuple)) or not cu_seqlens:
        return False
    return all(isinstance(x, (list, tuple)) or getattr(x, "ndim", 0) >= 1 for x in cu_seqlens)


def batch_from_cu_seqlens(cu_seqlens, world_size=None, *, max_cp_degree=None, tokens=None):
    """balance's input (a dict for cpdispatch.balance) from flash-attention's
    cu_seqlens: the documents' boundaries in a packed sequence, from 0 to its
    length. Two forms:

    - one packed sequence cut evenly over ``world_size`` ranks: rank r holds
      tokens [r T / W, (r + 1) T / W), so a document continues on the next
      rank where a cut falls inside it (the ``documents`` form). T must be a
      multiple of W (pad the sequence).
    - a list (or tuple) of W per-rank cu_seqlens, each rank's own packed
      micro-batch (the ``ranks`` form); ``world_size`` is then the list's
      length and may be left out.

    cu_seqlens: a list, NumPy array or integer tensor (int32 or int64), 1-D,
    from 0, never decreasing; a repeated value is an empty document (as
    padding gives) and is left out. ``tokens`` (optional): the sequence's
    length (per-rank form: each rank's, one int or one per rank), which the
    last value must equal. ``max_cp_degree``: the most shards the balancer
    may cut a document into; by default 2 * world_size, which lets it cut
    even a document that spans every rank finely enough to balance it (a
    smaller value makes smaller metadata; below a document's number of
    pieces, balance refuses it). Bad input raises ValueError naming it."""
    if _per_rank_form(cu_seqlens):
        world_size = _world_size(len(cu_seqlens) if world_size is None else world_size, len(cu_seqlens))
        batch = {"ranks": _rank_documents(cu_seqlens, tokens)}
    else:
        world_size = _world_size(world_size, None)
        batch = {"documents": _packed_documents(cu_seqlens, world_size, tokens)}
    max_cp_degree = 2 * world_size if max_cp_degree is None else max_cp_degree
    return dict({"world_size": world_size, "max_cp_degree": max_cp_degree}, **batch)


def _world_size(world_size, ranks):
    if world_size is None:
        raise ValueError("world_size is needed with one packed sequence's cu_seqlens")
    if isinstance(world_size, bool) or not isinstance(world_size, _numbers.Integral) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, not {world_size!r}")
    if ranks is not None and world_size != ranks:
        raise ValueError(f"world_size = {world_size}, but {ranks} per-rank cu_seqlens are given")
    return int(world_size)


def _packed_documents(cu_seqlens, world_size, tokens):
    cu = _offsets(cu_seqlens, "cu_seqlens")
    _check_tokens(cu, tokens, "cu_seqlens")
    total = int(cu[-1])
    if total % world_size:
        raise ValueError(f"cu_seqlens ends at {total} tokens, not a multiple of world_size = {world_size}: "
                         f"pad the packed sequence to a multiple (e.g. {-(-total // world_size) * world_size} tokens)")
    per_rank = total // world_size
    return [{"pieces": _pieces(int(a), int(b), per_rank)} for a, b in zip(cu[:-1], cu[1:]) if b > a]


def _rank_documents(cu_seqlens, tokens):
    import numpy as np

    if tokens is None or np.ndim(tokens) == 0:
        tokens = [tokens] * len(cu_seqlens)
    elif len(tokens) != len(cu_seqlens):
        raise ValueError(f"tokens has {len(tokens)} values for {len(cu_seqlens)} ranks")
    ranks = []
    for r, (rank_cu, rank_tokens) in enumerate(zip(cu_seqlens, tokens)):
        cu = _offsets(rank_cu, f"cu_seqlens[{r}]")
        _check_tokens(cu, rank_tokens, f"cu_seqlens[{r}]")
        lengths = cu[1:] - cu[:-1]
        ranks.append({"docs": [int(n) for n in lengths if n > 0]})
    return ranks
