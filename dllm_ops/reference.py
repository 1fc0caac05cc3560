"""Pure-torch oracles of every dllm op.

These are the definitions the kernels are tested against, written for
clarity, not speed: float64 where it helps, no fused tricks.
"""
from __future__ import annotations

import torch

from .packed_layout import packed_k_groups, packed_k_layout

__all__ = ["cosine_drift"]
__all__ += ["token_confidence", "token_confidence_max_prob", "select_transfer", "certainty_density",
            "certainty_select", "drift_select", "drift_select_threshold"]  # family: select
__all__ += ["rollout_scores", "nucleus_select"]  # family: rollout
__all__ += ["rope_scatter_kv", "sparse_attention", "gather_rows", "scatter_rows"]  # family: sparse_kv
__all__ += ["quantize_k", "dequantize_k", "k_quant_error", "quantize_v", "dequantize_v",
            "quant_attention", "two_source_attention"]  # family: quant
__all__ += ["add_rms_norm_", "silu_mul"]  # family: layer


def cosine_drift(x: torch.Tensor, x_prev: torch.Tensor) -> torch.Tensor:
    """``1 - cos(x, x_prev)`` per row in float64, returned as float32."""
    cos = torch.nn.functional.cosine_similarity(x.double(), x_prev.double(), dim=-1, eps=1e-8)
    return (1.0 - cos).float()


# ---- family: select (selection kernels) -------------------------------------

_NEG_INF = float("-inf")


