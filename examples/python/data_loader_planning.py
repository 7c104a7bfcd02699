"""Planning where the batch is made: in the data loader, on the CPU.

A data loader packs documents end to end into one sequence of every rank's
token budget (flash-attention's cu_seqlens), cut evenly over the ranks (so a
long document continues on the next rank), asks cpdispatch for a balanced
plan, and hands every rank its share: the token counts, cu_seqlens for a
varlen attention kernel, and position ids for RoPE. Runs without torch (NumPy only).

    python3 examples/python/data_loader_planning.py [--world 4] [--budget 4096] [--seed 0]
"""

import argparse
import random
import time

import numpy as np

import cpdispatch


def packed_cu_seqlens(lengths, tokens):
    """Documents packed end to end into one sequence of `tokens` tokens, as
    flash-attention's cu_seqlens: the last document that fits is cut at the
    end, and a short batch ends in one padding document."""
    cu = np.minimum(np.cumsum([0] + lengths), tokens)  # documents past the end become empty: left out
    return np.append(cu, tokens) if cu[-1] < tokens else cu


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--budget", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    lengths = [int(rng.paretovariate(1.2) * 300) for _ in range(4 * args.world)]  # long-tailed, as real corpora
    cu_seqlens = packed_cu_seqlens(lengths, args.world * args.budget)
    batch = cpdispatch.batch_from_cu_seqlens(cu_seqlens, args.world)  # rank r holds tokens [r budget, (r + 1) budget)

    start = time.perf_counter()
    plan = cpdispatch.balance(batch)
    balanced = time.perf_counter()
    shares = [cpdispatch.plan_for_rank(plan, rank) for rank in range(args.world)]
    planned = time.perf_counter()

    print(f"{len(batch['documents'])} documents on {args.world} ranks of {args.budget} tokens; "
          f"balance {1e3 * (balanced - start):.2f} ms, per-rank planning {1e3 * (planned - balanced) / args.world:.3f} ms a rank")
    print("rank  tokens  q_recv  kv_recv  shards  max_seqlen_q  max_seqlen_kv  first position ids")
    for rank, share in enumerate(shares):
        varlen = share["varlen"]  # int32 cu_seqlens for flash_attn_varlen_func
        assert varlen["cu_seqlens_q"].dtype.name == "int32"
        positions = cpdispatch.position_ids(plan, rank)
        print(f"{rank:4d}  {share['q_fwd']['seq_len'].sum():6d}  {share['q_fwd']['num_recv_tokens'][-1]:6d}  "
              f"{share['kv_fwd']['num_recv_tokens'][-1]:7d}  {share['attn']['seqlens_q'].size:6d}  "
              f"{varlen['max_seqlen_q']:12d}  {varlen['max_seqlen_kv']:13d}  {positions[:4].tolist()}")


if __name__ == "__main__":
    main()
