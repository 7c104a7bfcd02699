"""cpdispatch.batch_from_cu_seqlens: balance's input from one packed
sequence's cu_seqlens cut evenly over the ranks, or from every rank's own;
from lists, NumPy arrays and integer tensors; its errors; that balance
takes the result and its plan plans; and balance(..., grid=G), whose cuts
fall on multiples of G in the packed coordinate."""

import pytest

from conftest import require
from test_plan import run_cli

np = require("numpy")
cpdispatch = require("cpdispatch")

# 3 documents packed into 16 tokens: [0, 3), [3, 10), [10, 16); a repeated 3 is an empty document.
PACKED = [0, 3, 3, 10, 16]


def as_type(values, kind):
    """values as a list, NumPy int32 / int64 array or torch int32 / int64 tensor."""
    if kind == "list":
        return list(values)
    if kind.startswith("numpy"):
        return np.array(values, dtype=kind[len("numpy-"):])
    torch = require("torch")
    return torch.tensor(values, dtype=getattr(torch, kind[len("torch-"):]))


TYPES = ["list", "numpy-int32", "numpy-int64", "torch-int32", "torch-int64"]


@pytest.mark.parametrize("kind", TYPES)
def test_one_packed_sequence_cut_evenly_over_the_ranks(kind):
    batch = cpdispatch.batch_from_cu_seqlens(as_type(PACKED, kind), 2)
    # Rank 0 holds tokens [0, 8), rank 1 [8, 16): the second document spans the cut.
    assert batch == {"world_size": 2, "max_cp_degree": 4, "documents": [
        {"pieces": [{"rank": 0, "len": 3}]},
        {"pieces": [{"rank": 0, "len": 5}, {"rank": 1, "len": 2}]},
        {"pieces": [{"rank": 1, "len": 6}]}]}
    assert all(type(p["len"]) is int and type(p["rank"]) is int for d in batch["documents"] for p in d["pieces"])


def test_a_document_may_span_every_rank():
    batch = cpdispatch.batch_from_cu_seqlens([0, 1, 11, 12], 4, max_cp_degree=5, tokens=12)
    assert batch == {"world_size": 4, "max_cp_degree": 5, "documents": [
        {"pieces": [{"rank": 0, "len": 1}]},
        {"pieces": [{"rank": 0, "len": 2}, {"rank": 1, "len": 3}, {"rank": 2, "len": 3}, {"rank": 3, "len": 2}]},
        {"pieces": [{"rank": 3, "len": 1}]}]}


@pytest.mark.parametrize("kind", TYPES)
def test_per_rank_cu_seqlens(kind):
    per_rank = [as_type([0, 3, 8], kind), as_type([0, 8, 8], kind), as_type([0], kind)]
    batch = cpdispatch.batch_from_cu_seqlens(per_rank)
    assert batch == {"world_size": 3, "max_cp_degree": 6, "ranks": [{"docs": [3, 5]}, {"docs": [8]}, {"docs": []}]}
    assert cpdispatch.batch_from_cu_seqlens(tuple(per_rank), 3, tokens=[8, 8, 0]) == batch


@pytest.mark.parametrize("form", ["packed", "per-rank"])
def test_balance_takes_the_batch_and_its_plan_plans(form):
    if form == "packed":
        batch = cpdispatch.batch_from_cu_seqlens(np.array([0, 700, 900, 1500, 2048], dtype=np.int32), 4)
    else:
        batch = cpdispatch.batch_from_cu_seqlens([[0, 500, 512], [0, 100, 512], [0, 512], [0, 12, 24, 512]])
    plan = cpdispatch.balance(batch)
    assert plan["world_size"] == 4
    meta = cpdispatch.plan(plan)
    received = meta["q_fwd"]["num_recv_tokens"][:, -1]
    assert received.sum() == 2048  # every query token attended exactly once
    shares = [cpdispatch.plan_for_rank(plan, r) for r in range(4)]
    assert sum(int(s["varlen"]["cu_seqlens_q"][-1]) for s in shares) == 2048
    # Each rank's MLP layout is its slice of the packed sequence: positions restart at every document.
    positions = np.concatenate([cpdispatch.position_ids(plan, r) for r in range(4)])
    if form == "packed":
        assert positions.tolist() == [i for n in (700, 200, 600, 548) for i in range(n)]


def test_float_tensors_are_refused_and_strided_tensors_read():
    torch = require("torch")
    with pytest.raises(ValueError, match="cu_seqlens must hold integers.*float32"):
        cpdispatch.batch_from_cu_seqlens(torch.tensor([0.0, 4.0]), 2)
    assert cpdispatch.batch_from_cu_seqlens(torch.tensor([0, 4]).view(1, 2)[0], 2)["documents"] == [
        {"pieces": [{"rank": 0, "len": 2}, {"rank": 1, "len": 2}]}]


