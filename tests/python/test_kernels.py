"""The kernel adapters of cpdispatch.torch on one process: "blockwise",
"flash_attn_varlen" and "sdpa" against varlen_attention (float64), the two
missing kernels through stand-ins with the real signatures
(kernel_fakes.py): the mask each adapter hands its kernel, that parts of
entries (a run of each entry's keys, as stages > 1 cut them) merge by their
log-sum-exps into whole attention and that each part's backward with the
merged output and lse sums to the whole gradient; and the errors."""

import functools
import sys

import pytest

from conftest import require

torch = require("torch")
require("cpdispatch")

import kernel_fakes  # noqa: E402
from cpdispatch.torch import (BlockwiseKernel, ContextParallelAttention, FlashAttnVarlenKernel, SdpaKernel, _merge,  # noqa: E402
                              varlen_attention)

MASKS = [{"type": "causal"}, {"type": "full"}, {"type": "sliding_window", "window": 3}, {"type": "sliding_window", "window": 1}]
MASK_IDS = ["causal", "full", "window3", "window1"]
# (query rows, key rows): square, fewer and more queries than keys (under
# causal and window masks the first rows of (7, 2) see no key), no keys.
ENTRIES = [(5, 5), (3, 9), (7, 2), (6, 11), (4, 0), (13, 13), (1, 1)]
HEADS, HEADS_KV, DIM, DIM_V, SCALE = 4, 2, 5, 3, 0.4
TIGHT = dict(rtol=1e-12, atol=1e-12)


