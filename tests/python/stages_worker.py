"""One rank of the staged-attention tests (gloo): ContextParallelAttention
with 1 to 3 stages and each kernel adapter against unsharded attention over
whole documents (float64), forward and gradients, on plans balanced from
cu_seqlens (one packed sequence, and per-rank) and a random plan whose
shards attend anywhere, for every mask, dedup off and on, grouped-query
attention with a value dimension of its own."""

import json
import os
import random
import traceback

import torch
import torch.distributed as dist

import cpdispatch
import kernel_fakes
from cpdispatch.torch import BlockwiseKernel, ContextParallelAttention, RankDispatch

HEADS, HEADS_KV, DIM, DIM_V = 4, 2, 4, 3
SCALE = DIM ** -0.5
MASKS = [{"type": "causal"}, {"type": "full"}, {"type": "sliding_window", "window": 3}]
TOKENS = 12  # per rank
SHAPES = [(HEADS, DIM), (HEADS_KV, DIM), (HEADS_KV, DIM_V), (HEADS, DIM_V)]  # q, k, v and the output's gradient weights


class CountingKernel(BlockwiseKernel):
    """The blockwise adapter, counting the calls of its staged forward (one per pass)."""

    calls = 0

    def forward(self, *args, **kwargs):
        CountingKernel.calls += 1
        return super().forward(*args, **kwargs)


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


def documents_of(plan):
    """Per document, its shards in order as (home rank, length)."""
    if "documents" in plan:
        return [[(s["rank"], s["len"]) for s in doc["shards"]] for doc in plan["documents"]]
    return [[(r, n) for n in doc["shard_len"]] for r, rank in enumerate(plan["ranks"]) for doc in rank["docs"]]


def local_rows(plan, rank):
    """(document, start, length) of rank's MLP layout: documents in order, shards in order."""
    rows = []
    for d, shards in enumerate(documents_of(plan)):
        start = 0
        for home, n in shards:
            if home == rank:
                rows.append((d, start, n))
            start += n
    return rows


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
    gen = torch.Generator().manual_seed(seed)
    lengths = [sum(n for _, n in shards) for shards in documents_of(plan)]
    q, k, v, w = ([torch.randn(n, *shape, generator=gen, dtype=torch.float64).requires_grad_(i < 3) for n in lengths]
                  for i, shape in enumerate(SHAPES))
    outs = [reference(*x, mask) for x in zip(q, k, v)]
    if outs:
        sum((o * wd).sum() for o, wd in zip(outs, w)).backward()
    grads = [[x.grad if x.grad is not None else torch.zeros_like(x) for x in xs] for xs in (q, k, v)]
    return (q, k, v, w), [o.detach() for o in outs], grads


def mine(parts, rows, shape):
    return torch.cat([parts[d][s:s + n] for d, s, n in rows]) if rows else torch.zeros((0,) + shape, dtype=torch.float64)


def attend(plan, dedup, stages, kernel, inputs, rows):
    """This rank's output and the gradients of q, k and v through ContextParallelAttention."""
    q, k, v, w = (mine([x.detach() for x in xs], rows, shape) for xs, shape in zip(inputs, SHAPES))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    dispatch = RankDispatch(plan, dedup=dedup)
    out = ContextParallelAttention(softmax_scale=SCALE, kernel=kernel, stages=stages)(q, k, v, dispatch)
    (out * w).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad], dispatch


def check_case(plan, mask, dedup, stages, kernel, rank, seed):
    """Compares with unsharded attention. Returns how many query shards the
    stages split into parts merged by lse, how many passes the staging plan
    has and how many calls the counting kernel's forward got."""
    inputs, outs, grads = expected(plan, mask, seed)
    rows = local_rows(plan, rank)
    calls = CountingKernel.calls
    got, dispatch = attend(plan, dedup, stages, kernel, inputs, rows)
    calls = CountingKernel.calls - calls
    want = [mine(outs, rows, (HEADS, DIM_V))] + [mine(g, rows, shape) for g, shape in zip(grads, SHAPES)]
    for name, g, x in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(g).all(), f"{name} has a NaN or infinity"
        torch.testing.assert_close(g, x, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")
    passes = [parts for round_passes in getattr(dispatch.staging(stages), "passes", []) for parts in round_passes]
    shards = [part[0] for parts in passes for part in parts]
    return {"split": sum(shards.count(q0) > 1 for q0 in set(shards)), "passes": len(passes), "calls": calls}


def bitwise_twice(plan, dedup, rank, seed):
    """stages = 1 run twice on the same inputs gives the same bytes."""
    inputs, _, _ = expected(plan, plan.get("mask", {"type": "causal"}), seed)
    rows = local_rows(plan, rank)
    first, _ = attend(plan, dedup, 1, "blockwise", inputs, rows)
    second, _ = attend(plan, dedup, 1, "blockwise", inputs, rows)
    for name, a, b in zip(("out", "dq", "dk", "dv"), first, second):
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), f"{name} differs between two runs"


def kernels():
    """(name, kernel, stages) runs: the blockwise adapter at 1 to 3 stages, flash-attention's stand-in at 1 and 3, sdpa's at 1."""
    runs = [("blockwise", CountingKernel(), s) for s in (1, 2, 3)]
    return runs + [("flash_attn_varlen", "flash_attn_varlen", 1), ("flash_attn_varlen", "flash_attn_varlen", 3), ("sdpa", "sdpa", 1)]


def run(rank, world, init_file, out_dir):
    torch.set_num_threads(1)  # the ranks share two cores with the rest of the tests
    kernel_fakes.install_flash()
    kernel_fakes.install_sdpa()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    try:
        for name, batch in plans(world):
            for mask in MASKS:
                plan = with_mask(batch, mask)
                for dedup in (False, True):
                    for kernel_name, kernel, stages in kernels():
                        case = f"{name} {mask['type']} dedup={dedup} {kernel_name} stages={stages}"
                        try:
                            results[case] = check_case(plan, mask, dedup, stages, kernel, rank, seed=len(results))
                        except Exception:  # every case reports; the collectives stay matched (the same calls on every rank)
                            results[case] = {"error": traceback.format_exc()}
                    case = f"{name} {mask['type']} dedup={dedup} bitwise"
                    try:
                        bitwise_twice(plan, dedup, rank, seed=len(results))
                        results[case] = {}
                    except Exception:
                        results[case] = {"error": traceback.format_exc()}
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()
