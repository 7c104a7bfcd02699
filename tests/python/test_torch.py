"""cpdispatch.torch on 1, 2 and 4 processes (gloo): ContextParallelAttention
equals unsharded attention over whole documents, forward and backward
(float64), with documents spanning ranks, for every mask, with and without
the deduplicated KV exchange."""

import json
import os

import pytest

from conftest import require

torch = require("torch")
require("cpdispatch")  # what the workers import: a skip where it is missing, an error under CPDISPATCH_REQUIRE_TORCH=1

MASKS = [{"type": "causal"}, {"type": "full"}, {"type": "sliding_window", "window": 3}]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Per world size, every rank's result of every case, run once."""
    import torch.multiprocessing as mp

    import torch_worker

    cache = {}

    def run(world):
        if world not in cache:
            tmp = tmp_path_factory.mktemp(f"world{world}")
            # fork: the workers share the imported torch instead of importing it again (seconds each)
            mp.start_processes(torch_worker.run, args=(world, str(tmp / "init"), MASKS, str(tmp)), nprocs=world, join=True, start_method="fork")
            cache[world] = [json.load(open(tmp / f"rank{r}.json")) for r in range(world)]
        return cache[world]

    return run


@pytest.mark.parametrize("mask", MASKS, ids=[m["type"] for m in MASKS])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_attention_equals_unsharded(outcomes, world, mask):
    results = outcomes(world)
    cases = [c for c in results[0] if c.split()[1] == mask["type"]]
    assert len(cases) == 6  # three plan forms, dedup off and on
    failures = {f"rank {r}: {c}": res[c] for r, res in enumerate(results) for c in cases if res[c] != "ok"}
    assert not failures, "\n".join(f"{c}\n{t}" for c, t in failures.items())


def needed_range(mask, starts, ends, i):
    """Section 2d: the KV shards lo..hi that query shard i needs."""
    if mask["type"] == "full":
        return 0, len(starts) - 1
    if mask["type"] == "causal":
        return 0, i
    lo = next(k for k in range(i + 1) if ends[k] >= starts[i] - mask["window"] + 2)
    return lo, i


@pytest.mark.parametrize("mask", MASKS + [{"type": "sliding_window", "window": 1}, {"type": "sliding_window", "window": 7}],
                         ids=["causal", "full", "window3", "window1", "window7"])
def test_varlen_attention_applies_the_plans_mask_bottom_right(mask):
    # Every query shard of a document against its KV group (section 2d's
    # lo..hi, back to back) in one varlen batch equals attention by document
    # positions: the kernel-side mask is bottom-right aligned.
    from cpdispatch.torch import varlen_attention

    import torch_worker

    gen = torch.Generator().manual_seed(5)
    lens = [3, 1, 4, 2, 5]
    starts = [sum(lens[:k]) for k in range(len(lens))]
    ends = [s + n for s, n in zip(starts, lens)]
    q, k, v = (torch.randn(sum(lens), 2, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    qs, ks, vs, cu_q, cu_kv = [], [], [], [0], [0]
    for i in reversed(range(len(lens))):  # entries in any order: each stands alone
        lo, hi = needed_range(mask, starts, ends, i)
        qs.append(q[starts[i]:ends[i]])
        ks.append(k[starts[lo]:ends[hi]])
        vs.append(v[starts[lo]:ends[hi]])
        cu_q.append(cu_q[-1] + lens[i])
        cu_kv.append(cu_kv[-1] + ends[hi] - starts[lo])
    got = varlen_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), torch.tensor(cu_q, dtype=torch.int32),
                           torch.tensor(cu_kv, dtype=torch.int32), max(lens), None, mask, softmax_scale=4 ** -0.5)
    want = torch_worker.reference(q, k, v, mask)
    expected = torch.cat([want[starts[i]:ends[i]] for i in reversed(range(len(lens)))])
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