def inputs(entries, seed=0):
    gen = torch.Generator().manual_seed(seed)
    nq, nk = sum(lq for lq, _ in entries), sum(lk for _, lk in entries)
    q = torch.randn(nq, HEADS, DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(nk, HEADS_KV, DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(nk, HEADS_KV, DIM_V, generator=gen, dtype=torch.float64)
    w = torch.randn(nq, HEADS, DIM_V, generator=gen, dtype=torch.float64)
    cu_q = torch.tensor([0] + [lq for lq, _ in entries]).cumsum(0)
    cu_kv = torch.tensor([0] + [lk for _, lk in entries]).cumsum(0)
    return q, k, v, w, cu_q, cu_kv


def whole(q, k, v, w, cu_q, cu_kv, mask, kernel=varlen_attention):
    """(out, grads of q, k, v) of (out * w).sum() through ``kernel``'s autograd."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = kernel(q, k, v, cu_q, cu_kv, None, None, mask, SCALE)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def finite(*tensors):
    for t in tensors:
        assert torch.isfinite(t).all(), "a NaN or infinity where a number belongs"


@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
def test_flash_adapter_maps_the_plans_mask(fakes, mask):
    # Whole entries (stages = 1): causal is causal=True; a window of w is
    # window_size=(w - 1, 0) with causal=True; full is causal=False, (-1, -1).
    q, k, v, w, cu_q, cu_kv = inputs(ENTRIES)
    want = whole(q, k, v, w, cu_q, cu_kv, mask)
    got = whole(q, k, v, w, cu_q, cu_kv, mask, FlashAttnVarlenKernel())
    finite(*got)
    for g, x, name in zip(got, want, ("out", "dq", "dk", "dv")):
        torch.testing.assert_close(g, x, **TIGHT, msg=lambda m, name=name: f"{name}: {m}")
    expected = {"causal": (True, (-1, -1)), "full": (False, (-1, -1)), "sliding_window": (True, (mask.get("window", 0) - 1, 0))}[mask["type"]]
    assert [(c["causal"], c["window_size"]) for _, c in fakes] == [expected]
    assert fakes[0][1]["cu_seqlens_q"] == cu_q.tolist() and fakes[0][1]["softmax_scale"] == SCALE


def band(mask, lq, lk, q0, k0):
    """The plan's mask in an entry of lq x lk rows at q0, k0 as a band on t - j in the buffers' rows (bottom-right)."""
    d = (k0 + lk) - (q0 + lq)
    return {"causal": (None, d), "full": (None, None), "sliding_window": (d + 1 - mask.get("window", 0), d)}[mask["type"]]


def parts_of(entries, cuts, mask):
    """Each entry's keys cut at ``cuts`` (fractions) into runs: the passes
    (k-th run of each entry in pass k) of (q0, lq, k0, lk, lo, hi) parts,
    each with its entry's band (buffer rows: a run keeps it)."""
    passes, q0, k0 = [], 0, 0
    for lq, lk in entries:
        bounds = sorted({0, lk} | {int(lk * c) for c in cuts})
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            if i == len(passes):
                passes.append([])
            passes[i].append((q0, lq, k0 + a, b - a) + band(mask, lq, lk, q0, k0))
        q0, k0 = q0 + lq, k0 + lk
    return passes


@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("name", ["blockwise", "flash_attn_varlen"])
def test_parts_merge_into_whole_attention_and_their_backward_sums_to_its_gradient(fakes, name, mask):
    # The keys of every entry in three runs (a window's first runs end more
    # than w rows before the entry's keys do: rows that see none of them are
    # cut for flash-attention). Forward: the runs' (out, lse) merged by
    # log-sum-exp equal attention over the whole entries. Backward: each
    # run's kernel backward with the MERGED out and lse, summed, equals the
    # whole gradient.
    kernel = BlockwiseKernel(block_q=2, block_kv=3) if name == "blockwise" else FlashAttnVarlenKernel()
    q, k, v, w, cu_q, cu_kv = inputs(ENTRIES, seed=1)
    want_out, *want_grads = whole(q, k, v, w, cu_q, cu_kv, mask)
    want_lse = varlen_attention(q, k, v, cu_q, cu_kv, mask=mask, softmax_scale=SCALE, return_lse=True)[1]
    passes = parts_of(ENTRIES, (0.3, 0.7), mask)
    assert len(passes) == 3
    out = torch.zeros(q.shape[0], HEADS, DIM_V, dtype=torch.float64)
    lse = torch.full((HEADS, q.shape[0]), float("-inf"), dtype=torch.float64)
    for parts in passes:
        _merge(out, lse, *kernel.forward(q, k, v, parts, SCALE))
    torch.testing.assert_close(out, want_out, **TIGHT)
    torch.testing.assert_close(lse, want_lse.double(), **TIGHT)
    grads = [torch.zeros_like(x) for x in (q, k, v)]
    for parts in passes:
        for total, g in zip(grads, kernel.backward(q, k, v, out, lse, w, parts, SCALE)):
            total += g
    finite(out, *grads)
    for g, x, n in zip(grads, want_grads, "qkv"):
        torch.testing.assert_close(g, x, **TIGHT, msg=lambda m, n=n: f"d{n}: {m}")
    if name == "flash_attn_varlen":
        windows = {c["window_size"] for _, c in fakes}
        assert all(left >= 0 for left, _ in windows) if mask["type"] == "sliding_window" else True, windows  # -1 would be no bound
        if mask["type"] == "full" or mask.get("window") == 1:
            assert len(windows) == 1  # a window of 1 key ends at the diagonal, which every part keeps after the cut
        else:
            assert len(windows) > 1, "every part had the whole entry's window: the shifts went untested"


@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
def test_sdpa_adapter_equals_varlen_attention(fakes, mask):
    # Entries of equal shape go in one batched call; PyTorch's is_causal is
    # top-left, so only square causal entries may use it; rows that see no
    # key give 0 (sdpa itself would give nan).
    q, k, v, w, cu_q, cu_kv = inputs(ENTRIES + [(5, 5)], seed=2)
    want = whole(q, k, v, w, cu_q, cu_kv, mask)
    got = whole(q, k, v, w, cu_q, cu_kv, mask, SdpaKernel())
    finite(*got)
    for g, x, name in zip(got, want, ("out", "dq", "dk", "dv")):
        torch.testing.assert_close(g, x, **TIGHT, msg=lambda m, name=name: f"{name}: {m}")
    calls = [c for _, c in fakes]
    assert len(calls) == len({shape for shape in ENTRIES if shape[1]}), "one call per shape"
    for c in calls:
        (_, heads, lq, _), (_, heads_k, lk, _) = c["shape"]
        assert heads == heads_k == HEADS and c["scale"] == SCALE and c["dropout_p"] == 0.0
        assert c["is_causal"] == (mask["type"] == "causal" and lq == lk)
        if c["attn_mask"] is not None:
            assert c["attn_mask"].shape == (lq, lk) and not c["attn_mask"].all() and mask["type"] != "full"
        elif not c["is_causal"]:
            assert mask["type"] == "full" or lq == lk == 1, c


def test_a_named_kernel_that_is_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not importable, whatever this machine has
    with pytest.raises(ImportError, match="kernel 'flash_attn_varlen' needs the flash_attn package"):
        ContextParallelAttention(kernel="flash_attn_varlen")
    monkeypatch.delattr(torch.nn.functional, "scaled_dot_product_attention", raising=False)
    with pytest.raises(ImportError, match=r"kernel 'sdpa' needs torch.nn.functional.scaled_dot_product_attention \(PyTorch 2.1"):
        ContextParallelAttention(kernel="sdpa")


def test_stages_need_a_kernel_with_the_merged_backward(fakes, monkeypatch):
    for kernel in ("blockwise", "flash_attn_varlen", BlockwiseKernel(block_q=4)):
        assert ContextParallelAttention(kernel=kernel, stages=3).stages == 3
    users = [SdpaKernel(), "sdpa", varlen_attention, functools.partial(varlen_attention, block_q=4), lambda *a: varlen_attention(*a)]
    for kernel in users:
        assert ContextParallelAttention(kernel=kernel).stages == 1
        with pytest.raises(ValueError, match="stages = 2 needs a kernel whose forward gives the log-sum-exp"):
            ContextParallelAttention(kernel=kernel, stages=2)
    package = kernel_fakes.install_flash(lambda name, module: monkeypatch.setitem(sys.modules, name, module), backward=False)
    assert ContextParallelAttention(kernel="flash_attn_varlen").stages == 1  # its own backward serves one stage
    with pytest.raises(ValueError, match="'flash_attn_varlen' runs stages = 1 only"):
        ContextParallelAttention(kernel="flash_attn_varlen", stages=2)

    def before_2_7(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size, alibi_slopes, deterministic, rng_state=None):
        raise AssertionError("not to be called")

    package.flash_attn_interface._flash_attn_varlen_backward = before_2_7
    with pytest.raises(ValueError, match="'flash_attn_varlen' runs stages = 1 only"):
        ContextParallelAttention(kernel="flash_attn_varlen", stages=2)


def test_bad_kernel_and_stages_are_refused():
    with pytest.raises(ValueError, match="unknown kernel 'flash'"):
        ContextParallelAttention(kernel="flash")
    with pytest.raises(TypeError, match="a name .* or a callable, not int"):
        ContextParallelAttention(kernel=3)
    for stages in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="stages must be an int of at least 1"):
            ContextParallelAttention(stages=stages)
    q, k, v, _, _, _ = inputs([(3, 3)])
    with pytest.raises(ValueError, match="a part is"):
        BlockwiseKernel().forward(q, k, v, [(0, 3, 1, 3, None, 0)])  # keys past the end
    with pytest.raises(ValueError, match="a part is"):
        BlockwiseKernel().forward(q, k, v, [(0, 3, 0, 3, 0)])  # no band


def test_a_kernel_output_autograd_does_not_see_still_runs_the_backward():
    # A rank without query rows: a kernel may return a fresh empty tensor.
    # The op ties it to q, k and v, so that the backward (and, on several
    # ranks, its collectives) runs with the others, giving zero gradients.
    from cpdispatch.torch import RankDispatch

    dispatch = RankDispatch({"world_size": 1, "ranks": [{"docs": []}]})
    q, k, v, _, _, _ = inputs([])
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = ContextParallelAttention(kernel=lambda q, k, v, *rest: torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype))(q, k, v, dispatch)
    out.sum().backward()
    assert out.shape == (0, HEADS, DIM_V) and q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_flash_backward_behind_a_custom_op_wrapper_still_serves_stages(fakes, monkeypatch):
    # flash-attn >= 2.7 registers its varlen backward as a torch custom op,
    # whose call signature shows only *args, **kwargs; the version decides.
    package = sys.modules["flash_attn"]
    inner = package.flash_attn_interface._flash_attn_varlen_backward

    def wrapped(*args, **kwargs):
        return inner(*args, **kwargs)

    monkeypatch.setattr(package.flash_attn_interface, "_flash_attn_varlen_backward", wrapped)
    monkeypatch.setattr(package, "__version__", "2.7.4.post1", raising=False)
    assert ContextParallelAttention(kernel="flash_attn_varlen", stages=2).stages == 2
    monkeypatch.setattr(package, "__version__", "2.6.3", raising=False)
    with pytest.raises(ValueError, match="'flash_attn_varlen' runs stages = 1 only"):
        ContextParallelAttention(kernel="flash_attn_varlen", stages=2)