def token_confidence(logits: torch.Tensor, mode: str, temperature: float = 0.0,
                     suppress: torch.Tensor | None = None,
                     noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token and score from a float64 softmax (see ``dllm_ops.ops.token_confidence``).

    ``log p = (x - m) - log1p(r)``, with ``r = S0 - 1`` summed *without* one max
    element: torch's own float64 softmax adds ~1e-13 terms onto 1 and loses
    ~1e-3 of ``1 - p_max`` on confident rows, which would make Dream's entropy
    off by ~1e-5 relative there.
    """
    x = logits.double().clone()
    if suppress is not None and suppress.numel() > 0:
        x[:, suppress.long()] = _NEG_INF
    z = x - x.max(dim=-1, keepdim=True).values
    w = torch.exp(z)
    rest = w.scatter(-1, w.argmax(dim=-1, keepdim=True), 0.0).sum(dim=-1, keepdim=True)
    logp = z - torch.log1p(rest)
    p = torch.exp(logp)
    if temperature > 0:
        # x / T as an elementwise IEEE division (a tensor divisor, never a
        # reciprocal multiply), then + g; -inf logits stay -inf.
        y = x / torch.full_like(x, temperature) + noise.double()
        y = torch.where(x == _NEG_INF, torch.full_like(y, _NEG_INF), y)
        token = y.argmax(dim=-1)  # first maximal index
    else:
        token = p.argmax(dim=-1)
    if mode == "prob":
        score = p.gather(-1, token[:, None])[:, 0]
    elif mode == "margin":
        if p.shape[-1] >= 2:
            top = p.topk(2, dim=-1).values
            score = top[:, 0] - top[:, 1]
        else:
            score = p[:, 0]
    elif mode == "neg_entropy":
        # Dream's sum p log(p + 1e-10), as p (log p + log1p(1e-10 / p)).
        term = p * (logp + torch.log1p(1e-10 * torch.exp(-logp)))
        score = torch.where(p > 0, term, torch.zeros_like(term)).sum(dim=-1)
    else:
        raise ValueError(mode)
    return token, score.float()


def token_confidence_max_prob(logits: torch.Tensor, mode: str = "prob", temperature: float = 0.0,
                              suppress: torch.Tensor | None = None,
                              noise: torch.Tensor | None = None,
                              max_prob_suppress: torch.Tensor | None = None):
    """``token_confidence`` and the float64 max probability of ``softmax(logits)``
    over the ids not in ``max_prob_suppress`` (see
    ``dllm_ops.ops.token_confidence_max_prob``; the op's rule ``max_prob_suppress
    ⊆ suppress`` is a property of its one-pass algorithm, not of this definition)."""
    token, score = token_confidence(logits, mode, temperature, suppress, noise)
    x = logits.double().clone()
    if max_prob_suppress is not None and max_prob_suppress.numel() > 0:
        x[:, max_prob_suppress.long()] = _NEG_INF
    w = torch.exp(x - x.max(dim=-1, keepdim=True).values)
    # 1 / (1 + r), r summed without one max element (as token_confidence's p).
    rest = w.scatter(-1, w.argmax(dim=-1, keepdim=True), 0.0).sum(dim=-1)
    return token, score, (1.0 / (1.0 + rest)).float()


def _rank(key: torch.Tensor, member: torch.Tensor, descending: bool) -> torch.Tensor:
    """rank[b, i]: position of i when members come first, ordered by key
    (descending or ascending), ties by lower index. Two stable sorts."""
    order = torch.sort(key, dim=1, descending=descending, stable=True).indices
    outsider = (~member).gather(1, order).to(torch.uint8)
    order = order.gather(1, torch.sort(outsider, dim=1, stable=True).indices)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(key.shape[1], device=key.device).expand_as(order).contiguous())
    return rank


def select_transfer(score: torch.Tensor, candidate: torch.Tensor, rule: str,
                    k: torch.Tensor | None = None, threshold: float = 0.9,
                    factor: float = 1.0) -> torch.Tensor:
    """Fast-dLLM transfer rules over the candidates (see ``dllm_ops.ops.select_transfer``)."""
    s = score.double()
    rank = _rank(s, candidate, descending=True)
    if rule == "topk":
        return candidate & (rank < k[:, None])
    if rule == "threshold":
        return candidate & ((s >= threshold) | (rank == 0))
    if rule == "factor":
        n = candidate.sum(dim=1)
        pos = torch.arange(s.shape[1], device=s.device)
        c_sorted = torch.empty_like(s).scatter_(1, rank, s)  # c_sorted[b, rank] = score
        thr = 1.0 - factor / (pos + 2).double()  # thr for 1-based n = pos + 1
        thr[0] = -1.0
        fail = (c_sorted < thr) & (pos < n[:, None])
        t = torch.where(fail.any(dim=1), fail.int().argmax(dim=1), n)
        count = torch.where(t >= n - 1, n, torch.where(t == 0, torch.ones_like(t), t))
        count = torch.where(n == 0, torch.zeros_like(n), count)
        return candidate & (rank < count[:, None])
    raise ValueError(rule)


def certainty_density(decoded: torch.Tensor, sigma: float, left_known: bool = True,
                      right_known: bool = False) -> torch.Tensor:
    """d²Cache's D(i) as a dense float64 sum over the padded row (no window)."""
    B, G = decoded.shape
    if G == 0:
        return torch.empty(B, 0)
    dev = decoded.device
    left = torch.full((B, G), float(left_known), dtype=torch.float64, device=dev)
    right = (decoded[:, -1:] | right_known).double().expand(B, G)
    marks = torch.cat([left, decoded.double(), right], dim=1)  # column c is j = c - G
    i = torch.arange(G, device=dev, dtype=torch.float64)[:, None]
    j = torch.arange(-G, 2 * G, device=dev, dtype=torch.float64)[None, :]
    kernel = torch.exp(-(i - j) ** 2 / (2 * sigma ** 2))  # [G, 3G]
    d = torch.arange(-3 * G, 3 * G, device=dev, dtype=torch.float64)
    z = torch.exp(-d ** 2 / (2 * sigma ** 2)).sum()
    return (marks @ kernel.T / z).float()


def certainty_select(masked: torch.Tensor, confidence: torch.Tensor, block_start: int, block_end: int,
                     block_length: int, k: int, sigma: float = 10.0,
                     density: torch.Tensor | None = None) -> torch.Tensor:
    """d²Cache's stage 1 row by row, as ``dllm_ops.ops.certainty_select`` defines it.
    ``density``: D to rank by instead of :func:`certainty_density`'s exact sum
    (the op's D drops terms below 3e-10, which orders scores that small)."""
    B, G = masked.shape
    if density is None:
        density = certainty_density(~masked, sigma)
    score = (confidence.float() * density.to(confidence.device)).cpu()
    out = torch.zeros(B, G, dtype=torch.bool)
    for b in range(B):
        masks = masked[b].cpu().nonzero().flatten().tolist()
        kth = masks[k - 1] if len(masks) >= k else G - 1
        end = (kth // block_length + 1) * block_length
        window = [i for i in masks if block_start <= i < end]
        window.sort(key=lambda i: (i >= block_end, -float(score[b, i]), i))
        out[b, window[:k]] = True
    return out.to(masked.device)


def _recompute_outputs(region, reuse, max_recompute):
    recompute = region & ~reuse
    count = recompute.sum(dim=1)
    slot = recompute.long().cumsum(dim=1) - 1
    keep = recompute & (slot < max_recompute)
    idx = torch.full((region.shape[0], max_recompute + 1), -1, dtype=torch.int64, device=region.device)
    pos = torch.arange(region.shape[1], device=region.device).expand_as(slot)
    idx.scatter_(1, torch.where(keep, slot, max_recompute), torch.where(keep, pos, -1))
    return reuse, idx[:, :max_recompute].int(), count.int()


def drift_select(drift: torch.Tensor, region: torch.Tensor, reuse_fraction: float,
                 max_recompute: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reuse the floor(rho * n) lowest-drift region tokens (ties: lower index)."""
    d = drift.double()
    rank = _rank(d, region, descending=False)
    n = region.sum(dim=1)
    reuse_count = torch.floor(reuse_fraction * n.double()).long()
    return _recompute_outputs(region, region & (rank < reuse_count[:, None]), max_recompute)


def drift_select_threshold(drift: torch.Tensor, region: torch.Tensor, threshold: float,
                           max_recompute: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recompute the region tokens with drift >= threshold."""
    return _recompute_outputs(region, region & ~(drift.double() >= threshold), max_recompute)


# ---- family: rollout ---------------------------------------------------------


def rollout_transition(probs_rows: torch.Tensor, row_idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """One layer's ``Ã = rownorm(A + I)`` as dense ``[B, T, T]`` float64.

    ``probs_rows [B, Q, T]``, ``row_idx [B, Q]``: ``A`` is the identity with
    row ``row_idx[b, r]`` replaced by ``probs_rows[b, r]`` (entries at invalid
    keys zeroed); rows that are padding (-1) or name an invalid position stay
    ``e_i``. Adding I and renormalising leaves identity rows unchanged.
    """
    B, Q, T = probs_rows.shape
    eye = torch.eye(T, dtype=torch.float64, device=probs_rows.device)
    A = eye.repeat(B, 1, 1)
    for b in range(B):
        idx = row_idx[b]
        used = (idx >= 0) & valid[b][idx.clamp(min=0)]
        A[b, idx[used]] = probs_rows[b][used].double() * valid[b].double()
    A = A + eye
    return A / A.sum(-1, keepdim=True)


def rollout_scores(probs_rows: torch.Tensor, row_idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """d²Cache's dense rollout: ``R ← Ã_l·R`` from ``R₀ = I`` for l = 1..L with
    float64 T×T matrices, then ``g_j = Σ_i R_ij``; invalid columns get 0.
    Returned as float32 ``[B, T]`` on the inputs' device. O(L·B·T³): the
    oracle, not the method.
    """
    L, B, Q, T = probs_rows.shape
    R = torch.eye(T, dtype=torch.float64, device=probs_rows.device).repeat(B, 1, 1)
    for l in range(L):
        R = torch.bmm(rollout_transition(probs_rows[l], row_idx[l], valid), R)
    g = R.sum(dim=1) * valid.double()
    return g.float()


def nucleus_select(scores: torch.Tensor, candidate: torch.Tensor, p: float, min_k: int = 1) -> torch.Tensor:
    """Top-p nucleus over the candidates of each row, as a bool ``[B, T]`` mask.

    Sorted by score descending, ties by position ascending (a stable sort);
    ``c = cumsum`` of the sorted float64 scores, one element after another;
    keep the largest prefix with ``c_k / c_n <= p`` (every candidate when
    ``c_n == 0``), at least ``min_k``, at most the candidate count.
    """
    out = torch.zeros(scores.shape, dtype=torch.bool)
    for b in range(scores.shape[0]):
        pos = torch.nonzero(candidate[b].cpu(), as_tuple=True)[0]
        s = scores[b].cpu().double()[pos]
        order = torch.sort(s, descending=True, stable=True).indices
        pos, s = pos[order], s[order]
        n = len(pos)
        if n == 0:
            continue
        c = torch.cumsum(s, dim=0)  # CPU float64 cumsum adds sequentially
        k = n if c[-1] == 0 else int((c / c[-1] <= p).sum())
        k = min(max(k, min_k), n)
        out[b, pos[:k]] = True
    return out.to(scores.device)


# ---- family: sparse_kv -------------------------------------------------------


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotate-half RoPE of ``x [B, Q, H, d]`` at ``positions [B, Q]``, float64.

    ``cos_sin [P, d]`` is the dllm_ops.rope table: cosines in the first half
    of a row, sines in the second. ``out = x * cos + rotate_half(x) * sin``
    with ``rotate_half(x) = cat(-x[d/2:], x[:d/2])`` and the half-size table
    repeated over both halves, as LLaDA / Dream write it.
    """
    d = x.shape[-1]
    rows = cos_sin.double()[positions.cpu()].to(x.device)  # [B, Q, d]
    cos = torch.cat([rows[..., : d // 2]] * 2, -1)[:, :, None, :]
    sin = torch.cat([rows[..., d // 2:]] * 2, -1)[:, :, None, :]
    xd = x.double()
    rot = torch.cat([-xd[..., d // 2:], xd[..., : d // 2]], -1)
    return xd * cos + rot * sin


def rope_scatter_kv(q, k, v, positions, cos_sin, k_cache, v_cache, idx) -> None:
    """In place, like the op: for each token with ``idx[b, j] >= 0``, q rotated,
    rotated k and raw v written to the caches at slot ``idx[b, j]``. RoPE in
    float64, rounded once to the dtype. No checks (the oracle trusts its input).
    """
    positions = torch.where(idx >= 0, positions, 0)  # padding positions are never read
    q_rot = apply_rope(q, positions, cos_sin).to(q.dtype)
    k_rot = apply_rope(k, positions, cos_sin).to(k.dtype)
    B, Q = idx.shape
    for b in range(B):
        for j in range(Q):
            t = int(idx[b, j])
            if t < 0:
                continue
            q[b, j] = q_rot[b, j]
            k_cache[b, :, t] = k_rot[b, j]
            v_cache[b, :, t] = v[b, j]


def attention_f64(q, k_cache, v_cache, key_valid, scale):
    """Dense GQA softmax attention in float64: ``(out [B, Q, H, d], probs [B, H, Q, T])``.

    A batch row with no valid key gives zero outputs and zero probabilities.
    """
    B, Q, H, d = q.shape
    G = H // k_cache.shape[1]
    k = k_cache.double().repeat_interleave(G, dim=1)  # [B, H, T, d]
    v = v_cache.double().repeat_interleave(G, dim=1)
    s = torch.einsum("bqhd,bhtd->bhqt", q.double(), k) * scale
    if key_valid is not None:
        s = s.masked_fill(~key_valid[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # all-masked rows -> 0
    out = torch.einsum("bhqt,bhtd->bqhd", p, v)
    return out, p


def sparse_attention(q, k_cache, v_cache, key_valid, scale, return_probs,
                     query_counts=None, key_counts=None):
    """``(out in q's dtype, probs_mean [B, Q, T] float32 or empty [0])`` from
    :func:`attention_f64`; probs averaged over the H query heads. With
    per-row counts, row b attends with its first ``query_counts[b]`` queries
    over its first ``key_counts[b]`` keys alone; its other outputs are 0."""
    if query_counts is not None or key_counts is not None:
        B, Q, T = q.shape[0], q.shape[1], k_cache.shape[2]
        out = torch.zeros_like(q)
        for b in range(B):
            n, t = (query_counts or [Q] * B)[b], (key_counts or [T] * B)[b]
            if n and t:
                valid = None if key_valid is None else key_valid[b:b + 1, :t]
                out[b, :n] = sparse_attention(q[b:b + 1, :n], k_cache[b:b + 1, :, :t],
                                              v_cache[b:b + 1, :, :t], valid, scale, False)[0][0]
        return out, q.new_empty((0,), dtype=torch.float32)
    out, p = attention_f64(q, k_cache, v_cache, key_valid, scale)
    probs = p.mean(dim=1).float() if return_probs else q.new_empty((0,), dtype=torch.float32)
    return out.to(q.dtype), probs


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``out[b, j] = x[b, idx[b, j]]``, zeros where ``idx < 0``."""
    out = x.new_zeros((x.shape[0], idx.shape[1], x.shape[2]))
    for b in range(idx.shape[0]):
        keep = idx[b] >= 0
        out[b, keep] = x[b, idx[b, keep]]
    return out


def scatter_rows(dst: torch.Tensor, src: torch.Tensor, idx: torch.Tensor) -> None:
    """``dst[b, idx[b, j]] = src[b, j]`` in place for ``idx >= 0``."""
    for b in range(idx.shape[0]):
        keep = idx[b] >= 0
        dst[b, idx[b, keep]] = src[b, keep]


# ---- family: quant -------------------------------------------------------------
# The numerics of dllm_ops/packed_layout.py, op by op in torch; the outputs take
# their shapes and dtypes from its packed_k_layout (V's follow from d // group). Codes, scales,
# mins and protected indices must equal the kernels' bit for bit: each step is
# one fp32 torch op (a subtraction, a true division, torch.round = half to
# even; dequant: a multiply, then an add), in the order the kernels use.


def _quant_scale_min(xmin: torch.Tensor, xmax: torch.Tensor, bits: int, dtype: torch.dtype):
    """Stored (scale, min) in ``dtype`` from fp32 ranges; empty ranges
    (min = +inf) give (0, 0)."""
    empty = xmin > xmax
    xmin = torch.where(empty, 0.0, xmin)
    xmax = torch.where(empty, 0.0, xmax)
    # A tensor divisor: torch turns division by a Python scalar into a multiply
    # by its reciprocal on CUDA, which rounds differently.
    scale = (xmax - xmin) / torch.full_like(xmax, float(2 ** bits - 1))
    return scale.to(dtype), xmin.to(dtype)


def _quant_codes(x: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 codes of fp32 ``x`` under stored ``scale`` / ``mn`` (broadcast)."""
    s, m = scale.float(), mn.float()
    ok = s > 0
    q = torch.round((x - m) / torch.where(ok, s, 1.0)).clamp(0, 2 ** bits - 1)
    return torch.where(ok, q, 0.0).long()


def _dequant(codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """fp32 ``code * scale + min`` with two roundings (never fused)."""
    prod = codes.float() * scale.float()
    return prod + mn.float()


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack int64 codes along the second-to-last dim (..., N, C) -> (..., N*bits/8, C), little end first."""
    per = 8 // bits
    *lead, N, C = codes.shape
    c = codes.reshape(*lead, N // per, per, C)
    shifts = (torch.arange(per, device=codes.device) * bits).view(per, 1)
    return (c << shifts).sum(-2).to(torch.uint8)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`_pack`: (..., R, C) uint8 -> (..., R*8/bits, C) int64."""
    per = 8 // bits
    *lead, R, C = packed.shape
    shifts = (torch.arange(per, device=packed.device) * bits).view(per, 1)
    c = (packed.long().unsqueeze(-2) >> shifts) & (2 ** bits - 1)
    return c.reshape(*lead, R * per, C)


def quantize_k(k: torch.Tensor, bits: int, group: int, protect_p: int,
               importance: torch.Tensor | None):
    """``(codes, scale, min, prot_idx, prot_val)`` of the packed K cache
    (layout: ``dllm_ops.quant.PackedK``). No checks (the oracle trusts its input)."""
    B, H, T, d = k.shape
    G, p = group, protect_p
    layout = packed_k_layout(B, H, T, d, bits, G, p, k.dtype)
    n = packed_k_groups(T, G)
    Tp = n * G
    dev = k.device
    x = torch.zeros(B, H, Tp, d, dtype=torch.float32, device=dev)
    x[:, :, :T] = k.float()
    xg = x.view(B, H, n, G, d)
    real = (torch.arange(Tp, device=dev) < T).view(n, G).expand(B, H, n, G)
    prot = torch.zeros(B, H, n, G, dtype=torch.bool, device=dev)
    prot_idx = torch.full(layout["prot_idx"].shape, 255, dtype=layout["prot_idx"].dtype, device=dev)
    prot_val = torch.zeros(layout["prot_val"].shape, dtype=layout["prot_val"].dtype, device=dev)
    if p > 0:
        imp = importance.float()
        if imp.dim() == 2:
            imp = imp[:, None].expand(B, H, T)
        impp = torch.zeros(B, H, Tp, dtype=torch.float32, device=dev)
        impp[..., :T] = imp
        # Rank: importance descending, ties by lower index (stable sort), then
        # real tokens before padding (a second stable sort).
        order = torch.sort(impp.view(B, H, n, G), dim=-1, descending=True, stable=True).indices
        order = order.gather(-1, torch.sort(real.gather(-1, order).to(torch.int8), dim=-1,
                                            descending=True, stable=True).indices)
        top = order[..., :p]                                             # [B, H, n, p]
        n_real = real.sum(-1, keepdim=True)                              # [B, H, n, 1]
        used = torch.arange(p, device=dev) < n_real                      # [B, H, n, p]
        prot_idx = torch.where(used, top, 255).to(torch.uint8)
        prot.scatter_(-1, top, used)  # unused slots point at padding: they scatter False
        vals = k.new_zeros(B, H, Tp, d)
        vals[:, :, :T] = k
        picked = vals.view(B, H, n, G, d).gather(3, top[..., None].expand(B, H, n, p, d))
        prot_val = torch.where(used[..., None], picked, torch.zeros((), dtype=k.dtype, device=dev))
    quant = real & ~prot                                                 # [B, H, n, G]
    xmin = torch.where(quant[..., None], xg, float("inf")).amin(3)       # [B, H, n, d]
    xmax = torch.where(quant[..., None], xg, float("-inf")).amax(3)
    scale, mn = _quant_scale_min(xmin, xmax, bits, k.dtype)
    codes = _quant_codes(xg, scale[:, :, :, None], mn[:, :, :, None], bits)
    codes = torch.where(quant[..., None], codes, 0).view(B, H, Tp, d)
    return _pack(codes, bits), scale, mn, prot_idx, prot_val


def dequantize_k(codes, scale, mn, prot_idx, prot_val, bits: int, group: int, length: int) -> torch.Tensor:
    """``[B, H_kv, length, d]`` in the cache dtype from a packed K cache."""
    B, H, n, d = scale.shape
    G, p = group, prot_idx.shape[-1]
    c = _unpack(codes, bits).view(B, H, n, G, d)
    out = _dequant(c, scale[:, :, :, None], mn[:, :, :, None]).to(scale.dtype)
    if p > 0:
        # Unused slots (255) go to an extra dummy token G, dropped afterwards.
        idx = torch.where(prot_idx == 255, G, prot_idx.long())
        ext = torch.cat([out, out.new_zeros(B, H, n, 1, d)], dim=3)
        ext.scatter_(3, idx[..., None].expand(B, H, n, p, d), prot_val)
        out = ext[:, :, :, :G]
    return out.reshape(B, H, n * G, d)[:, :, :length]


def k_quant_error(k: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """``[B, H_kv, T]`` float32: squared L2 error of p = 0 quantize-dequantize,
    summed in float64."""
    packed = quantize_k(k, bits, group, 0, None)
    deq = dequantize_k(*packed, bits, group, k.shape[2])
    return ((k.double() - deq.double()) ** 2).sum(-1).float()


def quantize_v(v: torch.Tensor, bits: int, group: int):
    """``(codes, scale, min)`` of the packed V cache (``dllm_ops.quant.PackedV``)."""
    B, H, T, d = v.shape
    xg = v.float().view(B, H, T, d // group, group)
    scale, mn = _quant_scale_min(xg.amin(-1), xg.amax(-1), bits, v.dtype)
    codes = _quant_codes(xg, scale[..., None], mn[..., None], bits).view(B, H, T, d)
    packed = _pack(codes.transpose(-1, -2), bits).transpose(-1, -2).contiguous()
    return packed, scale, mn


def dequantize_v(codes, scale, mn, bits: int, group: int) -> torch.Tensor:
    """``[B, H_kv, T, d]`` in the cache dtype from a packed V cache."""
    B, H, T, ng = scale.shape
    c = _unpack(codes.transpose(-1, -2), bits).transpose(-1, -2).reshape(B, H, T, ng, group)
    return _dequant(c, scale[..., None], mn[..., None]).to(scale.dtype).view(B, H, T, ng * group)


def quant_attention(q, k_codes, k_scale, k_min, k_prot_idx, k_prot_val, k_bits, k_group,
                    v_codes, v_scale, v_min, v_bits, v_group, key_valid, scale) -> torch.Tensor:
    """:func:`sparse_attention` (float64) over the dequantized caches."""
    T = v_codes.shape[2]
    kc = dequantize_k(k_codes, k_scale, k_min, k_prot_idx, k_prot_val, k_bits, k_group, T)
    vc = dequantize_v(v_codes, v_scale, v_min, v_bits, v_group)
    return sparse_attention(q, kc, vc, key_valid, scale, False)[0]



def two_source_attention(q, k_codes, k_scale, k_min, k_prot_idx, k_prot_val, k_bits, k_group,
                         v_codes, v_scale, v_min, v_bits, v_group, packed_valid, k_full, v_full,
                         full_valid, scale, return_probs=False):
    """:func:`sparse_attention` (float64) over the dequantized packed cache
    (keys ``0 .. Tp-1``) followed by the full-precision one (``Tp ..
    Tp+Tf-1``), the masks concatenated (None: that source all valid)."""
    Tp, Tf = v_codes.shape[2], k_full.shape[2]
    B = q.shape[0]
    kc = dequantize_k(k_codes, k_scale, k_min, k_prot_idx, k_prot_val, k_bits, k_group, Tp)
    vc = dequantize_v(v_codes, v_scale, v_min, v_bits, v_group)
    ones = lambda n: torch.ones(B, n, dtype=torch.bool, device=q.device)  # noqa: E731
    valid = None
    if packed_valid is not None or full_valid is not None:
        valid = torch.cat([ones(Tp) if packed_valid is None else packed_valid,
                           ones(Tf) if full_valid is None else full_valid], dim=1)
    return sparse_attention(q, torch.cat([kc, k_full], dim=2), torch.cat([vc, v_full], dim=2),
                            valid, scale, return_probs)

# ---- family: layer -------------------------------------------------------------


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> None:
    """``residual += x`` (one rounding from fp32, as torch's add), then
    ``x = T(T(r · inv) · weight)``, ``inv = 1 / sqrt(mean(r²) + eps)`` in float64."""
    dtype = x.dtype
    r = (residual.float() + x.float()).to(dtype)
    rd = r.double()
    inv = torch.rsqrt(rd.pow(2).mean(-1, keepdim=True) + eps)
    normed = (rd * inv).to(dtype).double() * weight.double()
    residual.copy_(r)
    x.copy_(normed.to(dtype))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``T(T(silu(gate)) · up)``, silu in float64."""
    dtype = gate.dtype
    s = torch.nn.functional.silu(gate.double()).to(dtype)
    return (s.double() * up.double()).to(dtype)
