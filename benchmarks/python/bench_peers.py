#!/usr/bin/env python3
"""Context-parallel attention peers on the CPU, over gloo, on one packed batch.

One packed sequence of --tokens tokens whose documents are drawn from
data/prolong.json (lengths divided by --scale, the last one cut to fit),
causal within each document; q, k, v of --heads heads (as many key-value
heads) of --head-dim, float32, cut evenly over W ranks (rank r holds tokens
[r T / W, (r + 1) T / W)). For each W in --worlds, W processes time
forward + backward ((out * dout).sum().backward()) of:

  cpdispatch     cpdispatch.transformers.PackedShard(cu_seqlens).attention:
                 ContextParallelAttention with its default blockwise kernel
  cpdispatch_sdpa  the same with kernel="sdpa" (the local kernel Ulysses uses here)
  torch_cp       PyTorch's context_parallel (ring attention over SDPA,
                 torch.distributed.tensor.experimental); it takes no document
                 masks, so where it runs it is timed with causal attention over
                 the whole sequence and checked against that
  torch_cp_flex  PyTorch's context parallelism for FlexAttention (private API:
                 _ContextParallel(FLEX) all-gathers the key-values, the
                 document mask a BlockMask from _create_cp_block_mask)
  ulysses_ds     DeepSpeed's Ulysses, deepspeed.sequence.layer.DistributedAttention
                 (all-to-all from sequence to heads and back), its local
                 attention SDPA causal over each document in turn

Before timing, every method's output and q, k, v gradients are checked
against a single-process reference (SDPA per document on the whole
sequence, float64) within float32 tolerance; a method that fails the check
or raises is reported with its reason and not timed. Repeats alternate the methods
(one call of each in turn); a repeat's time is the slowest rank's. The table
gives the median over --repeats, and the ratio to cpdispatch (above 1: slower).

DeepSpeed is not a project requirement; to include it:
    DS_BUILD_OPS=0 .venv/bin/pip install deepspeed
(its first init_distributed on a CPU compiles its shared-memory comm op,
about two minutes once, then cached under ~/.cache/torch_extensions).

    PYTHONPATH=build/python .venv/bin/python benchmarks/python/bench_peers.py [--worlds 2,4] [--tokens 4096] [--repeats 5]
"""

import argparse
import json
import logging
import os
import random
import socket
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
LENGTHS = os.path.join(HERE, "..", "..", "data", "prolong.json")
METHODS = ("cpdispatch", "cpdispatch_sdpa", "torch_cp", "torch_cp_flex", "ulysses_ds")
ATOL, RTOL = 1e-4, 1e-3


def packed_cu_seqlens(tokens, scale, seed):
    """Document boundaries of one packed sequence of ``tokens`` tokens."""
    with open(LENGTHS) as f:
        lengths = json.load(f)
    rng = random.Random(seed)
    cu = [0]
    while cu[-1] < tokens:
        cu.append(cu[-1] + min(max(1, lengths[rng.randrange(len(lengths))] // scale), tokens - cu[-1]))
    return cu


def per_document(q, k, v, cu):
    """Causal attention within each document: q, k, v [1, heads, T, dim] -> [1, heads, T, dim]."""
    parts = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True) for a, b in zip(cu, cu[1:])]
    return torch.cat(parts, dim=2)


def reference(q, k, v, dout, cu):
    """Output and gradients of attention on the whole sequence in one process,
    in float64; tensors [T, heads, dim], returned in float32."""
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out = per_document(*(x.transpose(0, 1).unsqueeze(0) for x in leaves), cu)[0].transpose(0, 1)
    out.backward(dout.double())
    return [t.float() for t in [out.detach()] + [x.grad for x in leaves]]


class Cpdispatch:
    kernel = "blockwise"

    def __init__(self, cu, rank, world):
        from cpdispatch.transformers import PackedShard

        self.shard = PackedShard(cu, rank=rank, world_size=world, kernel=self.kernel)

    def __call__(self, q, k, v):
        return self.shard.attention(q, k, v)


class CpdispatchSdpa(Cpdispatch):
    kernel = "sdpa"


class TorchContextParallel:
    """SDPA under context_parallel; the shards in, the shards out (the
    rank's contiguous tokens: no load-balancing rearrangement)."""

    def __init__(self, cu, rank, world):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import _cp_options

        self.mesh = init_device_mesh("cpu", (world,))
        self.context_parallel, self.options = context_parallel, _cp_options
        self.reference_cu = [0, cu[-1]]  # no document masks: the whole sequence is one causal document

    def __call__(self, q, k, v):
        dummy = [torch.empty(1, 1, q.shape[0] * self.mesh.size(), 1)]  # context_parallel shards buffers; ours are sharded already
        balance, self.options.enable_load_balance = self.options.enable_load_balance, False
        try:
            with self.context_parallel(self.mesh, buffers=dummy, buffer_seq_dims=[2], no_restore_buffers=set(dummy)):
                out = F.scaled_dot_product_attention(*(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)), is_causal=True)
        finally:
            self.options.enable_load_balance = balance
        return out[0].transpose(0, 1)


