"""Peak memory and time of varlen_attention's forward and backward over one
causal document, measured in a process of its own (test_blockwise.py runs it;
also by hand):

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=build/python python3 benchmarks/python/attention_memory.py --tokens 16384 --heads 1 --dim 64 --threads 1

(--threads sets torch's threads; the BLAS library's own come from its
environment variables, e.g. OPENBLAS_NUM_THREADS.)

Prints one JSON object: the peak resident memory beyond what the process
held once the inputs were allocated (MiB), the seconds (wall and CPU), and a checksum that
is finite only where every output and gradient is."""

import argparse
import json
import time

import torch

from cpdispatch.torch import varlen_attention


def status_kib(field):
    """A VmRSS / VmHWM line of /proc/self/status, in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak():
    """Makes VmHWM the current RSS (Linux 4.0 and later); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    n, h, kvh, d = args.tokens, args.heads, args.kv_heads or args.heads, args.dim
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(n, h, d, generator=gen).requires_grad_()
    k, v = (torch.randn(n, kvh, d, generator=gen).requires_grad_() for _ in range(2))
    weight = torch.randn(n, h, d, generator=gen)
    cu = torch.tensor([0, n], dtype=torch.int32)

    before = status_kib("VmRSS")
    peak_reset = reset_peak()
    start, cpu_start = time.perf_counter(), time.process_time()
    out = varlen_attention(q, k, v, cu, cu, n, n, {"type": "causal"})
    dq, dk, dv = torch.autograd.grad((out * weight).sum(), (q, k, v))
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak = status_kib("VmHWM")

    checksum = sum(float(t.double().abs().sum()) for t in (out, dq, dk, dv))
    print(json.dumps({"tokens": n, "heads": h, "kv_heads": kvh, "dim": d, "threads": torch.get_num_threads(),
                      "peak_reset": peak_reset, "rss_before_mib": before / 1024, "peak_delta_mib": (peak - before) / 1024,
                      "seconds": seconds, "cpu_seconds": cpu_seconds, "checksum": checksum}))


if __name__ == "__main__":
    main()
