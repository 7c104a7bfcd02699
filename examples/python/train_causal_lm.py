"""Trains a small randomly initialised causal language model (Hugging Face
transformers, no weights downloaded) with cpdispatch's context-parallel
attention, on packed batches whose document lengths come from
data/prolong.json (scaled down) and whose tokens are synthetic (each document
counts on from a random start by a random step, so there is something to
learn). Prints the loss of every step; W ranks print what one process does.

    python3 examples/python/launch.py -n 4 examples/python/train_causal_lm.py   # W = 4 over gloo
    python3 examples/python/train_causal_lm.py                                  # W = 1, for comparison
"""

import argparse
import json
import math
import os
import random
import time

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

import cpdispatch.transformers as cpt

HERE = os.path.dirname(os.path.abspath(__file__))
LENGTHS = os.path.join(HERE, "..", "..", "data", "prolong.json")


def config(family, vocab):
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096)
    if family == "llama":
        return LlamaConfig(**common)
    return Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=1, **common)  # layer 1: a sliding window


def packed_batch(lengths, step, tokens, scale, vocab, seed):
    """cu_seqlens and input ids [1, tokens] of one packed batch, the same on every rank:
    documents drawn from the data set's lengths (divided by scale) until the
    batch is full, the last one cut to fit."""
    rng = random.Random(seed * 1_000_003 + step)
    cu, ids = [0], []
    while cu[-1] < tokens:
        n = min(max(1, lengths[rng.randrange(len(lengths))] // scale), tokens - cu[-1])
        start, stride = rng.randrange(vocab), rng.randrange(1, 8)
        ids += [(start + stride * i) % vocab for i in range(n)]
        cu.append(cu[-1] + n)
    return cu, torch.tensor([ids])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["llama", "qwen2"], default="qwen2", help="qwen2: one sliding-window layer")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per packed batch")
    parser.add_argument("--scale", type=int, default=8, help="divide the data set's document lengths by this")
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--losses", help="write the steps' losses to this JSON file (rank 0)")
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")  # launch.py (or torchrun) sets the env:// variables
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = AutoModelForCausalLM.from_config(config(args.family, args.vocab), attn_implementation="cpdispatch")
    forward = torch.compile(model, backend="aot_eager") if args.compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    with open(LENGTHS) as f:
        lengths = json.load(f)

    losses = []
    for step in range(args.steps):
        start = time.perf_counter()
        cu_seqlens, input_ids = packed_batch(lengths, step, args.tokens, args.scale, args.vocab, args.seed)
        shard = cpt.PackedShard(cu_seqlens)  # this rank's tokens, positions and shifted labels
        with shard:  # the attention layers find the batch here (a compiled model too)
            logits = forward(input_ids=shard.take(input_ids), position_ids=shard.position_ids).logits
        loss = shard.loss(logits, input_ids)  # this rank's share of the batch's mean loss
        loss.backward()
        shard.reduce_gradients(model.parameters())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item())
        if rank == 0:
            print(f"step {step}: loss {total.item():.6f}  ({len(cu_seqlens) - 1} documents, {args.tokens} tokens, W = {world}, "
                  f"{time.perf_counter() - start:.2f} s)", flush=True)
    if rank == 0 and args.losses:
        with open(args.losses, "w") as f:
            json.dump(losses, f)
    if not all(math.isfinite(x) for x in losses):
        raise SystemExit("a loss is NaN")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
