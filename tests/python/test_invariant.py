"""ContextParallelAttention(invariant=True) and BlockwiseKernel(invariant=True):
out, dq, dk and dv bitwise the same on 1 to 4 processes (gloo), for
balanced and random placements, every mask and documents with slices,
dedup off and on, 1 to 3 stages and kernel threads, float32 and bfloat16, and equal to the kernel's
own invariant run over the whole packed batch, which is checked against
float64 attention over whole documents; a plan cut off the grid is refused
on every rank."""

import pytest

from conftest import require

torch = require("torch")
require("cpdispatch")

import workers  # after the requires: it imports torch and cpdispatch
import invariant_worker as iw
from cpdispatch.torch import BlockwiseKernel, ContextParallelAttention, RankDispatch, varlen_attention

WORLDS = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return workers.outcomes(tmp_path_factory, iw.run, "invariant")


def whole_batch(dtype, mask, double=False):
    """out, dq, dk, dv of the whole packed batch in one call: the invariant
    kernel's, or float64 attention's; mask None: the slice documents."""
    q, k, v, w = iw.inputs(dtype)
    if double:
        q, k, v, w = (x.double() for x in (q, k, v, w))
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    cu = torch.tensor(iw.CU_SEQLENS)
    entries = iw.slice_entries() if mask is None else None
    if double:
        out = varlen_attention(q, k, v, cu, cu, mask=mask, softmax_scale=iw.SCALE, entries=entries)
    else:
        out = BlockwiseKernel(invariant=True, grid=iw.GRID)(q, k, v, cu, cu, mask=mask, softmax_scale=iw.SCALE, entries=entries)
    (out.float() * w.float()).sum().backward() if not double else (out * w).sum().backward()
    return [x.detach() for x in (out, q.grad, k.grad, v.grad)]


@pytest.mark.parametrize("mask", iw.MASKS + [None], ids=lambda m: m["type"] if m else "slices")
def test_the_kernel_on_the_whole_batch_is_attention(mask):
    got, want = whole_batch(torch.float32, mask), whole_batch(torch.float32, mask, double=True)
    for name, g, x in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(g).all(), f"{name} has a NaN or infinity"
        torch.testing.assert_close(g.double(), x, rtol=1e-4, atol=2e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("world", WORLDS)
def test_every_world_size_gives_the_bits_of_one_call(outcomes, world):
    results = outcomes(world)
    failures = workers.errors(results)
    assert not failures, workers.report(failures)
    expected = {}
    for case in results[0]:
        if case == "off grid":
            continue
        words = case.split(" ")
        dtype = torch.bfloat16 if words[-1] == "bfloat16" else torch.float32
        mask = next((m for m in iw.MASKS if m["type"] == words[1]), None)  # "slices": None
        if (dtype, words[1]) not in expected:
            expected[(dtype, words[1])] = [iw._hex(x) for x in whole_batch(dtype, mask)]
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            got = "".join(rank[case][name] for rank in results)  # rank r holds the r-th cut of the packed batch
            assert got == expected[(dtype, words[1])][i], f"{case}: {name} differs from the one-call run at W = {world}"


@pytest.mark.parametrize("world", WORLDS)
def test_a_cut_off_the_grid_is_refused_on_every_rank(outcomes, world):
    refusals = [rank["off grid"].get("refused") for rank in outcomes(world)]
    assert all(refusals), refusals
    assert any("packed position 45, off the grid of 8 tokens" in r for r in refusals), refusals


def test_kernels_without_the_mode_are_refused():
    with pytest.raises(ValueError, match="invariant=True needs a kernel with the invariant mode.*'sdpa'"):
        ContextParallelAttention(kernel="sdpa", invariant=True)


def test_other_dtypes_are_refused_before_any_exchange():
    q, k, v, _ = iw.inputs(torch.float64)
    cu = torch.tensor(iw.CU_SEQLENS)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16 tensors; q is torch.float64"):
        BlockwiseKernel(invariant=True)(q, k, v, cu, cu)
    plan = iw.plan_of(1, iw.MASKS[0], "balanced", 0)
    dispatch = RankDispatch(plan)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16 tensors; q is torch.float64"):
        ContextParallelAttention(invariant=True, grid=iw.GRID)(q, k, v, dispatch)
    assert not dispatch._invariant_layouts, "refused before the layout (a collective) was made"


def test_a_nan_is_an_error_not_a_result():
    q, k, v, _ = iw.inputs()
    q[3, 1, 2] = float("nan")
    cu = torch.tensor(iw.CU_SEQLENS)
    with pytest.raises(ValueError, match="invariant"):
        BlockwiseKernel(invariant=True, grid=iw.GRID)(q, k, v, cu, cu)
