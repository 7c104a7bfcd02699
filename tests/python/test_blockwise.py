"""varlen_attention, the blockwise (flash-attention) kernel, against dense
float64 attention written here: every mask, MHA and GQA, ragged entries
(lq != lk, rows that see no key, entries without keys or queries, rows past
the last entry), output, lse and the gradients of q, k and v; block sizes
that do not divide the lengths; float64, float32 and bfloat16. And its
memory: forward and backward over one causal document of 16K tokens, in a
process of its own."""

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import require

torch = require("torch")
require("cpdispatch")

from attention_checks import TOLERANCE, check, check_attention  # noqa: E402
from cpdispatch.torch import ContextParallelAttention, RankDispatch, varlen_attention  # noqa: E402

MASKS = [{"type": "causal"}, {"type": "full"}, {"type": "sliding_window", "window": 3}, {"type": "sliding_window", "window": 1}]
MASK_IDS = ["causal", "full", "window3", "window1"]
# (query rows, key rows) of each entry: equal, fewer queries, more queries
# (the first rows see no key under causal and window masks), no keys, no
# queries, single rows, longer than a block.
ENTRIES = [(5, 5), (3, 9), (7, 2), (4, 0), (0, 4), (1, 1), (13, 13), (6, 11)]
PAD_Q, PAD_KV = 2, 1  # rows past the last entry: output 0, lse -inf, gradient 0
DIM, DIM_V, SCALE = 8, 6, 0.3


def sees(mask, p, t):
    """Section 2d's table: the query at position p sees the key at t."""
    if mask["type"] == "full":
        return torch.ones(torch.broadcast_shapes(p.shape, t.shape), dtype=torch.bool)
    seen = t <= p
    if mask["type"] == "sliding_window":
        seen &= t > p - mask["window"]
    return seen