def test_flash_adapter_attends_nothing_without_calling_flash_on_a_rank_with_no_entries(fakes):
    # flash-attention refuses a batch of no sequences (the stand-in too); a
    # rank that attends nothing must still return its (empty) output.
    q, k, v = torch.zeros(0, HEADS, DIM), torch.zeros(0, HEADS_KV, DIM), torch.zeros(0, HEADS_KV, DIM_V)
    out = FlashAttnVarlenKernel()(q, k, v, torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 0, 0,
                                  {"type": "causal"}, SCALE)
    assert out.shape == (0, HEADS, DIM_V)
    assert not fakes


def test_explicit_entries_are_checked_by_the_library_and_empty_bands_left_out():
    import cpdispatch
    entries = cpdispatch._cpdispatch.explicit_entries
    # rows 0-1 against columns 0-1: the band 5 <= t - j <= 9 holds no pair of them
    assert entries([(0, 2, 0, 2, 0, None), (0, 2, 0, 2, 5, 9), [1, 1, 0, 2, None, 0]], 2, 2) == [(0, 2, 0, 2, 0, None), (1, 1, 0, 2, None, 0)]
    assert entries([(torch.tensor(0), 2, 0, 2, torch.tensor(-1).item(), 0)], 2, 2) == [(0, 2, 0, 2, -1, 0)]
    with pytest.raises(ValueError, match=r"a part's hi is an int or None \(open\), not 1.5"):
        entries([(0, 2, 0, 2, 0, 1.5)], 2, 2)
    with pytest.raises(ValueError, match="a part's lo is an int or None"):
        entries([(0, 2, 0, 2, True, 0)], 2, 2)
    with pytest.raises(ValueError, match="within 2 query and 2 key rows"):
        entries([(-1, 2, 0, 2, 0, 0)], 2, 2)
