"""ContextParallelAttention(stages=S) on 1 to 4 processes (gloo): 1 to 3
stages, the blockwise kernel and the stand-ins of flash-attention's and
PyTorch's sdpa kernels, equal unsharded attention over whole documents
(float64), forward and gradients, every mask, dedup off and on, plans
from batch_from_cu_seqlens in both forms and a random plan; stages = 1 gives
the same bytes run to run; the staged runs really split query shards into
parts that merge by log-sum-exp."""

import json

import pytest

from conftest import require

torch = require("torch")
require("cpdispatch")  # what the workers import: a skip where it is missing, an error under CPDISPATCH_REQUIRE_TORCH=1

WORLDS = [1, 2, 3, 4]
PLANS, MASKS, DEDUP, RUNS = 3, 3, 2, 7  # six kernel runs and the bitwise check per plan, mask and dedup


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Per world size, every rank's results, run once."""
    import torch.multiprocessing as mp

    import stages_worker

    cache = {}

    def run(world):
        if world not in cache:
            tmp = tmp_path_factory.mktemp(f"stages{world}")
            # fork: the workers share the imported torch instead of importing it again (seconds each)
            mp.start_processes(stages_worker.run, args=(world, str(tmp / "init"), str(tmp)), nprocs=world, join=True, start_method="fork")
            cache[world] = [json.load(open(tmp / f"rank{r}.json")) for r in range(world)]
        return cache[world]

    return run


@pytest.mark.parametrize("world", WORLDS)
def test_every_stage_count_and_kernel_equals_unsharded_attention(outcomes, world):
    results = outcomes(world)
    for rank in results:
        assert len(rank) == PLANS * MASKS * DEDUP * RUNS
    failures = {f"rank {r}: {case}": res["error"] for r, rank in enumerate(results) for case, res in rank.items() if "error" in res}
    assert not failures, "\n".join(f"{case}\n{error}" for case, error in failures.items())


@pytest.mark.parametrize("world", [2, 3, 4])
def test_stages_split_query_shards_into_parts_merged_by_lse(outcomes, world):
    # Without this the staged runs could pass by never merging anything: the
    # staged forward makes one kernel call per pass of the staging plan
    # (none with one stage), and on the random plan, for every mask and
    # kernel, some query shard's keys arrive in several rounds.
    split = {}
    for rank in outcomes(world):
        for case, res in rank.items():
            fields = case.split(" ")
            if len(fields) == 5:
                plan, mask, _, kernel, stages = fields
                if kernel == "blockwise":
                    assert res["calls"] == (res["passes"] if stages != "stages=1" else 0), (case, res)
                if stages != "stages=1":
                    split[plan, mask, kernel] = split.get((plan, mask, kernel), 0) + res["split"]
    assert len(split) == PLANS * MASKS * 2
    assert all(n > 0 for (plan, _, _), n in split.items() if plan == "random"), split
