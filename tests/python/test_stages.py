"""ContextParallelAttention(stages=S) on 1 to 4 processes (gloo): 1 to 3
stages, the blockwise kernel and the stand-ins of flash-attention's and
PyTorch's sdpa kernels, equal unsharded attention over whole documents
(float64), forward and gradients, every mask, dedup off and on, plans
from batch_from_cu_seqlens in both forms and a random plan; stages = 1 gives
the same bytes run to run; the staged runs really split query shards into
parts that merge by log-sum-exp."""

import pytest

from conftest import require

torch = require("torch")
require("cpdispatch")  # what the workers import: a skip where it is missing, an error under CPDISPATCH_REQUIRE_TORCH=1

import workers  # after the requires: it imports torch and cpdispatch

WORLDS = [1, 2, 3, 4]
PLANS, MASKS, DEDUP, RUNS = 3, 3, 2, 7  # six kernel runs and the bitwise check per plan, mask and dedup


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Per world size, every rank's results, run once."""
    import stages_worker
    return workers.outcomes(tmp_path_factory, stages_worker.run, "stages")


@pytest.mark.parametrize("world", WORLDS)
def test_every_stage_count_and_kernel_equals_unsharded_attention(outcomes, world):
    results = outcomes(world)
    for rank in results:
        assert len(rank) == PLANS * MASKS * DEDUP * RUNS
    failures = workers.errors(results)
    assert not failures, workers.report(failures)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_stages_split_query_shards_into_parts_merged_by_lse(outcomes, world):
    # Without this the staged runs could pass by never merging anything: the
    # staged forward makes one kernel call per pass of the staging plan
    # (none with one stage), and on the random plan, for every mask and
    # kernel, some query shard's keys arrive in several rounds.
    split = workers.split_parts(outcomes(world), lambda words: (words[0], words[1], words[3]))
    assert len(split) == PLANS * MASKS * 2
    assert all(n > 0 for (plan, _, _), n in split.items() if plan == "random"), split
