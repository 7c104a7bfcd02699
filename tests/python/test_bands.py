"""The kernels on entries with bands (docs/plan-format.md section 2e): a
list of (q_start, q_len, kv_start, kv_len, lo, hi), query row j seeing key
row t when lo <= t - j <= hi, that may share query rows (one softmax per
row over all its entries) and key rows (gradients add up). Against dense
float64 attention whose mask is built from the documents' slices (shared
prefix, block causal, prefix-LM, inverse and bi-causal) or, for random
bands, pair by pair: the blockwise kernel forward and backward (output,
lse, gradients of q, k, v), every block size, MHA and GQA, float64 and
float32, bitwise reproducible; parts of entries merged by log-sum-exp (as
stages > 1 cut them) for the blockwise and flash-attention adapters; the
flash-attention and sdpa adapters' one-call path."""

import random
import sys

import pytest

from conftest import require

torch = require("torch")
require("cpdispatch")

import kernel_fakes  # noqa: E402
import cpdispatch  # noqa: E402
from cpdispatch.torch import BlockwiseKernel, FlashAttnVarlenKernel, SdpaKernel, _merge, _row_disjoint, varlen_attention  # noqa: E402
from attention_checks import TOLERANCE, check_attention, loss  # noqa: E402
from slice_masks import EXAMPLES, band, masked_attention, slice_mask  # noqa: E402

HEADS, DIM, DIM_V, SCALE = 4, 5, 3, 0.4


def shift(lo, hi, s):
    return (None if lo is None else lo + s), (None if hi is None else hi + s)


def random_grid(rng, lq, lk, q0, k0):
    """Entries over an lq x lk rectangle at (q0, k0): its columns cut into
    ranges, each one's rows cut into ranges of their own, most cells an
    entry with a random band that cuts it (open ends too), so entries share
    rows (in part) and columns but no pair. Some cells
    are left out and some bands show a cell nothing: rows that see no key."""
    def cut(n, parts):
        points = sorted(rng.sample(range(1, n), min(n - 1, parts - 1)))
        return list(zip([0] + points, points + [n]))

    entries = []
    for c, d in cut(lk, 4):
        for a, b in cut(lq, 3):  # each column range cuts the rows its own way: entries share rows in part
            if rng.random() < 0.2:
                continue
            lowest, highest = (k0 + c) - (q0 + b - 1), (k0 + d - 1) - (q0 + a)  # t - j over the cell
            lo, hi = sorted(rng.randint(lowest - 1, highest + 1) for _ in range(2))
            kind = rng.randrange(4)
            entries.append((q0 + a, b - a, k0 + c, d - c, lo if kind & 1 else None, hi if kind & 2 else None))
    return entries


def layout(names, seed=0):
    """(entries, dense mask [queries, keys], queries, keys): each named
    document one query shard against its whole document of keys (its slices
    as entries, bands moved to the buffers' rows), then random grids, one
    of which reads the keys of the one before; a spare key row between
    groups (so the bands move by different amounts) and spare rows at the
    ends that nothing sees."""
    rng = random.Random(seed)
    entries, grids, blocks, q0, k0 = [], [], [], 0, 0
    for name in names:
        if name == "random":
            first = k0
            for lq, lk, reuse in ((5, 7, False), (6, 7, True), (9, 4, False)):
                grids += random_grid(rng, lq, lk, q0, first if reuse else k0)
                q0 += lq
                k0 += 0 if reuse else lk + 1
            continue
        length, slices = EXAMPLES[name]
        for s in slices:
            (qa, qb), (ka, kb) = s["q"], s["k"]
            entries.append((q0 + qa, qb - qa, k0 + ka, kb - ka) + shift(*band(s), k0 - q0))
        blocks.append((q0, k0, slice_mask(length, slices)))
        q0, k0 = q0 + length, k0 + length + 1
    queries, keys = q0 + 2, k0 + 1
    seen = torch.zeros(queries, keys, dtype=torch.bool)
    for a, c, m in blocks:
        seen[a:a + m.shape[0], c:c + m.shape[1]] = m
    for qs, lq, ks, lk, lo, hi in grids:  # the random bands are their own definition: pair by pair
        for j in range(qs, qs + lq):
            for t in range(ks, ks + lk):
                if (lo is None or t - j >= lo) and (hi is None or t - j <= hi):
                    assert not seen[j, t], "random entries that share a pair"
                    seen[j, t] = True
    return entries + grids, seen, queries, keys


