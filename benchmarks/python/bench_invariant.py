"""What the invariant mode costs from Python: one causal document of L tokens
(float32, 8 + 8 heads of 64 by default), forward and backward through
autograd, BlockwiseKernel() (the default, PyTorch ops) against
BlockwiseKernel(invariant=True) (the C++ host kernel's invariant mode), the
two alternated --repeats times in one run (compare the ratios on a shared
machine, not the seconds):

    PYTHONPATH=build/python python3 benchmarks/python/bench_invariant.py --lengths 2048,4096 --threads 2

--threads sets torch's threads and the invariant kernel's. Prints a
Markdown table: median seconds of each and their ratio per length."""

import argparse
import statistics
import time

import torch

from cpdispatch.torch import BlockwiseKernel


def step(kernel, q, k, v, w, cu):
    """Seconds of one forward and backward; the output checked for NaN."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    start = time.perf_counter()
    out = kernel(q, k, v, cu, cu, mask={"type": "causal"})
    (out * w).sum().backward()
    seconds = time.perf_counter() - start
    if not all(bool(torch.isfinite(x).all()) for x in (out, q.grad, k.grad, v.grad)):
        raise RuntimeError(f"{kernel.name}: a NaN or infinity in the output or gradients")
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="2048,4096")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--heads-kv", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = {"default": BlockwiseKernel(), "invariant": BlockwiseKernel(invariant=True, threads=args.threads)}
    print(f"| L (causal, {args.heads} + {args.heads_kv} heads of {args.dim}, float32) | default (s) | invariant (s) | invariant / default |")
    print("|---|---|---|---|")
    for length in (int(x) for x in args.lengths.split(",")):
        gen = torch.Generator().manual_seed(length)
        q, w = (torch.randn(length, args.heads, args.dim, generator=gen) for _ in range(2))
        k, v = (torch.randn(length, args.heads_kv, args.dim, generator=gen) for _ in range(2))
        cu = torch.tensor([0, length])
        times = {name: [] for name in kernels}
        for name, kernel in kernels.items():  # a warm-up of each
            step(kernel, q, k, v, w, cu)
        for _ in range(args.repeats):
            for name, kernel in kernels.items():
                times[name].append(step(kernel, q, k, v, w, cu))
        d, i = (statistics.median(times[name]) for name in ("default", "invariant"))
        print(f"| {length} | {d:.3f} | {i:.3f} | {i / d:.2f} |")


if __name__ == "__main__":
    main()
