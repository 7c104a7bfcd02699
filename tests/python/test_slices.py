"""Plans whose documents carry slices (docs/plan-format.md section 2e) in
ContextParallelAttention, on 1 to 4 processes (gloo, slices_worker.py):
equal to unsharded float64 attention under each document's slice mask
(shared prefix with responses, block causal, prefix-LM, inverse and
bi-causal, rows no slice covers, plain causal documents beside them),
forward and gradients, 1 to 3 stages, the blockwise, flash-attention and
sdpa kernels (stand-ins for the last two), dedup off and on, GQA.

Which tests need the C++ slice planning (section 2e in the module):
test_slice_plans_equal_unsharded_slice_attention, test_worked_example_entries,
test_a_plan_with_slices_needs_a_kernel_that_takes_entries and
test_slice_plans_and_balance_equal_cli; the worker's balanced plan needs
cpdispatch.balance to take slices, in both modes. The other tests ("given"
entries over a full-mask layout, derived by the test) run without it."""

import random

import pytest

from conftest import require

torch = require("torch")
cpdispatch = require("cpdispatch")

import workers  # after the requires: it imports torch and cpdispatch

WORLDS = [1, 2, 3, 4]
CASES_PER_MODE = 3 * 2 * 7  # plans, dedup, six kernel runs and the bitwise check


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Per world size, every rank's results, run once."""
    import slices_worker
    return workers.outcomes(tmp_path_factory, slices_worker.run, "slices")


def failures(results, mode):
    cases = {case for rank in results for case in rank if case.startswith(mode + " ")}
    assert len(cases) == CASES_PER_MODE, sorted(cases)
    return workers.errors(results, lambda case: case.startswith(mode + " "))


@pytest.mark.parametrize("world", WORLDS)
def test_given_entries_equal_unsharded_slice_attention(outcomes, world):
    # No C++ slice planning needed: the entries come from the test.
    failed = failures(outcomes(world), "given")
    assert not failed, workers.report(failed)


@pytest.mark.parametrize("world", WORLDS)
def test_slice_plans_equal_unsharded_slice_attention(outcomes, world):
    # Needs the C++ slice planning: the entries come from the plan (attn.entries of each rank).
    failed = failures(outcomes(world), "planned")
    assert not failed, workers.report(failed)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_stages_cut_entries_into_parts(outcomes, world):
    # The staged runs really cut query shards' entries into parts in several
    # rounds (merged by lse), and the blockwise kernel is called once per pass.
    split = workers.split_parts(outcomes(world), lambda words: words[3] if words[0] == "given" else None)
    assert split and all(n > 0 for n in split.values()), split


# The worked example of section 2e: a shared-prefix document (prompt of 3,
# responses of 2 and 3) in shards of 3, 2, 3, and a plain causal document.
EXAMPLE = {"kind": "qkv", "world_size": 2, "documents": [
    {"shards": [{"rank": 0, "len": 3, "dst": 1}, {"rank": 0, "len": 2, "dst": 0}, {"rank": 1, "len": 3, "dst": 1}],
     "slices": [{"q": [0, 3], "k": [0, 3], "type": "causal"},
                {"q": [3, 5], "k": [0, 3], "type": "full"}, {"q": [3, 5], "k": [3, 5], "type": "causal"},
                {"q": [5, 8], "k": [0, 3], "type": "full"}, {"q": [5, 8], "k": [5, 8], "type": "causal"}]},
    {"shards": [{"rank": 1, "len": 2, "dst": 1}, {"rank": 1, "len": 2, "dst": 0}]}]}
EXAMPLE_ENTRIES = [[[[0, 2, 0, 3, None, None], [0, 2, 3, 5, None, 3]], [[0, 2, 0, 4, None, 2]]],
                   [[[0, 3, 0, 3, None, 0]], [[0, 3, 0, 3, None, None], [0, 3, 3, 6, None, 3]], [[0, 2, 0, 2, None, 0]]]]


def test_worked_example_entries():
    # Needs the C++ slice planning: the whole plan's attn.entries and each rank's.
    whole = cpdispatch.plan(EXAMPLE)
    assert [a.tolist() for a in whole["attn"]["seqlens_kv"]] == [[5, 4], [3, 6, 2]]
    assert whole["attn"]["entries"] == EXAMPLE_ENTRIES
    for rank in range(2):
        share = cpdispatch.plan_for_rank(EXAMPLE, rank)
        assert share["attn"]["entries"] == EXAMPLE_ENTRIES[rank], rank


def test_a_plan_with_slices_needs_a_kernel_that_takes_entries():
    # Needs the C++ slice planning. One rank, no process group: a kernel
    # called with cu_seqlens and one mask cannot apply slices; a callable
    # with an entries keyword (varlen_attention's) can.
    import functools

    from cpdispatch.torch import ContextParallelAttention, RankDispatch, varlen_attention

    plan = {"kind": "qkv", "world_size": 1, "documents": [
        {"shards": [{"rank": 0, "len": 3, "dst": 0}, {"rank": 0, "len": 4, "dst": 0}],
         "slices": [{"q": [0, 7], "k": [0, 3], "type": "full"}, {"q": [3, 7], "k": [3, 7], "type": "causal"}]}]}
    dispatch = RankDispatch(plan)
    assert dispatch.entries
    q, k, v = (torch.randn(7, 2, 4, dtype=torch.float64) for _ in range(3))
    with pytest.raises(ValueError, match="need a kernel that takes entries"):
        ContextParallelAttention(kernel=lambda *args: varlen_attention(*args))(q, k, v, dispatch)
    got = ContextParallelAttention(kernel=functools.partial(varlen_attention, block_q=2))(q, k, v, dispatch)
    want = ContextParallelAttention()(q, k, v, dispatch)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_slice_plans_and_balance_equal_cli(cli):
    # Needs the C++ slice planning: plan, plan_for_rank (dedup off and on)
    # and balance of documents with slices give what cpdispatch-plan writes,
    # attn.entries included; balance keeps each document's slices.
    from test_plan import as_json, run_cli

    import slice_masks
    import slices_worker

    for world in (2, 3):
        plan = slices_worker.slice_plan(random.Random(world), world)
        for dedup in ((), ("--dedup",)):
            result = as_json(cpdispatch.plan(plan, dedup=bool(dedup)))
            assert "entries" in result["attn"] and result == run_cli(cli, plan, *dedup)
            for rank in range(world):
                share = as_json(cpdispatch.plan_for_rank(plan, rank, dedup=bool(dedup)))
                assert share == run_cli(cli, plan, "--rank", str(rank), *dedup)
    length, slices = slice_masks.EXAMPLES["shared_prefix"]
    batch = {"world_size": 2, "max_cp_degree": 4, "documents": [
        {"pieces": [{"rank": 0, "len": length - 3}, {"rank": 1, "len": 3}], "slices": slices}, {"pieces": [{"rank": 1, "len": 10}]}]}
    balanced = cpdispatch.balance(batch)
    assert balanced == run_cli(cli, batch, "balance")
    assert balanced["documents"][0]["slices"] == slices and "slices" not in balanced["documents"][1]
    assert as_json(cpdispatch.plan(balanced)) == run_cli(cli, balanced)
