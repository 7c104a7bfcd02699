"""The comparison of an attention result with its double-precision
reference, shared by the kernel tests: the output, the log-sum-exp, and the
gradients of q, k and v through a loss that reaches both."""

import torch

TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-5}


def loss(out, lse, w_out, w_lse):
    """Through the output and the finite lse values (so lse's gradient is checked too)."""
    return (out.double() * w_out).sum() + (lse.double().masked_fill(lse.isinf(), 0.0) * w_lse).sum()


def check(got, want, tol, what):
    assert not got.isnan().any(), f"{what}: NaN"
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def check_attention(got, want, qkv, weights, tol, dtype):
    """got and want are (out, lse); tol is (out, lse, gradients). The
    gradients of qkv through loss() must match and keep `dtype`."""
    (out, lse), (ref_out, ref_lse), (w_out, w_lse) = got, want, weights
    check(out, ref_out, tol[0], "out")
    check(lse, ref_lse, tol[1], "lse")
    grads = torch.autograd.grad(loss(out, lse, w_out, w_lse), qkv)
    ref_grads = torch.autograd.grad(loss(ref_out, ref_lse, w_out, w_lse), qkv)
    for name, g, w in zip("qkv", grads, ref_grads):
        assert g.dtype == dtype
        check(g, w, tol[2], f"d{name}")
