"""One rank of the slice-mask tests (gloo): ContextParallelAttention on plans
whose documents carry slices (docs/plan-format.md section 2e: shared prefix
with responses, block causal, prefix-LM, inverse and bi-causal bands, rows
no slice covers) mixed with plain causal documents, against unsharded
float64 attention whose mask is built from each document's slices; 1 to 3
stages, the blockwise kernel and the stand-ins of flash-attention's and
sdpa's, dedup off and on, grouped-query attention with a value dimension of
its own; stages = 1 twice gives the same bytes.

Two modes:

- "planned": the plan carries the slices; the planner gives each rank its
  attention entries (attn.entries), which RankDispatch applies. Needs the
  C++ slice planning (section 2e) in the module.
- "given": the same documents planned under the full mask (every query
  shard gets its whole document as its KV group); the test derives the
  entries of the slices over that layout itself (from where each query
  and key row landed, found by dispatching their positions) and sets
  RankDispatch.entries. Tests the op's use of entries without the planner.
"""

import json
import os
import random
import traceback

import torch
import torch.distributed as dist

import cpdispatch
import kernel_fakes
import slice_masks
from cpdispatch.torch import ContextParallelAttention, RankDispatch
from stages_worker import CountingKernel, documents_of, local_rows, mine

HEADS, HEADS_KV, DIM, DIM_V = 4, 2, 4, 3
SCALE = DIM ** -0.5
SHAPES = [(HEADS, DIM), (HEADS_KV, DIM), (HEADS_KV, DIM_V), (HEADS, DIM_V)]  # q, k, v and the output's gradient weights
MODES = ("planned", "given")


def documents(rng):
    """(length, slices or None) of a batch: every kind of slice document and two plain ones."""
    docs = list(slice_masks.EXAMPLES.values()) + [(rng.randint(3, 8), None), (rng.randint(3, 8), None)]
    rng.shuffle(docs)
    return docs


def slice_plan(rng, world):
    """A documents-form plan: each document in 1 to 3 shards (homes on
    consecutive ranks, destinations anywhere), its slices with it."""
    docs = []
    for length, slices in documents(rng):
        cuts = sorted(rng.sample(range(1, length), min(length - 1, rng.randint(0, 2))))
        home = rng.randrange(world)
        shards = []
        for a, b in zip([0] + cuts, cuts + [length]):
            home = min(world - 1, home + rng.randint(0, 1))
            shards.append({"rank": home, "len": b - a, "dst": rng.randrange(world)})
        docs.append(dict({"shards": shards}, **({"slices": slices} if slices is not None else {})))
    return {"kind": "qkv", "world_size": world, "documents": docs}


def balanced_plan(rng, world):
    """cpdispatch.balance of a packed batch (batch_from_cu_seqlens) of slice
    documents and plain ones: the balancer cuts them, the plan keeps each
    document's slices."""
    docs = documents(rng)
    total = sum(n for n, _ in docs)
    docs.append((world - total % world + world, None))  # pads the sequence to a multiple of W
    cu = [0]
    for n, _ in docs:
        cu.append(cu[-1] + n)
    batch = cpdispatch.batch_from_cu_seqlens(cu, world)
    for doc, (_, slices) in zip(batch["documents"], docs):
        if slices is not None:
            doc["slices"] = slices
    plan = cpdispatch.balance(batch)
    assert [doc.get("slices") for doc in plan["documents"]] == [slices for _, slices in docs], "balance kept the slices"
    return plan


def plans(world):
    return [(f"plan{i}", slice_plan(random.Random(100 * world + i), world)) for i in range(2)] + [
        ("balanced", balanced_plan(random.Random(world), world))]


def without_slices(plan):
    """The plan's documents under the full mask, without their slices (mode "given")."""
    return dict(plan, mask={"type": "full"}, documents=[{"shards": doc["shards"]} for doc in plan["documents"]])


def slices_of(plan):
    """Per document (length, slices or None)."""
    return [(sum(s["len"] for s in doc["shards"]), doc.get("slices")) for doc in plan["documents"]]


def given_entries(plan, dispatch, rank):
    """Mode "given": the slices as entries over the full-mask layout. Each
    attention-layout query and key row's (document, position) is found by
    dispatching them; query shard i of document d (positions [a, b)) has
    the whole document as its KV group, column = position. A slice [qa, qb)
    x [ka, kb) with band [lo, hi] gives rows max(qa, a) - a .. min(qb, b) - a
    against columns ka .. kb, band [lo + a, hi + a] in the shard's rows and
    the group's columns; then moved to the buffers (as _rank_entries does).
    A document without slices is causal: one slice over all of it."""
    docs = slices_of(plan)
    rows = local_rows(plan, rank)
    label = torch.tensor([[d, start + i] for d, start, n in rows for i in range(n)], dtype=torch.float64).reshape(-1, 1, 2)
    with torch.no_grad():
        q_label = dispatch.dispatch_q(label).reshape(-1, 2).long()
        kv_label = dispatch.dispatch_kv(label).reshape(-1, 2).long()
    cu_q, cu_kv = dispatch.cu_seqlens_q.tolist(), dispatch.cu_seqlens_kv.tolist()
    entries = []
    for q0, q1, k0, k1 in zip(cu_q, cu_q[1:], cu_kv, cu_kv[1:]):
        d, a = q_label[q0].tolist()
        length, slices = docs[d]
        assert q_label[q0:q1].tolist() == [[d, a + i] for i in range(q1 - q0)], "a query shard is one document's run"
        assert kv_label[k0:k1].tolist() == [[d, t] for t in range(length)], "under the full mask the KV group is the whole document"
        for s in slices or [{"q": [0, length], "k": [0, length], "type": "causal"}]:
            (qa, qb), (ka, kb) = s["q"], s["k"]
            lo, hi = slice_masks.band(s)
            p0, p1 = max(qa, a), min(qb, a + q1 - q0)
            if p0 < p1:
                shift = k0 - q0 + a
                entries.append((q0 + p0 - a, p1 - p0, k0 + ka, kb - ka, None if lo is None else lo + shift, None if hi is None else hi + shift))
    return entries