class TorchContextParallelFlex:
    def __init__(self, cu, rank, world):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental._context_parallel._attention import (_ContextParallel, _cp_options,
                                                                                        _create_cp_block_mask)
        from torch.distributed.tensor.parallel import parallelize_module
        from torch.nn.attention.flex_attention import flex_attention

        tiny = torch.zeros(1, 1, 16, 16, requires_grad=True)
        flex_attention(tiny, tiny, tiny)  # fails fast where FlexAttention has no backward on this device
        mesh = init_device_mesh("cpu", (world,))
        doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor([b - a for a, b in zip(cu, cu[1:])]))

        def mask_mod(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        balance, _cp_options.enable_load_balance = _cp_options.enable_load_balance, False  # the shards stay contiguous
        try:
            self.block_mask = _create_cp_block_mask(mask_mod, 1, 1, cu[-1], cu[-1], (128, 128), mesh)
        finally:
            _cp_options.enable_load_balance = balance

        class Flex(torch.nn.Module):
            def forward(self, q, k, v, block_mask=None):
                return flex_attention(q, k, v, block_mask=block_mask)

        self.attention = parallelize_module(Flex(), mesh, _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))

    def __call__(self, q, k, v):
        out = self.attention(*(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)), block_mask=self.block_mask)
        return out[0].transpose(0, 1)


class UlyssesDeepSpeed:
    install = "DS_BUILD_OPS=0 pip install deepspeed"

    def __init__(self, cu, rank, world):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
        try:  # optional: the row says how to install it when it is absent
            import deepspeed
            from deepspeed.sequence.layer import DistributedAttention
            from deepspeed.utils import logger
        except ImportError:
            raise

        logger.setLevel("ERROR")
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)  # wraps the process group already made
        self.attention = DistributedAttention(self._local, dist.group.WORLD, scatter_idx=2, gather_idx=1)
        self.cu = cu

    def _local(self, q, k, v):
        # [1, T, heads / W, dim]: every token of this rank's heads
        out = per_document(*(x.transpose(1, 2) for x in (q, k, v)), self.cu)
        return out.transpose(1, 2)

    def __call__(self, q, k, v):
        return self.attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), 0)[0]