def reference(q, k, v, entries, mask, scale):
    """Dense attention in float64, entry by entry, by positions: an entry's
    last query sits at its last key's position (bottom-right). (out, lse)."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float64)
    q0 = k0 = 0
    for lq, lk in entries:
        p = torch.arange(lq)[:, None] + (lk - lq)
        seen = sees(mask, p, torch.arange(lk)[None, :])
        ke = k[k0:k0 + lk].repeat_interleave(groups, 1)  # query head h reads key-value head h // groups
        ve = v[k0:k0 + lk].repeat_interleave(groups, 1)
        s = torch.einsum("qhd,khd->hqk", q[q0:q0 + lq], ke).mul(scale).masked_fill(~seen, -math.inf)
        rows = seen.any(1).nonzero().flatten() + q0  # rows that see some key; the others keep 0 and -inf
        some = s[:, rows - q0]
        lse[:, rows] = torch.logsumexp(some, -1)
        out[rows] = torch.einsum("hqk,khd->qhd", torch.softmax(some, -1), ve)
        q0, k0 = q0 + lq, k0 + lk
    return out, lse


def layout(entries, pad_q=PAD_Q, pad_kv=PAD_KV):
    cu_q, cu_kv = [0], [0]
    for lq, lk in entries:
        cu_q.append(cu_q[-1] + lq)
        cu_kv.append(cu_kv[-1] + lk)
    return torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_kv, dtype=torch.int32), cu_q[-1] + pad_q, cu_kv[-1] + pad_kv


def inputs(entries, heads, kv_heads, dtype, seed=0):
    cu_q, cu_kv, nq, nk = layout(entries)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(nq, heads, DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(nk, kv_heads, DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(nk, kv_heads, DIM_V, generator=gen, dtype=torch.float64)
    w_out = torch.randn(nq, heads, DIM_V, generator=gen, dtype=torch.float64)
    w_lse = torch.randn(heads, nq, generator=gen, dtype=torch.float64)
    q, k, v = (x.to(dtype).requires_grad_() for x in (q, k, v))
    return q, k, v, cu_q, cu_kv, w_out, w_lse


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("blocks", [(4, 3), (1, 2), (256, 512)], ids=["blocks4x3", "blocks1x2", "default"])
@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
def test_equals_dense_reference(mask, blocks, heads, dtype):
    q, k, v, cu_q, cu_kv, w_out, w_lse = inputs(ENTRIES, *heads, dtype)
    kwargs = {} if blocks == (256, 512) else dict(block_q=blocks[0], block_kv=blocks[1])
    out, lse = varlen_attention(q, k, v, cu_q, cu_kv, None, None, mask, SCALE, return_lse=True, **kwargs)
    assert out.dtype == dtype and lse.dtype == dtype and out.shape == (q.shape[0], heads[0], DIM_V) and lse.shape == (heads[0], q.shape[0])
    ref_out, ref_lse = reference(q, k, v, ENTRIES, mask, SCALE)
    if mask["type"] != "full":
        assert ref_lse.isinf().any(dim=0)[:cu_q[-1]].any(), "the layout should have rows that see no key"
    assert ref_lse[:, cu_q[-1]:].isinf().all() and torch.isfinite(ref_out).all()
    check_attention((out, lse), (ref_out, ref_lse), (q, k, v), (w_out, w_lse), (TOLERANCE[dtype],) * 3, dtype)


def test_bfloat16_accumulates_in_float32():
    mask = {"type": "causal"}
    q, k, v, cu_q, cu_kv, w_out, w_lse = inputs(ENTRIES, 4, 2, torch.bfloat16)
    out, lse = varlen_attention(q, k, v, cu_q, cu_kv, None, None, mask, SCALE, block_q=4, block_kv=3, return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref_out, ref_lse = reference(q, k, v, ENTRIES, mask, SCALE)
    # lse from bfloat16 inputs, summed in float32
    check_attention((out, lse), (ref_out, ref_lse), (q, k, v), (w_out, w_lse), (2e-2, 1e-5, 5e-2), torch.bfloat16)


@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
def test_visits_exactly_the_key_blocks_the_mask_leaves_visible(mask):
    # Each (query block, key block) pair the kernel computes holds a pair the
    # mask allows, and every allowed pair lies in one it computes.
    from cpdispatch.torch import _entries, _Problem, attention_mask

    entries = [(37, 37), (5, 40), (40, 5), (1, 0)]
    q, k, v, cu_q, cu_kv, _, _ = inputs(entries, 1, 1, torch.float64)
    seen = attention_mask(cu_q, cu_kv, mask)
    problem = _Problem(q, k, v, _entries(cu_q, cu_kv, q.shape[0], k.shape[0], mask), None, 8, 6)
    covered = torch.zeros_like(seen)
    for r0, r1, visits in problem.blocks:
        for _, c0, c1 in visits:
            assert seen[r0:r1, c0:c1].any(), (r0, c0)
            covered[r0:r1, c0:c1] = True
    assert not (seen & ~covered).any()


def test_bad_input_raises():
    q, k, v, cu_q, cu_kv, _, _ = inputs([(4, 4)], 3, 2, torch.float64)
    with pytest.raises(ValueError, match="multiple of the heads"):
        varlen_attention(q, k, v, cu_q, cu_kv)
    q, k, v, cu_q, cu_kv, _, _ = inputs([(4, 4)], 2, 1, torch.float64)
    with pytest.raises(ValueError, match="block_q = 0"):
        varlen_attention(q, k, v, cu_q, cu_kv, block_q=0)
    with pytest.raises(ValueError, match=r"cu_seqlens_kv must start at 0, never decrease and end at most at 5 rows: cu_seqlens_kv\[1\] = 99"):
        varlen_attention(q, k, v, cu_q, torch.tensor([0, 99]))
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[1\] = 99"):
        varlen_attention(q, k, v, torch.tensor([0, 99]), cu_kv)
    with pytest.raises(ValueError, match=r"mask: unknown key \"window\" \(a causal mask has \"type\"\)"):
        varlen_attention(q, k, v, cu_q, cu_kv, mask={"type": "causal", "window": 3})
    with pytest.raises(ValueError, match="the same number"):
        varlen_attention(q, k, v, cu_q, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="unknown mask"):
        varlen_attention(q, k, v, cu_q, cu_kv, mask={"type": "diagonal"})
    for window in (None, 0, 2.0):
        with pytest.raises(ValueError, match='mask.window|mask: a sliding_window mask needs "window"'):
            varlen_attention(q, k, v, cu_q, cu_kv, mask={"type": "sliding_window", "window": window})


def test_context_parallel_attention_takes_gqa_and_a_users_kernel():
    # One rank, no process group: two documents, the first in two shards.
    plan = {"world_size": 1, "ranks": [{"docs": [{"shard_len": [5, 3], "dst": [0, 0]}, {"shard_len": [4], "dst": [0]}]}]}
    dispatch = RankDispatch(plan)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(12, 4, DIM, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(12, 2, DIM, generator=gen, dtype=torch.float64) for _ in range(2))
    calls = []

    def kernel(*args):
        calls.append(args)
        return varlen_attention(*args, block_q=2, block_kv=2)

    default = ContextParallelAttention(softmax_scale=SCALE)(q, k, v, dispatch)
    users = ContextParallelAttention(softmax_scale=SCALE, kernel=kernel)(q, k, v, dispatch)
    assert len(calls) == 1 and len(calls[0]) == 9 and calls[0][7] == {"type": "causal"} and calls[0][8] == SCALE
    want = torch.cat([reference(q[a:b], k[a:b], v[a:b], [(b - a, b - a)], {"type": "causal"}, SCALE)[0] for a, b in ((0, 8), (8, 12))])
    check(default, want, 1e-12, "default kernel")
    check(users, want, 1e-12, "user's kernel")


def test_without_a_scale_the_scores_are_scaled_by_one_over_the_square_root_of_the_head_dimension():
    # DIM = 8: the scale is 8 ** -0.5, about 0.354, whatever SCALE the other tests pass.
    mask = {"type": "causal"}
    q, k, v, cu_q, cu_kv, w_out, w_lse = inputs(ENTRIES, 4, 2, torch.float64)
    got = varlen_attention(q, k, v, cu_q, cu_kv, None, None, mask, block_q=4, block_kv=3, return_lse=True)
    check_attention(got, reference(q, k, v, ENTRIES, mask, 1 / math.sqrt(DIM)), (q, k, v), (w_out, w_lse), (TOLERANCE[torch.float64],) * 3,
                    torch.float64)
    # The op's default kernel takes the same default: one rank, two documents, the first in two shards.
    plan = {"world_size": 1, "ranks": [{"docs": [{"shard_len": [5, 3], "dst": [0, 0]}, {"shard_len": [4], "dst": [0]}]}]}
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(12, 4, DIM, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(12, 2, DIM, generator=gen, dtype=torch.float64) for _ in range(2))
    out = ContextParallelAttention()(q, k, v, RankDispatch(plan))
    want = torch.cat([reference(q[a:b], k[a:b], v[a:b], [(b - a, b - a)], mask, DIM ** -0.5)[0] for a, b in ((0, 8), (8, 12))])
    check(out, want, 1e-12, "default scale")
    unscaled = torch.cat([reference(q[a:b], k[a:b], v[a:b], [(b - a, b - a)], mask, 1.0)[0] for a, b in ((0, 8), (8, 12))])
    assert (out - unscaled).abs().max() > 1e-3, "the inputs should tell the default scale from 1"


def test_memory_is_bounded_by_the_blocks_not_the_sequence():
    # One causal document of 16K tokens: a dense score matrix alone would be
    # 1 GiB in float32. Forward and backward must stay within 256 MiB beyond
    # the inputs (outputs and gradients included), in a fresh process so
    # that its peak is this call's.
    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "python", "attention_memory.py")
    one_thread = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")  # BLAS threads fight other tests for the cores
    run = subprocess.run([sys.executable, script, "--tokens", "16384", "--heads", "1", "--dim", "64", "--threads", "1"],
                         capture_output=True, text=True, timeout=240, check=False, env=one_thread)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    print(result)
    assert math.isfinite(result["checksum"]) and result["checksum"] > 0
    assert 0 < result["peak_delta_mib"] < 256, result
