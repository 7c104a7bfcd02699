"""Documents whose masks are slices (docs/plan-format.md section 2e) for the
tests, and their dense masks built from the slices themselves: shared
prefix (a prompt and responses that each see it and themselves), block
causal (frames that see every earlier frame whole), prefix-LM (a
bidirectional prefix before causal text), inverse and bi-causal bands, and
rows that no slice covers."""

import torch


def _slice(qa, qb, ka, kb, kind):
    return {"q": [qa, qb], "k": [ka, kb], "type": kind}


def shared_prefix(prompt, responses, pad=0):
    """A prompt (causal) and responses, each seeing the whole prompt and
    itself causally, not the others; ``pad`` trailing positions see nothing."""
    slices = [_slice(0, prompt, 0, prompt, "causal")]
    start = prompt
    for n in responses:
        slices += [_slice(start, start + n, 0, prompt, "full"), _slice(start, start + n, start, start + n, "causal")]
        start += n
    return start + pad, slices


def block_causal(frames):
    """Frames that see every earlier frame and themselves whole."""
    slices, start = [], 0
    for n in frames:
        slices.append(_slice(start, start + n, 0, start + n, "full"))
        start += n
    return start, slices


def prefix_lm(prefix, text):
    """A bidirectional prefix, then causal text: every query sees the whole
    prefix (one slice over all rows), the text also itself causally (a
    slice over the text's rows only: two slices share those rows)."""
    length = prefix + text
    return length, [_slice(0, length, 0, prefix, "full"), _slice(prefix, length, prefix, length, "causal")]


def inverse_and_bi(head, tail):
    """The first ``head`` queries see the keys at and after them
    (inv_causal); the others the key at their own position and the two
    before it (bi_causal, a band of three)."""
    length = head + tail
    return length, [_slice(0, head, 0, length, "inv_causal"), _slice(head, length, head - 2, length, "bi_causal")]


EXAMPLES = {
    "shared_prefix": shared_prefix(4, [3, 2, 4]),
    "shared_prefix_pad": shared_prefix(3, [2, 3], pad=2),
    "block_causal": block_causal([3, 2, 4]),
    "prefix_lm": prefix_lm(3, 5),
    "inverse_bi": inverse_and_bi(4, 6),
}


def packed_batch(docs, world):
    """The batch (cpdispatch.batch_from_cu_seqlens) of documents (length,
    slices or None) packed in order over ``world`` ranks, each document
    with its slices."""
    import cpdispatch

    cu = [0]
    for n, _ in docs:
        cu.append(cu[-1] + n)
    batch = cpdispatch.batch_from_cu_seqlens(cu, world)
    for doc, (_, slices) in zip(batch["documents"], docs):
        if slices is not None:
            doc["slices"] = slices
    return batch


def band(s):
    """A slice's band on t - p (document positions), None for an open end."""
    (qa, qb), (ka, kb) = s["q"], s["k"]
    return {"full": (None, None), "causal": (None, kb - qb), "inv_causal": (ka - qa, None), "bi_causal": (ka - qa, kb - qb)}[s["type"]]


def slice_mask(length, slices):
    """[length, length] bool: the query at p sees the key at t (section 2e's
    rule, straight from the slices); ``slices`` None: causal."""
    p = torch.arange(length)[:, None]
    t = torch.arange(length)[None, :]
    if slices is None:
        return t <= p
    seen = torch.zeros(length, length, dtype=torch.bool)
    for s in slices:
        (qa, qb), (ka, kb) = s["q"], s["k"]
        lo, hi = band(s)
        inside = (p >= qa) & (p < qb) & (t >= ka) & (t < kb)
        if lo is not None:
            inside &= t - p >= lo
        if hi is not None:
            inside &= t - p <= hi
        assert not (seen & inside).any(), "slices that share a pair"
        seen |= inside
    return seen


def masked_attention(q, k, v, seen, scale):
    """Dense attention under a [queries, keys] bool mask, grouped-query heads;
    a row that sees no key gives 0 (and passes no gradient). (out, lse)."""
    groups = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(groups, 1)) * scale
    any_key = seen.any(-1)
    s = s.masked_fill(~seen, float("-inf")).masked_fill(~any_key[:, None], 0.0)
    lse = torch.logsumexp(s, -1).masked_fill(~any_key, float("-inf"))
    p = torch.softmax(s, -1) * any_key[:, None]
    return torch.einsum("hqk,khd->qhd", p, v.repeat_interleave(groups, 1)), lse
