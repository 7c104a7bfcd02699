"""One rank of the slice-mask tests (gloo): ContextParallelAttention on plans
whose documents carry slices (docs/plan-format.md section 2e: shared prefix
with responses, block causal, prefix-LM, inverse and bi-causal bands, rows
no slice covers) mixed with plain causal documents, against unsharded
float64 attention whose mask is built from each document's slices; 1 to 3
stages, the blockwise kernel and the stand-ins of flash-attention's and
sdpa's, dedup off and on, grouped-query attention with a value dimension of
its own; stages = 1 twice gives the same bytes (workers.py).

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

import functools
import random

import torch

import cpdispatch
import slice_masks
import workers
from cpdispatch.torch import RankDispatch
from workers import SCALE, documents_of, local_rows

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
    plan = cpdispatch.balance(slice_masks.packed_batch(docs, world))
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
    docs = slices_of(plan)
    return workers.expected([n for n, _ in docs], lambda d, q, k, v: slice_masks.masked_attention(
        q, k, v, slice_masks.slice_mask(*docs[d]), SCALE)[0], seed)


def dispatch_for(plan, mode, dedup, rank):
    if mode == "planned":
        dispatch = RankDispatch(plan, dedup=dedup)
        assert dispatch.entries is not None or not len(dispatch.meta["attn"]["seqlens_q"]), "a plan with slices gave no entries"
        return dispatch
    dispatch = RankDispatch(without_slices(plan), dedup=dedup)
    assert dispatch.entries is None
    dispatch.entries = given_entries(plan, dispatch, rank)
    return dispatch


def check_case(plan, mode, dedup, stages, kernel, rank, seed):
    """Against unsharded attention: workers.check_case's counts and this rank's entries."""
    dispatch = dispatch_for(plan, mode, dedup, rank)
    return dict(workers.check_case(dispatch, kernel, stages, expected(plan, seed), local_rows(plan, rank)), entries=len(dispatch.entries or []))


def bitwise_twice(plan, mode, dedup, rank, seed):
    inputs, _, _ = expected(plan, seed)
    workers.bitwise_twice(lambda: dispatch_for(plan, mode, dedup, rank), inputs, local_rows(plan, rank))


def cases(world):
    """(name, case(rank, seed)) of every plan, mode, dedup and kernel run, and the bitwise check."""
    for name, plan in plans(world):
        assert len(documents_of(plan)) == len(plan["documents"])
        for mode in MODES:
            for dedup in (False, True):
                for kernel_name, kernel, stages in workers.kernels():
                    yield f"{mode} {name} dedup={dedup} {kernel_name} stages={stages}", functools.partial(
                        check_case, plan, mode, dedup, stages, kernel)
                yield f"{mode} {name} dedup={dedup} bitwise", functools.partial(bitwise_twice, plan, mode, dedup)


def run(rank, world, init_file, out_dir):
    workers.run_cases(rank, world, init_file, out_dir, cases(world))
