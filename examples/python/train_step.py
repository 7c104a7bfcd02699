"""A training step with context-parallel attention on every rank (CPU, gloo).

The batch is packed and balanced as a data loader would (rank 0 plans and
broadcasts, or every rank plans the same batch); each rank embeds its own
tokens (MLP layout), rotates queries and keys by their positions within
their documents (RoPE), attends through ContextParallelAttention, and the
replicated weights' gradients are averaged over the ranks.

    python3 examples/python/launch.py -n 2 examples/python/train_step.py [--steps 5] [--mask sliding_window]
"""

import argparse
import math
import random

import torch
import torch.distributed as dist

import cpdispatch
from cpdispatch.torch import ContextParallelAttention, RankDispatch

VOCAB, HEADS, DIM = 64, 4, 16


def rope(x, positions):
    """Rotary position embedding of x [tokens, heads, dim] by positions [tokens]."""
    half = x.shape[-1] // 2
    freq = 10000.0 ** (-torch.arange(half, dtype=x.dtype) / half)
    angle = positions.to(x.dtype)[:, None, None] * freq
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], dim=-1)


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HEADS * DIM)
        self.qkv = torch.nn.Linear(HEADS * DIM, 3 * HEADS * DIM, bias=False)
        self.out = torch.nn.Linear(HEADS * DIM, VOCAB)
        self.attention = ContextParallelAttention()

    def forward(self, tokens, dispatch):
        x = self.embed(tokens)
        q, k, v = self.qkv(x).view(-1, 3, HEADS, DIM).unbind(1)
        q, k = rope(q, dispatch.position_ids), rope(k, dispatch.position_ids)
        return self.out(self.attention(q, k, v, dispatch).reshape(-1, HEADS * DIM))


def batch_plan(world, mask, seed):
    """A packed batch of documents (some spanning ranks), balanced."""
    rng = random.Random(seed)
    documents = [{"pieces": [{"rank": r, "len": rng.randint(20, 60)}, {"rank": (r + 1) % world, "len": rng.randint(5, 30)}]}
                 for r in range(world)]
    batch = {"world_size": world, "max_cp_degree": 3, "documents": documents}
    if mask != "causal":
        batch["mask"] = {"type": mask, "window": 16} if mask == "sliding_window" else {"type": mask}
    return cpdispatch.balance(batch)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--mask", default="causal", choices=["causal", "full", "sliding_window"])
    parser.add_argument("--dedup", action="store_true", help="send each key-value shard once per destination rank")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = Layer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(args.steps):
        dispatch = RankDispatch(batch_plan(world, args.mask, seed=step % 2), dedup=args.dedup)
        gen = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(VOCAB, (len(dispatch.position_ids),), generator=gen)
        logits = model(tokens, dispatch)
        loss = torch.nn.functional.cross_entropy(logits, tokens, reduction="sum")  # learn to echo each token
        optimizer.zero_grad()
        loss.backward()
        count = torch.tensor([float(len(tokens))])
        dist.all_reduce(count)
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= count
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        per_token = total.item() / count.item()
        assert math.isfinite(per_token)
        if step == 0:  # small initial weights: close to guessing among VOCAB tokens
            assert abs(per_token - math.log(VOCAB)) < 0.5, per_token
        if rank == 0:
            print(f"step {step}: loss {per_token:.4f} per token")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
