"""One rank of the model tests (test_transformers.py), over gloo: a small
randomly initialised model of each family with attn_implementation="cpdispatch"
on this rank's share of a packed batch, against the same weights run in one
process document by document with transformers' own eager attention (each
document alone, positions from 0: per-document attention by construction).
Writes each case's outcome ("ok" or the failure) and measured differences
to rank{r}.json."""

import json
import os
import traceback

import torch
import torch.distributed as dist

import cpdispatch.transformers as cpt
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

VOCAB = 61
# 41 tokens: documents of 5, 12, 1, 12 and 11; W = 2, 3, 4 pad to 42, 42, 44
# and cut documents [5, 17), [18, 30) and [30, 41) across ranks.
CU_SEQLENS = [0, 5, 17, 18, 30, 41]
LOSS_TOLERANCE = dict(rtol=1e-5, atol=1e-6)
GRAD_TOLERANCE = dict(rtol=1e-4, atol=1e-6)


def config(family, layers=None):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, tie_word_embeddings=False)
    if family == "llama":
        return LlamaConfig(num_hidden_layers=layers or 2, **common)
    if family == "qwen2":  # layer 0 full attention, the others a sliding window of 4 tokens
        return Qwen2Config(num_hidden_layers=layers or 3, use_sliding_window=True, sliding_window=4, max_window_layers=1, **common)
    raise ValueError(family)


def batch_ids():
    return torch.randint(0, VOCAB, (1, CU_SEQLENS[-1]), generator=torch.Generator().manual_seed(7))


def model_of(family, attn, layers=None, state=None):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(family, layers), attn_implementation=attn).float()
    if state is not None:
        model.load_state_dict(state)
    return model


def reference(model, ids):
    """(mean next-token loss over every document, gradients by name): one
    process, each document through the model on its own."""
    total, count = 0.0, 0
    for a, b in zip(CU_SEQLENS, CU_SEQLENS[1:]):
        if b - a < 2:
            continue  # a one-token document predicts nothing
        logits = model(input_ids=ids[:, a:b]).logits[0, :-1]
        total = total + torch.nn.functional.cross_entropy(logits.float(), ids[0, a + 1:b], reduction="sum")
        count += b - a - 1
    loss = total / count
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def sharded(model, ids, shard, compiled=None):
    """The summed loss and the parameter gradients summed over the ranks, this
    rank running its share (through `compiled` when given)."""
    model.zero_grad(set_to_none=True)
    if compiled is None:
        out = model(input_ids=shard.take(ids), position_ids=shard.position_ids, cp_shard=shard)
    else:
        with shard:
            out = compiled(input_ids=shard.take(ids), position_ids=shard.position_ids)
    loss = shard.loss(out.logits, ids)
    loss.backward()
    shard.reduce_gradients(model.parameters())
    total = loss.detach().clone()
    if shard.world > 1:
        dist.all_reduce(total)
    return total, {n: p.grad for n, p in model.named_parameters()}


def compare(loss, grads, want_loss, want_grads):
    """The largest gradient difference; raises on a NaN, a missing gradient or a difference past the tolerance."""
    assert torch.isfinite(loss), f"loss is {loss}"
    torch.testing.assert_close(loss, want_loss, **LOSS_TOLERANCE, msg=lambda m: f"loss: {m}")
    worst = 0.0
    for name, want in want_grads.items():
        got = grads[name]
        assert got is not None, f"{name} has no gradient"
        assert torch.isfinite(got).all(), f"{name}'s gradient has a NaN or infinity"
        torch.testing.assert_close(got, want, **GRAD_TOLERANCE, msg=lambda m, name=name: f"{name}: {m}")
        worst = max(worst, (got - want).abs().max().item())
    return worst


def model_case(family, world, rank):
    ids = batch_ids()
    model = model_of(family, "cpdispatch")
    want_loss, want_grads = reference(model_of(family, "eager", state=model.state_dict()), ids)
    shard = cpt.PackedShard(CU_SEQLENS)
    assert (shard.world, shard.rank) == (world, rank)
    loss, grads = sharded(model, ids, shard)
    return {"loss": loss.item(), "want": want_loss.item(), "grad_diff": compare(loss, grads, want_loss, want_grads)}


def compile_case(world, rank):
    """A two-layer model compiled (AOTAutograd with fake tensors, so the op's
    fake implementation and autograd registration are what runs): the same
    loss and gradients as the eager model, and the graph breaks counted."""
    ids = batch_ids()
    model = model_of("llama", "cpdispatch", layers=2)
    shard = cpt.PackedShard(CU_SEQLENS)
    eager_loss, eager_grads = sharded(model, ids, shard)
    eager_grads = {n: g.clone() for n, g in eager_grads.items()}
    with shard:
        explained = torch._dynamo.explain(model)(input_ids=shard.take(ids), position_ids=shard.position_ids)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    loss, grads = sharded(model, ids, shard, compiled)
    worst = compare(loss, grads, eager_loss, eager_grads)
    ours = [str(b.reason) for b in explained.break_reasons if any(os.sep + "cpdispatch" + os.sep in f.filename for f in b.user_stack)]
    return {"loss": loss.item(), "want": eager_loss.item(), "grad_diff": worst, "graphs": explained.graph_count,
            "graph_breaks": explained.graph_break_count, "break_reasons": [str(b.reason) for b in explained.break_reasons],
            "breaks_in_cpdispatch": ours}


def run(rank, world, init, families, with_compile, out_dir):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    results = {}
    cases = [(f, lambda f=f: model_case(f, world, rank)) for f in families]
    if with_compile:
        cases.append(("compile", lambda: compile_case(world, rank)))
    try:
        for name, case in cases:
            try:
                results[name] = dict(case(), outcome="ok")
            except Exception:  # every rank goes on to the next case's collectives
                results[name] = {"outcome": traceback.format_exc()}
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.barrier()  # no rank leaves while another still exchanges
        dist.destroy_process_group()