def expected(plan, seed):
    """The documents' inputs, output-gradient weights, outputs and gradients (dense, float64, masks from the slices)."""
    gen = torch.Generator().manual_seed(seed)
    docs = slices_of(plan)
    q, k, v, w = ([torch.randn(n, *shape, generator=gen, dtype=torch.float64).requires_grad_(i < 3) for n, _ in docs]
                  for i, shape in enumerate(SHAPES))
    outs = [slice_masks.masked_attention(*x, slice_masks.slice_mask(n, slices), SCALE)[0] for x, (n, slices) in zip(zip(q, k, v), docs)]
    sum((o * wd).sum() for o, wd in zip(outs, w)).backward()
    grads = [[x.grad if x.grad is not None else torch.zeros_like(x) for x in xs] for xs in (q, k, v)]
    return (q, k, v, w), [o.detach() for o in outs], grads


def dispatch_for(plan, mode, dedup, rank):
    if mode == "planned":
        dispatch = RankDispatch(plan, dedup=dedup)
        assert dispatch.entries is not None or not len(dispatch.meta["attn"]["seqlens_q"]), "a plan with slices gave no entries"
        return dispatch
    dispatch = RankDispatch(without_slices(plan), dedup=dedup)
    assert dispatch.entries is None
    dispatch.entries = given_entries(plan, dispatch, rank)
    return dispatch


def attend(plan, mode, dedup, stages, kernel, inputs, rows, rank):
    q, k, v, w = (mine([x.detach() for x in xs], rows, shape) for xs, shape in zip(inputs, SHAPES))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    dispatch = dispatch_for(plan, mode, dedup, rank)
    out = ContextParallelAttention(softmax_scale=SCALE, kernel=kernel, stages=stages)(q, k, v, dispatch)
    (out * w).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad], dispatch


def check_case(plan, mode, dedup, stages, kernel, rank, seed):
    """Against unsharded attention; returns how many query shards the stages
    cut into parts merged by lse and the passes and calls (blockwise)."""
    inputs, outs, grads = expected(plan, seed)
    rows = local_rows(plan, rank)
    calls = CountingKernel.calls
    got, dispatch = attend(plan, mode, dedup, stages, kernel, inputs, rows, rank)
    calls = CountingKernel.calls - calls
    want = [mine(outs, rows, (HEADS, DIM_V))] + [mine(g, rows, shape) for g, shape in zip(grads, SHAPES)]
    for name, g, x in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(g).all(), f"{name} has a NaN or infinity"
        torch.testing.assert_close(g, x, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")
    passes = [parts for round_passes in getattr(dispatch.staging(stages), "passes", []) for parts in round_passes]
    starts = [part[0] for parts in passes for part in parts]
    return {"split": sum(starts.count(q0) > 1 for q0 in set(starts)), "passes": len(passes), "calls": calls,
            "entries": len(dispatch.entries or [])}


def bitwise_twice(plan, mode, dedup, rank, seed):
    inputs, _, _ = expected(plan, seed)
    rows = local_rows(plan, rank)
    first, _ = attend(plan, mode, dedup, 1, "blockwise", inputs, rows, rank)
    second, _ = attend(plan, mode, dedup, 1, "blockwise", inputs, rows, rank)
    for name, a, b in zip(("out", "dq", "dk", "dv"), first, second):
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), f"{name} differs between two runs"


def kernels():
    runs = [("blockwise", CountingKernel(), s) for s in (1, 2, 3)]
    return runs + [("flash_attn_varlen", "flash_attn_varlen", 1), ("flash_attn_varlen", "flash_attn_varlen", 3), ("sdpa", "sdpa", 1)]


def run(rank, world, init_file, out_dir):
    torch.set_num_threads(1)  # the ranks share two cores with the rest of the tests
    kernel_fakes.install_flash()
    kernel_fakes.install_sdpa()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    try:
        for name, plan in plans(world):
            assert len(documents_of(plan)) == len(plan["documents"])
            for mode in MODES:
                for dedup in (False, True):
                    for kernel_name, kernel, stages in kernels():
                        case = f"{mode} {name} dedup={dedup} {kernel_name} stages={stages}"
                        try:
                            results[case] = check_case(plan, mode, dedup, stages, kernel, rank, seed=len(results))
                        except Exception:  # every case reports; the collectives stay matched (the same calls on every rank)
                            results[case] = {"error": traceback.format_exc()}
                    case = f"{mode} {name} dedup={dedup} bitwise"
                    try:
                        bitwise_twice(plan, mode, dedup, rank, seed=len(results))
                        results[case] = {}
                    except Exception:
                        results[case] = {"error": traceback.format_exc()}
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()
