"""One rank of the torch.distributed tests: context-parallel attention over
gloo against unsharded attention over whole documents (float64), forward and
backward, for every plan form, mask and dedup setting it is given."""

import json
import os
import random
import traceback

import torch
import torch.distributed as dist

import cpdispatch
from cpdispatch.torch import ContextParallelAttention, RankDispatch

from plans import documents_plan, rank_plan
from workers import documents_of, local_rows

HEADS, DIM = 2, 4


def test_plans(world):
    """Plans for `world` ranks: documents spanning ranks (random and balanced) and the per-rank form."""
    rng = random.Random(1000 + world)
    plans = [("documents", documents_plan(rng, max_world=world)), ("ranks", rank_plan(rng, max_world=world))]
    for _, plan in plans:  # max_world is an upper bound; these tests need exactly `world`
        plan["world_size"] = world
        if "ranks" in plan:
            plan["ranks"] = (plan["ranks"] + [{"docs": []}] * world)[:world]
            for r in plan["ranks"]:
                for doc in r["docs"]:
                    doc["dst"] = [d % world for d in doc["dst"]]
        else:
            for doc in plan["documents"]:
                for s in doc["shards"]:
                    s["rank"] %= world
                    s["dst"] %= world
    batch = {"world_size": world, "max_cp_degree": 3, "documents": [
        {"pieces": [{"rank": r, "len": 9}, {"rank": (r + 1) % world, "len": 4}]} if world > 1 else {"pieces": [{"rank": 0, "len": 13}]}
        for r in range(world)] + [{"pieces": [{"rank": world - 1, "len": 5}]}]}
    plans.append(("balanced", cpdispatch.balance(batch)))
    return plans


def sees(mask, p, t):
    """Whether the query at document position p sees the key at t (section 2d's table)."""
    if mask["type"] == "full":
        return torch.ones_like(p * t, dtype=torch.bool)
    allowed = t <= p
    if mask["type"] == "sliding_window":
        allowed &= t > p - mask["window"]
    return allowed


def reference(q, k, v, mask):
    """Unsharded attention over one whole document, by positions."""
    pos = torch.arange(q.shape[0])
    scores = torch.einsum("qhd,khd->hqk", q, k) * DIM ** -0.5
    scores = scores.masked_fill(~sees(mask, pos[:, None], pos[None, :]), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)


def check_case(plan, mask, dedup, rank, seed):
    plan = dict(plan, mask=mask) if mask["type"] != "causal" else plan
    generator = torch.Generator().manual_seed(seed)
    docs = documents_of(plan)

    def draw(n):
        return torch.randn(n, HEADS, DIM, generator=generator, dtype=torch.float64)

    lengths = [sum(n for _, n in shards) for shards in docs]
    q, k, v, w = ([draw(n).requires_grad_(i < 3) for n in lengths] for i in range(4))
    expected = [reference(q[d], k[d], v[d], mask) for d in range(len(docs))]
    sum((e * w[d]).sum() for d, e in enumerate(expected)).backward() if docs else None

    rows = local_rows(plan, rank)
    assert cpdispatch.position_ids(plan, rank).tolist() == [start + i for _, start, n in rows for i in range(n)]

    def mine(parts):
        return torch.cat([parts[d][s:s + n] for d, s, n in rows]) if rows else torch.zeros(0, HEADS, DIM, dtype=torch.float64)

    lq, lk, lv = (mine([t.detach() for t in parts]).requires_grad_() for parts in (q, k, v))
    dispatch = RankDispatch(plan, dedup=dedup)
    assert dispatch.dedup == dedup and dispatch.mask == mask
    out = ContextParallelAttention(softmax_scale=DIM ** -0.5)(lq, lk, lv, dispatch)
    (out * mine(w)).sum().backward()
    tight = dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out, mine([e.detach() for e in expected]), **tight)
    for got, parts, name in ((lq, q, "q"), (lk, k, "k"), (lv, v, "v")):
        want = mine([p.grad if p.grad is not None else torch.zeros_like(p) for p in parts])
        torch.testing.assert_close(got.grad, want, **tight, msg=lambda m, name=name: f"grad of {name}: {m}")


def run(rank, world, init_file, masks, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    try:
        for name, plan in test_plans(world):
            for mask in masks:
                for dedup in (False, True):
                    case = f"{name} {mask['type']} dedup={dedup}"
                    try:
                        check_case(plan, mask, dedup, rank, seed=len(results))
                        results[case] = "ok"
                    except Exception:  # every case reports, none stops the others (collectives stay matched: same calls on every rank)
                        results[case] = traceback.format_exc()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()
