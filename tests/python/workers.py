"""What the multi-process op tests share (stages_worker.py, slices_worker.py
and their tests test_stages.py, test_slices.py).

On a rank (gloo): the shapes, the rank's rows of the MLP layout, the
kernels run, the documents' inputs and expected results, one case's run of
ContextParallelAttention against them, the bitwise check, and the loop that
runs every case and writes the results. On the pytest side: starting the
ranks once per world size, and reading their results back."""

import json
import os
import traceback

import torch
import torch.distributed as dist

import kernel_fakes
from cpdispatch.torch import BlockwiseKernel, ContextParallelAttention

HEADS, HEADS_KV, DIM, DIM_V = 4, 2, 4, 3
SCALE = DIM ** -0.5
SHAPES = [(HEADS, DIM), (HEADS_KV, DIM), (HEADS_KV, DIM_V), (HEADS, DIM_V)]  # q, k, v and the output's gradient weights


class CountingKernel(BlockwiseKernel):
    """The blockwise adapter, counting the calls of its staged forward (one per pass)."""

    calls = 0

    def forward(self, *args, **kwargs):
        CountingKernel.calls += 1
        return super().forward(*args, **kwargs)


def kernels():
    """(name, kernel, stages) runs: the blockwise adapter at 1 to 3 stages, flash-attention's stand-in at 1 and 3, sdpa's at 1."""
    runs = [("blockwise", CountingKernel(), s) for s in (1, 2, 3)]
    return runs + [("flash_attn_varlen", "flash_attn_varlen", 1), ("flash_attn_varlen", "flash_attn_varlen", 3), ("sdpa", "sdpa", 1)]


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


def mine(parts, rows, shape):
    return torch.cat([parts[d][s:s + n] for d, s, n in rows]) if rows else torch.zeros((0,) + shape, dtype=torch.float64)


def expected(lengths, attention, seed):
    """The documents' inputs and output-gradient weights (random, float64),
    outputs (attention(document, q, k, v)) and gradients."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, w = ([torch.randn(n, *shape, generator=gen, dtype=torch.float64).requires_grad_(i < 3) for n in lengths]
                  for i, shape in enumerate(SHAPES))
    outs = [attention(d, *x) for d, x in enumerate(zip(q, k, v))]
    if outs:
        sum((o * wd).sum() for o, wd in zip(outs, w)).backward()
    grads = [[x.grad if x.grad is not None else torch.zeros_like(x) for x in xs] for xs in (q, k, v)]
    return (q, k, v, w), [o.detach() for o in outs], grads


def attend(dispatch, kernel, stages, inputs, rows):
    """This rank's output and the gradients of q, k and v through ContextParallelAttention."""
    q, k, v, w = (mine([x.detach() for x in xs], rows, shape) for xs, shape in zip(inputs, SHAPES))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = ContextParallelAttention(softmax_scale=SCALE, kernel=kernel, stages=stages)(q, k, v, dispatch)
    (out * w).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def check_case(dispatch, kernel, stages, want, rows):
    """Compares this rank's run with `want` (expected()'s inputs, outputs and
    gradients). Returns how many query shards the stages split into parts
    merged by lse, how many passes the staging plan has and how many calls
    the counting kernel's forward got."""
    inputs, outs, grads = want
    calls = CountingKernel.calls
    got = attend(dispatch, kernel, stages, inputs, rows)
    calls = CountingKernel.calls - calls
    wanted = [mine(outs, rows, (HEADS, DIM_V))] + [mine(g, rows, shape) for g, shape in zip(grads, SHAPES)]
    for name, g, x in zip(("out", "dq", "dk", "dv"), got, wanted):
        assert torch.isfinite(g).all(), f"{name} has a NaN or infinity"
        torch.testing.assert_close(g, x, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")
    passes = [parts for round_passes in getattr(dispatch.staging(stages), "passes", []) for parts in round_passes]
    shards = [part[0] for parts in passes for part in parts]
    return {"split": sum(shards.count(q0) > 1 for q0 in set(shards)), "passes": len(passes), "calls": calls}


def bitwise_twice(dispatch_of, inputs, rows):
    """stages = 1 run twice on the same inputs (each on dispatch_of()'s dispatch) gives the same bytes."""
    first = attend(dispatch_of(), "blockwise", 1, inputs, rows)
    second = attend(dispatch_of(), "blockwise", 1, inputs, rows)
    for name, a, b in zip(("out", "dq", "dk", "dv"), first, second):
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), f"{name} differs between two runs"


def run_cases(rank, world, init_file, out_dir, cases):
    """Runs every (name, case) of `cases` on this rank: case(rank, seed)
    returns what the test reads back (None: nothing). Writes them to
    out_dir/rank<rank>.json, an error's traceback in place of a result."""
    torch.set_num_threads(1)  # the ranks share two cores with the rest of the tests
    kernel_fakes.install_flash()
    kernel_fakes.install_sdpa()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    try:
        for name, case in cases:
            try:
                results[name] = case(rank, len(results)) or {}
            except Exception:  # every case reports; the collectives stay matched (the same calls on every rank)
                results[name] = {"error": traceback.format_exc()}
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def outcomes(tmp_path_factory, run, label):
    """A function of the world size: every rank's results of `run` (a
    worker's run(rank, world, init_file, out_dir)), each world run once."""
    import torch.multiprocessing as mp

    cache = {}

    def of(world):
        if world not in cache:
            tmp = tmp_path_factory.mktemp(f"{label}{world}")
            # fork: the workers share the imported torch instead of importing it again (seconds each)
            mp.start_processes(run, args=(world, str(tmp / "init"), str(tmp)), nprocs=world, join=True, start_method="fork")
            cache[world] = [json.load(open(tmp / f"rank{r}.json")) for r in range(world)]
        return cache[world]

    return of


def errors(results, keep=lambda case: True):
    """The errors of the cases `keep` accepts, by "rank r: case"."""
    return {f"rank {r}: {case}": res["error"] for r, rank in enumerate(results) for case, res in rank.items() if keep(case) and "error" in res}


def report(failed):
    return "\n".join(f"{case}\n{error}" for case, error in failed.items())


def split_parts(results, key):
    """Per key(case's words), how many query shards the staged runs split
    into parts merged by lse; checks on the way that the counting kernel's
    staged forward is called once per pass (never with one stage). Cases
    are "<words> <kernel> stages=<S>" or "<words> bitwise"; failed ones are left out."""
    split = {}
    for rank in results:
        for case, res in rank.items():
            words = case.split(" ")
            if "error" in res or words[-1] == "bitwise":
                continue
            kernel, stages = words[-2:]
            if kernel == "blockwise":
                assert res["calls"] == (res["passes"] if stages != "stages=1" else 0), (case, res)
            if stages != "stages=1" and key(words) is not None:
                split[key(words)] = split.get(key(words), 0) + res["split"]
    return split