@pytest.mark.parametrize("args, kwargs, message", [
    (([0, 3, 7], 2), {}, r"ends at 7 tokens, not a multiple of world_size = 2: pad .* 8 tokens"),
    (([1, 4], 2), {}, r"cu_seqlens\[0\] = 1 must be 0"),
    (([0, 5, 4, 8], 2), {}, r"cu_seqlens\[2\] = 4 is below cu_seqlens\[1\] = 5"),
    (([0, 4, 8], 2), {"tokens": 10}, r"cu_seqlens ends at 8, but the sequence has 10 tokens"),
    (([0.0, 4.0], 2), {}, r"cu_seqlens must hold integers .*float64"),
    ((np.array([[0, 4], [0, 4]]), 2), {}, r"must be 1-D .* shape \(2, 2\) \(per-rank cu_seqlens go in a list"),
    ((np.array(4), 2), {}, r"must be 1-D"),
    (([], 2), {}, r"must be 1-D with at least one value"),
    (([[0, 2], 4], 2), {}, r"cu_seqlens must be a 1-D sequence of integers"),
    (([0, 4],), {}, r"world_size is needed"),
    (([0, 4], 0), {}, r"world_size must be a positive int, not 0"),
    (([0, 4], 2.0), {}, r"world_size must be a positive int"),
    (([[0, 4], [0, 2]], 3), {}, r"world_size = 3, but 2 per-rank cu_seqlens"),
    (([[0, 4], [0, 3, 2]],), {}, r"cu_seqlens\[1\]\[2\] = 2 is below cu_seqlens\[1\]\[1\] = 3"),
    (([[0, 4], [2, 3]],), {}, r"cu_seqlens\[1\]\[0\] = 2 must be 0"),
    (([[0, 4], [0, 2.5]],), {}, r"cu_seqlens\[1\] must hold integers"),
    (([[0, 4], [0, 3]],), {"tokens": 4}, r"cu_seqlens\[1\] ends at 3, but the sequence has 4 tokens"),
    (([[0, 4], [0, 3]],), {"tokens": [4]}, r"tokens has 1 values for 2 ranks"),
])
def test_bad_input_names_what_is_wrong(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cpdispatch.batch_from_cu_seqlens(*args, **kwargs)


def test_a_max_cp_degree_below_a_documents_span_is_refused_by_balance():
    batch = cpdispatch.batch_from_cu_seqlens([0, 12], 4, max_cp_degree=3)
    with pytest.raises(ValueError, match="max_cp_degree = 3"):
        cpdispatch.balance(batch)


def _cuts(plan):
    """Every boundary between two shards of a document, as (document, packed position of the boundary,
    whether it is a piece boundary of the MLP layout), the packed coordinate counted from the plan's
    shards: rank 0's tokens, then rank 1's, each rank's by (document, shard)."""
    at = [0] * (plan["world_size"] + 1)
    for doc in plan["documents"]:
        for s in doc["shards"]:
            at[s["rank"] + 1] += s["len"]
    for r in range(plan["world_size"]):
        at[r + 1] += at[r]
    out = []
    for d, doc in enumerate(plan["documents"]):
        shards = doc["shards"]
        for k, s in enumerate(shards):
            at[s["rank"]] += s["len"]
            if k + 1 < len(shards):
                out.append((d, at[s["rank"]], shards[k + 1]["rank"] != s["rank"]))
    return out


def test_balance_on_a_grid_cuts_documents_only_at_its_multiples(cli):
    # A loader's batch of 4 ranks of 1000 tokens (no multiple of 64): the rank boundaries, the input's
    # own cuts, stay where they are; every cut the balancer makes is at a multiple of 64.
    cu_seqlens = [0, 37, 1830, 1900, 3900, 4000]
    batch = cpdispatch.batch_from_cu_seqlens(cu_seqlens, 4)
    plan = cpdispatch.balance(batch, grid=64)
    balancer_cuts = [(d, p) for d, p, piece in _cuts(plan) if not piece]
    assert balancer_cuts, "the batch is cut: the test sees cuts"
    assert all(p % 64 == 0 for _, p in balancer_cuts), balancer_cuts
    assert any(p % 64 for _, p, piece in _cuts(cpdispatch.balance(batch)) if not piece), "without the grid, cuts fall anywhere"
    # The same plan as the CLI's --grid, and as a "grid" key in the batch; grid=1 is the plan without a grid.
    assert plan == run_cli(cli, batch, "balance", "--grid", "64")
    assert plan == cpdispatch.balance(dict(batch, grid=64)) == cpdispatch.balance(dict(batch, grid=16), grid=64)
    assert cpdispatch.balance(batch, grid=1) == cpdispatch.balance(batch)
    assert cpdispatch.plan(plan)["q_fwd"]["num_recv_tokens"][:, -1].sum() == 4000  # and it plans


@pytest.mark.parametrize("grid, message", [
    (0, r"grid = 0 must be in \[1, 2\*\*40\]"),
    (-64, r"grid = -64 must be in"),
    (2**40 + 1, r"grid = 1099511627777 must be in"),
    (6.4, r"grid must be an integer in \[1, 2\*\*40\], not 6.4"),
    (True, r"grid must be an integer"),
    ("64", r"grid must be an integer"),
])
def test_a_bad_grid_raises_naming_it(grid, message):
    batch = cpdispatch.batch_from_cu_seqlens([0, 37, 1830, 1900, 3900, 4000], 4)
    with pytest.raises(ValueError, match=message):
        cpdispatch.balance(batch, grid=grid)


def test_a_bad_grid_key_is_named_by_the_reader():
    batch = cpdispatch.batch_from_cu_seqlens([0, 37, 1830, 1900, 3900, 4000], 4)
    with pytest.raises(ValueError, match=r"grid = 0 must be at least 1"):
        cpdispatch.balance(dict(batch, grid=0))
