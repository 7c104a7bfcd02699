#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention on bench_cuda_attention's target shape.

One document of --tokens tokens (default 8192), bf16, heads 32 : 8 of 128,
causal, through every SDPA backend PyTorch offers (FLASH_ATTENTION,
EFFICIENT_ATTENTION, CUDNN_ATTENTION, MATH, each forced with
torch.nn.attention.sdpa_kernel); a backend that errors is skipped with its
reason. Grouped-query attention runs natively (enable_gqa=True) where the
backend takes it, else with the key-values expanded to every query head
inside the timed forward (repeat_interleave; its gradient sums back in the
backward), as a model would have to.

FLOPs as flash-attention (and bench_cuda_attention) count them: forward
4 * pairs * head_dim * heads_q over the (query, key) pairs the mask lets
through, backward 2.5 times that. Times are CUDA-event medians of --repeats
calls after --warmup calls; the backward is timed alone
(torch.autograd.grad over a retained graph). In the same run, the peer:
torch.matmul of two 8192 x 8192 bf16 matrices.

Output, one line each (parseable: a name, then key value pairs):
    gemm bf16_8192 tflops X
    sdpa <backend> fwd_tflops X bwd_tflops Y fwd_ms A bwd_ms B gqa native|expanded fwd_frac F bwd_frac G
    sdpa <backend> skipped: <reason>
where backend is flash, efficient, cudnn or math and the fractions are over
the GEMM's rate. Exits 1 when PyTorch or a CUDA device is missing.

    python3 benchmarks/python/bench_torch_sdpa.py [--tokens 8192] [--repeats 10] [--backends flash,efficient,cudnn,math]
"""

import argparse
import statistics
import sys
import warnings

BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "math": "MATH",
}


def causal_pairs(tokens):
    return tokens * (tokens + 1) / 2


def event_median_ms(torch, fn, repeats, warmup):
    """Median CUDA-event milliseconds of fn() on the current stream."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def gemm_tflops(torch, repeats, warmup):
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = event_median_ms(torch, lambda: torch.matmul(a, b), max(repeats, 10), warmup)
    return 2.0 * n**3 / (ms * 1e-3) * 1e-12


def attention(torch, f, q, k, v, native_gqa):
    """Causal attention of q over k, v: natively grouped, or with k, v expanded to q's heads."""
    if native_gqa:
        return f.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    return f.scaled_dot_product_attention(q, k, v, is_causal=True)


def run_backend(torch, f, backend, args, tensors):
    q, k, v, dout = tensors
    # enable_gqa exists from PyTorch 2.5; where a backend refuses it, expand the key-values instead.
    errors = []
    for native in (True, False):
        if native and args.heads_q == args.heads_kv:
            continue
        # PyTorch gives a refused backend's reasons as warnings before "No available kernel": keep the first.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with torch.nn.attention.sdpa_kernel(backend):
                    out = attention(torch, f, q, k, v, native)
                    torch.autograd.grad(out, (q, k, v), dout)
                    torch.cuda.synchronize()
                break
            except (RuntimeError, TypeError, NotImplementedError, ValueError) as e:
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                if caught:
                    reason += " (" + str(caught[0].message).strip().splitlines()[0] + ")"
                errors.append(("native gqa: " if native else "expanded: ") + reason)
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
    else:
        return None, "; ".join(errors)
    with torch.nn.attention.sdpa_kernel(backend):
        fwd_ms = event_median_ms(torch, lambda: attention(torch, f, q, k, v, native), args.repeats, args.warmup)
        out = attention(torch, f, q, k, v, native)
        bwd_ms = event_median_ms(
            torch, lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), args.repeats, args.warmup
        )
    del out
    torch.cuda.empty_cache()
    return (fwd_ms, bwd_ms, "native" if native or args.heads_q == args.heads_kv else "expanded"), None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--heads-q", type=int, default=32)
    parser.add_argument("--heads-kv", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--backends", default="flash,efficient,cudnn,math")
    args = parser.parse_args()
    names = [b for b in args.backends.split(",") if b]
    unknown = [b for b in names if b not in BACKENDS]
    if unknown or args.heads_q % args.heads_kv != 0 or min(args.tokens, args.repeats, args.heads_kv, args.head_dim) < 1:
        parser.error(f"backends are {', '.join(BACKENDS)}; heads-q must be a multiple of heads-kv; sizes positive")

    try:
        import torch
        import torch.nn.functional as f
        from torch.nn.attention import SDPBackend
    except ImportError as e:
        print(f"bench_torch_sdpa: needs PyTorch 2.3 or later with torch.nn.attention ({e})", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print(f"bench_torch_sdpa: no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda})", file=sys.stderr)
        return 1

    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    print(
        f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"cuDNN {cudnn}; tokens {args.tokens} heads {args.heads_q}/{args.heads_kv} dim {args.head_dim} bf16 causal; "
        f"median of {args.repeats} after {args.warmup} warm-ups (CUDA events)",
        flush=True,
    )
    peer = gemm_tflops(torch, args.repeats, args.warmup)
    print(f"gemm bf16_8192 tflops {peer:.1f}", flush=True)

    shape_q = (1, args.heads_q, args.tokens, args.head_dim)
    shape_kv = (1, args.heads_kv, args.tokens, args.head_dim)
    make = lambda shape: torch.empty(shape, device="cuda", dtype=torch.bfloat16).uniform_(-1, 1)
    q, k, v = (make(s).requires_grad_() for s in (shape_q, shape_kv, shape_kv))
    dout = make(shape_q)
    flop = 4.0 * causal_pairs(args.tokens) * args.head_dim * args.heads_q
    for name in names:
        backend = getattr(SDPBackend, BACKENDS[name], None)
        if backend is None:
            print(f"sdpa {name} skipped: this PyTorch has no SDPBackend.{BACKENDS[name]}", flush=True)
            continue
        try:
            result, why = run_backend(torch, f, backend, args, (q, k, v, dout))
        except torch.cuda.OutOfMemoryError as e:
            result, why = None, "out of memory: " + str(e).strip().splitlines()[0]
            torch.cuda.empty_cache()
        if result is None:
            print(f"sdpa {name} skipped: {why}", flush=True)
            continue
        fwd_ms, bwd_ms, gqa = result
        fwd = flop / (fwd_ms * 1e-3) * 1e-12
        bwd = 2.5 * flop / (bwd_ms * 1e-3) * 1e-12
        print(
            f"sdpa {name} fwd_tflops {fwd:.1f} bwd_tflops {bwd:.1f} fwd_ms {fwd_ms:.3f} bwd_ms {bwd_ms:.3f} gqa {gqa} "
            f"fwd_frac {fwd / peer:.3f} bwd_frac {bwd / peer:.3f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