def inputs(queries, keys, heads_kv, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(queries, HEADS, DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(keys, heads_kv, DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(keys, heads_kv, DIM_V, generator=gen, dtype=torch.float64)
    w_out = torch.randn(queries, HEADS, DIM_V, generator=gen, dtype=torch.float64)
    w_lse = torch.randn(HEADS, queries, generator=gen, dtype=torch.float64)
    return [x.to(dtype).requires_grad_() for x in (q, k, v)], w_out, w_lse


def against_reference(names, blocks, heads_kv, dtype, seed=0):
    entries, seen, queries, keys = layout(names, seed)
    (q, k, v), w_out, w_lse = inputs(queries, keys, heads_kv, dtype, seed)
    if len(names) > 1:
        assert any(sum(f[0] <= e[0] < f[0] + f[1] for f in entries) > 1 for e in entries), "no entries share query rows"
    kwargs = {} if blocks is None else dict(block_q=blocks[0], block_kv=blocks[1])
    out, lse = varlen_attention(q, k, v, entries=entries, softmax_scale=SCALE, return_lse=True, **kwargs)
    ref_out, ref_lse = masked_attention(q.double(), k.double(), v.double(), seen, SCALE)
    if len(names) > 1:
        assert ref_lse[0, :queries - 2].isinf().any(), "the layout should have rows that see no key"
    check_attention((out, lse), (ref_out, ref_lse), (q, k, v), (w_out, w_lse), (TOLERANCE[dtype],) * 3, dtype)


LAYOUTS = [[name] for name in EXAMPLES] + [["random"], list(EXAMPLES) + ["random"]]
LAYOUT_IDS = list(EXAMPLES) + ["random", "all"]


@pytest.mark.parametrize("blocks", [(4, 3), (1, 2), None], ids=["blocks4x3", "blocks1x2", "default"])
@pytest.mark.parametrize("names", LAYOUTS, ids=LAYOUT_IDS)
def test_blockwise_band_entries_equal_dense_slice_attention(names, blocks):
    against_reference(names, blocks, 2, torch.float64)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("heads_kv", [4, 1], ids=["mha", "mqa"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_blockwise_random_bands_every_dtype_and_head_layout(dtype, heads_kv, seed):
    against_reference(list(EXAMPLES) + ["random"], (3, 2), heads_kv, dtype, seed)


def test_blockwise_band_entries_are_bitwise_reproducible_and_order_free():
    # The same entries twice: the same bytes. The entries in another order:
    # the same result (each row's softmax folds the same keys, in another order).
    entries, _, queries, keys = layout(list(EXAMPLES) + ["random"], seed=5)
    (q, k, v), w_out, w_lse = inputs(queries, keys, 2, torch.float64, seed=5)

    def run(order):
        out, lse = varlen_attention(q, k, v, entries=order, softmax_scale=SCALE, return_lse=True, block_q=3, block_kv=4)
        return [out, lse] + list(torch.autograd.grad(loss(out, lse, w_out, w_lse), (q, k, v)))

    first, second = run(entries), run(list(entries))
    for a, b in zip(first, second):
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    shuffled = list(entries)
    random.Random(1).shuffle(shuffled)
    for a, b in zip(first, run(shuffled)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_band_that_shows_nothing_and_bad_bands():
    q, k, v = (torch.randn(4, 1, 2, dtype=torch.float64) for _ in range(3))
    out, lse = varlen_attention(q, k, v, entries=[(0, 4, 0, 4, 5, None), (0, 4, 0, 4, 2, 1)], return_lse=True)
    assert not out.any() and lse.isinf().all()
    for bad in ((0, 4, 0, 4, 0), (0, 4, 0, 4, 0.5, None), (0, 4, 0, 4, None, True), (0, 5, 0, 4, None, None)):
        with pytest.raises(ValueError, match="a part"):
            varlen_attention(q, k, v, entries=[bad])
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_kv, or entries"):
        varlen_attention(q, k, v)


# ---- parts merged by lse, and the other adapters, through the stand-ins of kernel_fakes.py


def runs_of(entries, cuts):
    """Each entry's keys cut at ``cuts`` (fractions) into runs with the
    entry's band (buffer rows: a run keeps it): [the first runs, the second runs, ...]."""
    passes = []
    for q0, lq, k0, lk, lo, hi in entries:
        bounds = sorted({0, lk} | {int(lk * c) for c in cuts})
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            if i == len(passes):
                passes.append([])
            passes[i].append((q0, lq, k0 + a, b - a, lo, hi))
    return passes


def whole(q, k, v, entries, w):
    """(out, lse, dq, dk, dv) of (out * w).sum() through the blockwise kernel's autograd."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out, lse = varlen_attention(q, k, v, entries=entries, softmax_scale=SCALE, return_lse=True)
    (out * w).sum().backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("split", ["one_call", "passes"])
@pytest.mark.parametrize("name", ["blockwise", "flash_attn_varlen"])
def test_parts_of_band_entries_merge_into_whole_attention(fakes, name, split):
    # Every entry's keys in three runs. One call with all of them, or one
    # call per run (the first runs of every entry, then the second, ...),
    # merged by log-sum-exp: the output and lse of whole attention; each
    # call's backward with the MERGED output and lse sums to the whole
    # gradient. Parts share query rows within a call (flash's adapter then
    # merges passes of its own).
    kernel = BlockwiseKernel(block_q=2, block_kv=3) if name == "blockwise" else FlashAttnVarlenKernel()
    entries, _, queries, keys = layout(list(EXAMPLES) + ["random"], seed=2)
    (q, k, v), w, _ = inputs(queries, keys, 2, torch.float64, seed=2)
    q, k, v = (x.detach() for x in (q, k, v))
    want_out, want_lse, *want_grads = whole(q, k, v, entries, w)
    runs = runs_of(entries, (0.3, 0.7))
    assert len(runs) == 3
    calls = [[p for run in runs for p in run]] if split == "one_call" else runs
    out = torch.zeros(queries, HEADS, DIM_V, dtype=torch.float64)
    lse = torch.full((HEADS, queries), float("-inf"), dtype=torch.float64)
    for call in calls:
        _merge(out, lse, *kernel.forward(q, k, v, call, SCALE))
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    grads = [torch.zeros_like(x) for x in (q, k, v)]
    for call in calls:
        for total, g in zip(grads, kernel.backward(q, k, v, out, lse, w, call, SCALE)):
            total += g
    for g, x, n in zip(grads, want_grads, "qkv"):
        torch.testing.assert_close(g, x, rtol=1e-12, atol=1e-12, msg=lambda m, n=n: f"d{n}: {m}")
    if name == "flash_attn_varlen":
        windows = {(c["causal"], c["window_size"]) for _, c in fakes}
        assert all(left >= -1 and right >= -1 for _, (left, right) in windows), windows  # only -1 means no bound
        assert any(right == -1 and left >= 0 for _, (left, right) in windows), "no inv_causal band (open right end) reached flash"
        assert any(right > 0 for _, (_, right) in windows) and any(causal for causal, _ in windows), windows


@pytest.mark.parametrize("name", ["blockwise", "flash_attn_varlen", "sdpa"])
def test_adapters_take_entries_in_one_differentiable_call(fakes, name):
    # What ContextParallelAttention(stages=1) calls on a plan with slices:
    # kernel(q, k, v, cu_seqlens_q, cu_seqlens_kv, ..., entries=...), the
    # entries inside their query shard and KV group (sdpa masks per shard).
    kernel = {"blockwise": BlockwiseKernel(block_q=3, block_kv=2), "flash_attn_varlen": FlashAttnVarlenKernel(), "sdpa": SdpaKernel()}[name]
    names = list(EXAMPLES)
    entries, _, queries, keys = layout(names, seed=3)
    cu_q, cu_kv = [0], [0]
    for n in names:
        length = EXAMPLES[n][0]
        cu_q.append(cu_q[-1] + length)
        cu_kv.append(cu_kv[-1] + length + 1)  # the spare key row ends each group
    (q, k, v), w, _ = inputs(queries, keys, 2, torch.float64, seed=3)
    want_out, _, *want_grads = whole(q, k, v, entries, w)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = kernel(q, k, v, torch.tensor(cu_q), torch.tensor(cu_kv), None, None, {"type": "causal"}, SCALE, entries=entries)
    (out * w).sum().backward()
    for g, x, n in zip((out, q.grad, k.grad, v.grad), [want_out] + want_grads, ("out", "dq", "dk", "dv")):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, x, rtol=1e-12, atol=1e-12, msg=lambda m, n=n: f"{n}: {m}")
    if name == "sdpa":
        masks = [c["attn_mask"] for _, c in fakes]
        assert masks and all(m is not None and m.dim() == 4 for m in masks)


def test_flash_without_the_merged_backward_takes_entries_that_share_no_row(fakes, monkeypatch):
    # flash-attn before 2.7: one autograd call of flash_attn_varlen_func per
    # window serves entries with a row each; entries that share rows would
    # need the merge by lse, whose backward it lacks: a clear error.
    kernel_fakes.install_flash(lambda name, module: monkeypatch.setitem(sys.modules, name, module), backward=False)
    kernel = FlashAttnVarlenKernel()
    assert not kernel.staged
    entries, _, queries, keys = layout(["random"], seed=4)
    (q, k, v), w, _ = inputs(queries, keys, 2, torch.float64, seed=4)
    disjoint = [e for i, e in enumerate(entries) if not any(f[0] < e[0] + e[1] and e[0] < f[0] + f[1] for f in entries[:i])]
    want_out, _, *want_grads = whole(q, k, v, disjoint, w)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = kernel(q, k, v, None, None, entries=disjoint, softmax_scale=SCALE)
    (out * w).sum().backward()
    for g, x in zip((out, q.grad, k.grad, v.grad), [want_out] + want_grads):
        torch.testing.assert_close(g, x, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="share query rows .* flash-attn 2.7"):
        kernel(q, k, v, None, None, entries=entries, softmax_scale=SCALE)


def test_flash_passes_are_the_ops_cut_by_query_rows():
    # Each entry to the first pass free at its first row, as the op cuts a
    # kernel's passes: [2, 6) and [6, 9) touch and share a pass; row 5 has
    # three entries, so three passes.
    parts = [(2, 4, 0, 1, None, None), (0, 9, 1, 1, None, None), (6, 3, 2, 1, None, None), (4, 2, 3, 1, None, None), (9, 1, 4, 1, None, None)]
    assert cpdispatch._cpdispatch.query_row_passes(parts) == [1, 0, 1, 2, 0]
    assert _row_disjoint(parts) == [[parts[1], parts[4]], [parts[0], parts[2]], [parts[3]]]
    assert cpdispatch._cpdispatch.query_row_passes([]) == []
