"""One rank of the staged-attention tests (gloo): ContextParallelAttention
with 1 to 3 stages and each kernel adapter against unsharded attention over
whole documents (float64), forward and gradients, on plans balanced from
cu_seqlens (one packed sequence, and per-rank) and a random plan whose
shards attend anywhere, for every mask, dedup off and on, grouped-query
attention with a value dimension of its own (workers.py)."""

import functools
import random

import torch

import cpdispatch
import workers
from cpdispatch.torch import RankDispatch
from workers import HEADS, HEADS_KV, SCALE, documents_of, local_rows

MASKS = [{"type": "causal"}, {"type": "full"}, {"type": "sliding_window", "window": 3}]
TOKENS = 12  # per rank


def plans(world):
    """(name, plan without mask, batch or None) for `world` ranks."""
    rng = random.Random(world)
    cuts = sorted(rng.sample(range(1, TOKENS * world), min(TOKENS * world - 1, world + 1)))
    packed = cpdispatch.batch_from_cu_seqlens([0] + cuts + [TOKENS * world], world)
    per_rank = cpdispatch.batch_from_cu_seqlens([[0] + sorted(rng.sample(range(1, TOKENS), 2)) + [TOKENS] for _ in range(world)])
    return [("packed", packed), ("per_rank", per_rank), ("random", random_plan(rng, world))]


def random_plan(rng, world):
    """Documents packed over consecutive ranks whose shards attend on random ranks."""
    docs = []
    for _ in range(world + 1):
        home = rng.randrange(world)
        shards = []
        for _ in range(rng.randint(2, 4)):
            home = min(world - 1, home + rng.randint(0, 1))
            shards.append({"rank": home, "len": rng.randint(1, 5), "dst": rng.randrange(world)})
        docs.append({"shards": shards})
    return {"kind": "qkv", "world_size": world, "documents": docs}


def with_mask(plan, mask):
    """The plan under `mask`: a batch balanced for it, or the plan with it."""
    if "kind" in plan:
        return dict(plan, mask=mask)
    return dict(cpdispatch.balance(plan, mask=mask), mask=mask)


def reference(q, k, v, mask):
    """Unsharded attention over one whole document, by positions (section 2d)."""
    p, t = torch.arange(q.shape[0])[:, None], torch.arange(q.shape[0])[None, :]
    seen = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool) if mask["type"] == "full" else t <= p
    if mask["type"] == "sliding_window":
        seen &= t > p - mask["window"]
    groups = HEADS // HEADS_KV
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(groups, 1)) * SCALE
    return torch.einsum("hqk,khd->qhd", torch.softmax(s.masked_fill(~seen, float("-inf")), -1), v.repeat_interleave(groups, 1))


def expected(plan, mask, seed):
    """The documents' inputs, output-gradient weights, outputs and gradients."""
    lengths = [sum(n for _, n in shards) for shards in documents_of(plan)]
    return workers.expected(lengths, lambda d, q, k, v: reference(q, k, v, mask), seed)


def check_case(plan, mask, dedup, stages, kernel, rank, seed):
    """Against unsharded attention: workers.check_case's counts."""
    return workers.check_case(RankDispatch(plan, dedup=dedup), kernel, stages, expected(plan, mask, seed), local_rows(plan, rank))


def bitwise_twice(plan, dedup, rank, seed):
    """stages = 1 run twice on the same inputs gives the same bytes."""
    inputs, _, _ = expected(plan, plan.get("mask", {"type": "causal"}), seed)
    workers.bitwise_twice(lambda: RankDispatch(plan, dedup=dedup), inputs, local_rows(plan, rank))


def cases(world):
    """(name, case(rank, seed)) of every plan, mask, dedup and kernel run, and the bitwise check."""
    for name, batch in plans(world):
        for mask in MASKS:
            plan = with_mask(batch, mask)
            for dedup in (False, True):
                for kernel_name, kernel, stages in workers.kernels():
                    yield f"{name} {mask['type']} dedup={dedup} {kernel_name} stages={stages}", functools.partial(
                        check_case, plan, mask, dedup, stages, kernel)
                yield f"{name} {mask['type']} dedup={dedup} bitwise", functools.partial(bitwise_twice, plan, dedup)


def run(rank, world, init_file, out_dir):
    workers.run_cases(rank, world, init_file, out_dir, cases(world))
