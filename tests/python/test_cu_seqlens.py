"""cpdispatch.batch_from_cu_seqlens: balance's input from one packed
sequence's cu_seqlens cut evenly over the ranks, or from every rank's own;
from lists, NumPy arrays and integer tensors; its errors; and that balance
takes the result and its plan plans."""

import pytest

from conftest import require

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
