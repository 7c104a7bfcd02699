"""One rank of the invariant-mode tests (gloo): ContextParallelAttention(
invariant=True) on one packed batch (the same documents and values at every
world size, cut evenly over the ranks on the grid), balanced and random
placements, every mask, dedup off and on, 1 to 3 stages and kernel threads,
float32 and bfloat16. Each case writes this rank's out, dq, dk and dv as
their bytes (hex); test_invariant.py compares them across world sizes."""

import random

import torch

import cpdispatch
import slice_masks
import workers
from cpdispatch.torch import BlockwiseKernel, ContextParallelAttention, RankDispatch

TOKENS, GRID = 96, 8  # every world size of WORLDS cuts TOKENS evenly on the grid
HEADS, HEADS_KV, DIM = 4, 2, 8
SCALE = DIM ** -0.5
CU_SEQLENS = [0, 20, 57, 96]  # documents spanning ranks at W = 2, 3, 4
MASKS = [{"type": "causal"}, {"type": "full"}, {"type": "sliding_window", "window": 11}]
# Documents whose masks are slices (a shared prefix, a prefix-LM) and a causal one, over the same TOKENS.
SLICE_DOCS = [slice_masks.shared_prefix(10, [12, 9, 7]), slice_masks.prefix_lm(6, 19), (33, None)]


def slice_entries():
    """The slice documents' attention entries over the packed batch (q_start, q_len, kv_start, kv_len, lo, hi)."""
    entries, start = [], 0
    for length, slices in SLICE_DOCS:
        for s in slices or [{"q": [0, length], "k": [0, length], "type": "causal"}]:
            (qa, qb), (ka, kb) = s["q"], s["k"]
            entries.append((start + qa, qb - qa, start + ka, kb - ka) + slice_masks.band(s))
        start += length
    return entries


def inputs(dtype=torch.float32):
    """The batch's q, k, v and output-gradient weights, [TOKENS, heads, DIM], the same at every world size."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(HEADS, DIM), (HEADS_KV, DIM), (HEADS_KV, DIM), (HEADS, DIM)]
    return [torch.randn(TOKENS, *shape, generator=gen).to(dtype) for shape in shapes]


def plan_of(world, mask, placement, seed):
    """A plan balanced on the grid, or the same cuts with every shard attended
    on a random rank; mask None: the slice documents."""
    if mask is None:
        plan = cpdispatch.balance(slice_masks.packed_batch(SLICE_DOCS, world), grid=GRID)
    else:
        plan = dict(cpdispatch.balance(cpdispatch.batch_from_cu_seqlens(CU_SEQLENS, world), mask=mask, grid=GRID), mask=mask)
    if placement == "random":
        rng = random.Random(seed)
        for doc in plan["documents"]:
            for shard in doc["shards"]:
                shard["dst"] = rng.randrange(world)
    return plan


def attend(plan, rank, world, dedup, stages, threads, dtype):
    """This rank's rows of out, dq, dk and dv, as hex bytes."""
    rows = slice(rank * TOKENS // world, (rank + 1) * TOKENS // world)
    q, k, v, w = (x[rows] for x in inputs(dtype))
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    op = ContextParallelAttention(softmax_scale=SCALE, kernel=BlockwiseKernel(threads=threads), stages=stages, invariant=True, grid=GRID)
    out = op(q, k, v, RankDispatch(plan, dedup=dedup))
    (out.float() * w.float()).sum().backward()
    return {name: _hex(x) for name, x in zip(("out", "dq", "dk", "dv"), (out.detach(), q.grad, k.grad, v.grad))}


def _hex(x):
    x = x.contiguous()
    return (x.view(torch.int16) if x.dtype == torch.bfloat16 else x).numpy().tobytes().hex()


def off_grid(world):
    """One document over the batch, its MLP layout cut evenly and once more at
    packed position 45, off the grid: every rank must refuse it."""
    per_rank, shards = TOKENS // world, []
    for r in range(world):
        a, b = r * per_rank, (r + 1) * per_rank
        cuts = [a] + ([45] if a < 45 < b else []) + [b]
        shards += [{"rank": r, "len": y - x, "dst": (len(shards) + i) % world} for i, (x, y) in enumerate(zip(cuts, cuts[1:]))]
    plan = {"kind": "qkv", "world_size": world, "documents": [{"shards": shards}], "mask": {"type": "causal"}}
    try:
        ContextParallelAttention(invariant=True, grid=GRID)(*inputs()[:3], RankDispatch(plan))
    except ValueError as e:
        return {"refused": str(e)}
    return {"refused": None}


def cases(world):
    out = []
    for m, mask in enumerate(MASKS):
        for placement in ("balanced", "random"):
            for dedup in (False, True):
                name = f"{placement} {mask['type']} dedup={dedup}"
                stages, threads = 1 + len(out) % 3, 1 + (len(out) // 3) % 3
                out.append((name, lambda rank, seed, mask=mask, placement=placement, dedup=dedup, stages=stages, threads=threads:
                            attend(plan_of(world, mask, placement, 11 * world + seed), rank, world, dedup, stages, threads, torch.float32)))
    out.append(("balanced causal bfloat16", lambda rank, seed: attend(plan_of(world, MASKS[0], "balanced", 0), rank, world, False, 2, 2,
                                                                     torch.bfloat16)))
    for placement in ("balanced", "random"):
        out.append((f"{placement} slices dedup={placement == 'random'}",
                    lambda rank, seed, placement=placement: attend(plan_of(world, None, placement, 7 * world + seed), rank, world,
                                                                   placement == "random", 1, 2, torch.float32)))
    out.append(("off grid", lambda rank, seed: off_grid(world)))
    return out


def run(rank, world, init_file, out_dir):
    workers.run_cases(rank, world, init_file, out_dir, cases(world))
