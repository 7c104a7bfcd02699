"""max_memory: every call that reads, plans or balances refuses, before
allocating it, work beyond its budget (PlanLimits::max_bytes), and refuses a
budget that is not a positive int."""

import json
import re

import pytest

from conftest import require

np = require("numpy")
cpdispatch = require("cpdispatch")

# A hundred bytes naming a billion ranks: its dense metadata would take far
# more memory than any node has.
HUGE_WORLD = 1_000_000_000
HOSTILE_PLAN = {"world_size": HUGE_WORLD, "documents": [{"shards": [{"rank": 0, "len": 4, "dst": 0}]}]}
HOSTILE_BATCH = {"world_size": HUGE_WORLD, "max_cp_degree": 2, "documents": [{"pieces": [{"rank": 0, "len": 8}]}]}

SMALL_PLAN = {"world_size": 2, "ranks": [{"docs": [{"shard_len": [4, 2], "dst": [1, 0]}]}, {"docs": [{"shard_len": [5], "dst": [1]}]}]}
SMALL_BATCH = {"world_size": 2, "max_cp_degree": 2, "ranks": [{"docs": [8]}, {"docs": [2]}]}
ENOUGH = 1 << 16
TINY = 1024

# Each entry point with its input: (name, call(input, **kw)).
PLANNING = [
    ("plan", lambda p, **kw: cpdispatch.plan(p, **kw)),
    ("plan_dedup", lambda p, **kw: cpdispatch.plan(p, dedup=True, **kw)),
    ("plan_for_rank", lambda p, **kw: cpdispatch.plan_for_rank(p, 0, **kw)),
    ("plan_for_rank_dedup", lambda p, **kw: cpdispatch.plan_for_rank(p, 0, dedup=True, **kw)),
    ("token_indices", lambda p, **kw: cpdispatch.token_indices(p, 0, **kw)),
    ("read_once", lambda p, **kw: cpdispatch.plan(cpdispatch.Plan(p), **kw)),
]
IDS = [name for name, _ in PLANNING]


def over_budget(budget, *sizes):
    """The library's message: the plan's sizes, then the budget in bytes."""
    sizes = ".*".join(re.escape(s) for s in sizes)
    return f"{sizes}.* more than the limit of .*\\({budget} bytes\\) \\(max_memory\\)"


@pytest.mark.parametrize("call", [c for _, c in PLANNING], ids=IDS)
@pytest.mark.parametrize("budget", [None, 1 << 20], ids=["default", "explicit"])
@pytest.mark.parametrize("as_text", [False, True], ids=["dict", "text"])
def test_a_huge_world_is_refused_under_the_budget(call, budget, as_text):
    plan = json.dumps(HOSTILE_PLAN) if as_text else HOSTILE_PLAN
    kw = {} if budget is None else {"max_memory": budget}
    with pytest.raises(ValueError, match=over_budget(budget or cpdispatch.DEFAULT_MAX_MEMORY, f"world_size = {HUGE_WORLD}")):
        call(plan, **kw)


@pytest.mark.parametrize("budget", [None, 1 << 20], ids=["default", "explicit"])
def test_a_balance_input_with_a_huge_world_is_refused(budget):
    kw = {} if budget is None else {"max_memory": budget}
    with pytest.raises(ValueError, match=over_budget(budget or cpdispatch.DEFAULT_MAX_MEMORY, f"world_size = {HUGE_WORLD}")):
        cpdispatch.balance(HOSTILE_BATCH, **kw)


@pytest.mark.parametrize("call", [c for _, c in PLANNING], ids=IDS)
def test_a_small_plan_plans_within_a_small_budget_and_not_within_a_tiny_one(call):
    expected = call(SMALL_PLAN)
    within = call(SMALL_PLAN, max_memory=ENOUGH)
    assert json.dumps(within, default=lambda a: a.tolist()) == json.dumps(expected, default=lambda a: a.tolist())
    with pytest.raises(ValueError, match=over_budget(TINY, "world_size = 2")):
        call(SMALL_PLAN, max_memory=TINY)


def test_json_text_beyond_the_budget_is_refused_before_it_is_parsed():
    text = json.dumps(SMALL_PLAN)
    assert cpdispatch.Plan(text, max_memory=ENOUGH).world_size == 2
    with pytest.raises(ValueError, match=over_budget(TINY, f"a document of {len(text)} bytes")):
        cpdispatch.Plan(text, max_memory=TINY)
    with pytest.raises(ValueError, match=over_budget(TINY, f"a document of {len(json.dumps(SMALL_BATCH))} bytes")):
        cpdispatch.balance(json.dumps(SMALL_BATCH), max_memory=TINY)


def test_a_small_batch_balances_within_a_small_budget():
    assert cpdispatch.balance(SMALL_BATCH, max_memory=ENOUGH) == cpdispatch.balance(SMALL_BATCH)


def test_a_numpy_integer_is_a_budget():
    assert cpdispatch.plan(SMALL_PLAN, max_memory=np.int64(ENOUGH))["q_fwd"]["world_size"] == 2


ALL_CALLS = PLANNING + [("balance", lambda p, **kw: cpdispatch.balance(SMALL_BATCH, **kw)),
                        ("Plan", lambda p, **kw: cpdispatch.Plan(p, **kw))]
BAD = [(0, ValueError), (-1, ValueError), (-(1 << 70), ValueError), (1.5, TypeError), ("1G", TypeError), (True, TypeError),
       (None, TypeError)]


@pytest.mark.parametrize("call", [c for _, c in ALL_CALLS], ids=[name for name, _ in ALL_CALLS])
@pytest.mark.parametrize("bad,error", BAD, ids=[repr(b) for b, _ in BAD])
def test_a_bad_budget_is_refused_naming_max_memory(call, bad, error):
    with pytest.raises(error, match="max_memory"):
        call(SMALL_PLAN, max_memory=bad)


def test_max_memory_is_keyword_only():
    with pytest.raises(TypeError):
        cpdispatch.plan(SMALL_PLAN, False, ENOUGH)


def test_rank_dispatch_plans_within_its_budget():
    require("torch")
    from cpdispatch.torch import RankDispatch

    assert RankDispatch(SMALL_PLAN, rank=1, max_memory=ENOUGH).rank == 1
    with pytest.raises(ValueError, match=over_budget(TINY, "world_size = 2")):
        RankDispatch(SMALL_PLAN, rank=1, max_memory=TINY)
