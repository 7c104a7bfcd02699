# Run: python3 examples/python/launch.py -n 2 examples/python/quickstart.py   (or torchrun --nproc_per_node 2)
import torch, torch.distributed as dist
import cpdispatch
from cpdispatch.torch import RankDispatch, ContextParallelAttention

dist.init_process_group("gloo")                      # "nccl" on GPUs; one process per rank
batch = {"world_size": dist.get_world_size(), "max_cp_degree": 4,
         "documents": [{"pieces": [{"rank": 0, "len": 300}, {"rank": 1, "len": 200}]},   # spans ranks 0 and 1
                       {"pieces": [{"rank": 1, "len": 60}]}]}
plan = cpdispatch.balance(batch)                     # in the data loader: the same plan on every rank
dispatch = RankDispatch(plan)                        # this rank's token indices and attention layout
T = len(dispatch.position_ids)                       # this rank's tokens (MLP layout); position_ids feed RoPE
q, k, v = (torch.randn(T, 8, 64, requires_grad=True) for _ in range(3))
out = ContextParallelAttention()(q, k, v, dispatch)  # dispatch, attention under the plan's mask, undispatch
out.sum().backward()                                 # gradients flow home, key-value copies summed
print(f"rank {dist.get_rank()}: {T} tokens, largest query shard here {dispatch.max_seqlen_q}, grad {q.grad.norm():.3f}")
