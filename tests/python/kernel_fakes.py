"""Stand-ins for the kernels this PyTorch (1.13, CPU) lacks, with the real
signatures: flash-attention 2's flash_attn_varlen_func and
flash_attn.flash_attn_interface._flash_attn_varlen_backward, and PyTorch 2's
torch.nn.functional.scaled_dot_product_attention. Each records its calls
and computes densely by the semantics the real one documents (its own mask
convention, not ours), so an adapter that maps the plan's mask wrongly
gets a wrong result."""

import sys
import types

import torch

CALLS = []  # (kernel, dict of the arguments that the adapters choose)


def _visible(lq, lk, causal, window):
    """flash-attention's mask: row i sees keys i + lk - lq - left .. i + lk - lq + right (-1: no bound); causal sets right = 0."""
    left, right = window
    right = 0 if causal else right
    i = torch.arange(lq)[:, None]
    j = torch.arange(lk)[None, :]
    seen = torch.ones(lq, lk, dtype=torch.bool)
    if left >= 0:
        seen &= j >= i + lk - lq - left
    if right >= 0:
        seen &= j <= i + lk - lq + right
    return seen


def _entries(cu_q, cu_k, max_q, max_k):
    assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32, (cu_q.dtype, cu_k.dtype)
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    lengths = [(b - a, d - c) for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:])]
    assert all(lq <= max_q and lk <= max_k for lq, lk in lengths), (lengths, max_q, max_k)  # a real kernel sizes its tiles by them
    return [(a, lq, c, lk) for (a, c), (lq, lk) in zip(zip(cu_q, cu_k), lengths)]


def _scores(q, k, scale, seen):
    groups = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(groups, 1)) * scale
    return s.masked_fill(~seen, float("-inf"))


def _like_flash(cu_seqlens_q):
    """flash-attention's own refusal of a batch without sequences."""
    if cu_seqlens_q.numel() < 2:
        raise RuntimeError("batch size must be positive")


def _flash_window(window, max_seqlen_k):
    """flash-attention's normalisation: a bound >= max_seqlen_k means no bound (-1)."""
    return tuple(-1 if w >= max_seqlen_k else w for w in window)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                           causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    CALLS.append(("flash_attn_varlen_func", dict(causal=causal, window_size=tuple(window_size), softmax_scale=softmax_scale,
                                                 cu_seqlens_q=cu_seqlens_q.tolist(), cu_seqlens_k=cu_seqlens_k.tolist(),
                                                 return_attn_probs=return_attn_probs, dropout_p=dropout_p)))
    _like_flash(cu_seqlens_q)
    window_size = _flash_window(window_size, max_seqlen_k)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    outs, lses = [], []
    for a, lq, c, lk in _entries(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        s = _scores(q[a:a + lq], k[c:c + lk], scale, _visible(lq, lk, causal, window_size))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])  # a row without keys: 0
        groups = q.shape[1] // v.shape[1]
        outs.append(torch.einsum("hqk,khd->qhd", p, v[c:c + lk].repeat_interleave(groups, 1)))
        lses.append(lse.masked_fill(lse == float("-inf"), float("inf")))  # flash-attention marks a row without keys +inf
    # without entries still an output autograd sees, as the real one's
    out = torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], v.shape[2]) + q[:0].sum() + k[:0].sum() + v[:0].sum()
    lse = torch.cat(lses, 1) if lses else q.new_zeros(q.shape[1], 0)
    return (out, lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32), None) if return_attn_probs else out


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
                                deterministic, rng_state=None):
    CALLS.append(("_flash_attn_varlen_backward", dict(causal=causal, window_size=(window_size_left, window_size_right),
                                                      softmax_scale=softmax_scale, deterministic=deterministic)))
    _like_flash(cu_seqlens_q)
    window_size_left, window_size_right = _flash_window((window_size_left, window_size_right), max_seqlen_k)
    groups = q.shape[1] // k.shape[1]
    for a, lq, c, lk in _entries(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        qe, ke, ve = q[a:a + lq], k[c:c + lk].repeat_interleave(groups, 1), v[c:c + lk].repeat_interleave(groups, 1)
        s = _scores(qe, k[c:c + lk], softmax_scale, _visible(lq, lk, causal, (window_size_left, window_size_right)))
        p = torch.exp(s - softmax_lse[:, a:a + lq, None])  # the given lse; +inf (no keys) gives 0
        do = dout[a:a + lq]
        d = (do * out[a:a + lq]).sum(-1).t()  # [heads, lq]
        ds = p * (torch.einsum("qhd,khd->hqk", do, ve) - d[..., None])
        dq[a:a + lq] = torch.einsum("hqk,khd->qhd", ds, ke) * softmax_scale
        dk[c:c + lk] = (torch.einsum("hqk,qhd->khd", ds, qe) * softmax_scale).reshape(lk, k.shape[1], groups, -1).sum(2)
        dv[c:c + lk] = torch.einsum("hqk,qhd->khd", p, do).reshape(lk, v.shape[1], groups, -1).sum(2)
    return torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)


def install_flash(setitem=sys.modules.__setitem__, backward=True):
    """Puts a flash_attn package with the stand-ins into sys.modules (``setitem``: a monkeypatch's in tests)."""
    package = types.ModuleType("flash_attn")
    package.flash_attn_varlen_func = flash_attn_varlen_func
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface.flash_attn_varlen_func = flash_attn_varlen_func
    if backward:
        interface._flash_attn_varlen_backward = _flash_attn_varlen_backward
    package.flash_attn_interface = interface
    setitem("flash_attn", package)
    setitem("flash_attn.flash_attn_interface", interface)
    return package


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    """PyTorch's documented semantics: is_causal is a top-left lower triangle; a bool attn_mask marks what takes part."""
    CALLS.append(("scaled_dot_product_attention", dict(is_causal=is_causal, attn_mask=None if attn_mask is None else attn_mask.clone(),
                                                       scale=scale, dropout_p=dropout_p, shape=(tuple(query.shape), tuple(key.shape)))))
    assert query.shape[:-2] == key.shape[:-2] == value.shape[:-2], "no implicit grouped-query broadcast without enable_gqa"
    assert not (is_causal and attn_mask is not None)
    s = query @ key.transpose(-2, -1) * (scale if scale is not None else query.shape[-1] ** -0.5)
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf"))
    return torch.softmax(s, -1) @ value


def install_sdpa(setattr_=setattr):
    """Puts the stand-in at torch.nn.functional.scaled_dot_product_attention (``setattr_``: monkeypatch.setattr in tests)."""
    setattr_(torch.nn.functional, "scaled_dot_product_attention", scaled_dot_product_attention)
