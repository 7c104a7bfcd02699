# Run: python3 examples/python/launch.py -n 2 examples/python/quickstart.py   (or torchrun --nproc_per_node 2)
import torch, torch.distributed as dist
import cpdispatch
from cpdispatch.torch import RankDispatch, ContextParallelAttention

dist.init_process_group("gloo")                      # "nccl" on GPUs; one process per rank
cu_seqlens = torch.tensor([0, 300, 500, 560], dtype=torch.int32)  # the packed sequence: 3 documents, 560 tokens
batch = cpdispatch.batch_from_cu_seqlens(cu_seqlens, dist.get_world_size())  # rank r holds tokens [r T/W, (r+1) T/W)
plan = cpdispatch.balance(batch)                     # in the data loader: the same plan on every rank
dispatch = RankDispatch(plan)                        # this rank's token indices and attention layout
T = len(dispatch.position_ids)                       # this rank's tokens (MLP layout); position_ids feed RoPE
q = torch.randn(T, 8, 64, requires_grad=True)        # 8 query heads
k, v = (torch.randn(T, 2, 64, requires_grad=True) for _ in range(2))  # 2 key-value heads (grouped-query attention)
out = ContextParallelAttention()(q, k, v, dispatch)  # dispatch, attention under the plan's mask, undispatch
out.sum().backward()                                 # gradients flow home, key-value copies summed
first = dispatch.position_ids == 0                   # a document's first token sees only itself: its output is its value
assert first.any() and torch.allclose(out[first], v[first].repeat_interleave(4, dim=1))
dv_total = v.grad.sum(dim=0)                         # each row's attention weights sum to 1, on each of 4 query heads
dist.all_reduce(dv_total)
assert torch.allclose(dv_total, torch.full_like(dv_total, 4.0 * 560)), dv_total
print(f"rank {dist.get_rank()}: {T} tokens, largest query shard here {dispatch.max_seqlen_q}, grad {q.grad.norm():.3f}")
dist.destroy_process_group()                         # before exit: gloo's threads otherwise may abort the process