def first_line(error):
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def worker(rank, world, port, args, cu, data, expected, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    q, k, v, dout = data
    share = cu[-1] // world
    mine = slice(rank * share, (rank + 1) * share)
    refs = {tuple(cu): [t[mine] for t in expected]}

    def run(method, q_r, k_r, v_r):
        leaves = [x.clone().requires_grad_() for x in (q_r, k_r, v_r)]
        out = method(*leaves)
        (out * dout[mine]).sum().backward()
        return [out.detach()] + [x.grad for x in leaves]

    methods, notes = {}, {}
    for name, make in zip(METHODS, (Cpdispatch, CpdispatchSdpa, TorchContextParallel, TorchContextParallelFlex, UlyssesDeepSpeed)):
        if name not in args.methods:
            continue
        try:
            method = make(cu, rank, world)
            key = tuple(getattr(method, "reference_cu", cu))
            if key not in refs:
                refs[key] = [t[mine] for t in reference(q, k, v, dout, list(key))]
            got = run(method, q[mine], k[mine], v[mine])
            err = max((g - r).abs().max().item() for g, r in zip(got, refs[key]))
            ok = all(torch.allclose(g, r, atol=ATOL, rtol=RTOL) for g, r in zip(got, refs[key]))
            status = None if ok else f"differs from the reference: max |error| {err:.3g} over out, dq, dk, dv"
        except ImportError as e:
            hint = f"; to include it: {make.install}" if hasattr(make, "install") else ""
            status, err = f"not installed ({first_line(e)}){hint}", None
        except Exception as e:
            status, err = first_line(e), None
        # every rank must agree before the collectives of the timed calls
        flags = [None] * world
        dist.all_gather_object(flags, (status, err))
        bad = next((s for s, _ in flags if s is not None), None)
        errs = [e for _, e in flags if e is not None]
        if bad is None:
            methods[name] = method
            notes[name] = {"err": max(errs), "masked": "documents" if len(key) == len(cu) else "whole sequence causal"}
        else:
            notes[name] = {"skipped": bad}
    times = {name: [] for name in methods}
    for repeat in range(args.warmup + args.repeats):
        for name, method in methods.items():
            dist.barrier()
            start = time.perf_counter()
            run(method, q[mine], k[mine], v[mine])
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if repeat >= args.warmup:
                times[name].append(elapsed.item() * 1e3)
    if rank == 0:
        for name in times:
            notes[name]["ms"] = statistics.median(times[name])
            notes[name]["all_ms"] = times[name]
        queue.put(notes)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4", help="comma-separated W")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the packed sequence (a multiple of every W)")
    parser.add_argument("--scale", type=int, default=4, help="divide the data set's document lengths by this")
    parser.add_argument("--heads", type=int, default=8, help="query heads (as many key-value heads); a multiple of every W")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.methods = args.methods.split(",")
    worlds = [int(w) for w in args.worlds.split(",")]
    for w in worlds:
        if args.tokens % w or args.heads % w:
            parser.error(f"--tokens ({args.tokens}) and --heads ({args.heads}) must be multiples of W = {w}")
    cu = packed_cu_seqlens(args.tokens, args.scale, args.seed)
    sizes = [b - a for a, b in zip(cu, cu[1:])]
    print(f"batch: {args.tokens} tokens, {len(sizes)} documents {sizes}, causal per document; heads {args.heads} q + {args.heads} kv "
          f"of {args.head_dim}, float32; torch {torch.__version__}, {args.threads} thread(s) per process, {os.cpu_count()} CPUs", flush=True)
    gen = torch.Generator().manual_seed(args.seed)
    data = [torch.randn(args.tokens, args.heads, args.head_dim, generator=gen) for _ in range(4)]
    expected = reference(*data, cu)
    rows, skipped = [], []
    for w in worlds:
        queue = mp.get_context("spawn").SimpleQueue()
        mp.spawn(worker, args=(w, free_port(), args, cu, data, expected, queue), nprocs=w, join=True)
        notes = queue.get()
        base = notes.get("cpdispatch", {}).get("ms")
        for name in METHODS:
            if name not in notes:
                continue
            n = notes[name]
            if "skipped" in n:
                skipped.append(f"{name} W={w}: {n['skipped']}")
            else:
                ratio = f"{n['ms'] / base:.2f}" if base else "-"
                rows.append((name, w, args.tokens, f"{n['ms']:.1f}", ratio, f"{n['err']:.1e}", n["masked"],
                             " ".join(f"{t:.0f}" for t in n["all_ms"])))
    head = ("method", "W", "tokens", "fwd+bwd ms", "vs cpdispatch", "max err", "mask", "repeats ms")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    for r in [head] + rows:
        print("  ".join(str(c).ljust(wd) for c, wd in zip(r, widths)).rstrip())
    for s in skipped:
        print("skipped", s)


if __name__ == "__main__":
    sys.exit(main())
