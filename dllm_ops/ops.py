"""Typed Python wrappers of torch.ops.dllm.*.

No math lives here: each wrapper documents the contract and forwards to the
registered op, so `torch.compile`, fake tensors and opcheck see the real op.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["cosine_drift", "has_cuda_kernels"]
__all__ += ["token_confidence", "token_confidence_max_prob", "select_transfer", "certainty_density",
            "certainty_select", "drift_select", "drift_select_threshold"]  # family: select
__all__ += ["rollout_scores", "nucleus_select"]  # family: rollout
__all__ += ["rope_scatter_kv", "sparse_attention", "gather_rows", "scatter_rows"]  # family: sparse_kv
__all__ += ["quantize_k", "dequantize_k", "k_quant_error", "quantize_v", "dequantize_v",
            "quant_attention", "two_source_attention"]  # family: quant
__all__ += ["add_rms_norm_", "silu_mul"]  # family: layer


def has_cuda_kernels(op: str = "cosine_drift") -> bool:
    """True when the built extension registered a CUDA kernel for `dllm::<op>`.

    This is a property of the build (nvcc was found), not of the machine: a
    CPU-only machine can hold a CUDA-enabled build.
    """
    return "CUDA" in torch._C._dispatch_dump(f"dllm::{op}")


def cosine_drift(x: torch.Tensor, x_prev: torch.Tensor) -> torch.Tensor:
    """Per-row drift ``1 - cos(x, x_prev)`` over the last dim.

    Args:
        x, x_prev: ``[..., T, D]`` tensors of the same shape, dtype (float32,
            float16 or bfloat16) and device. Non-contiguous inputs are accepted.

    Returns:
        ``[..., T]`` float32. Accumulation is in fp32. Each norm is clamped to
        1e-8 separately, as :func:`torch.nn.functional.cosine_similarity` does,
        so a zero row has drift exactly 1.
    """
    return torch.ops.dllm.cosine_drift.default(x, x_prev)


# ---- family: select (selection kernels) -------------------------------------


def token_confidence(logits: torch.Tensor, mode: str = "prob", temperature: float = 0.0,
                     suppress: torch.Tensor | None = None,
                     noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen token and its confidence for every row of logits, in one pass.

    Each row is read once with an online softmax (fp32 accumulation); only
    ``neg_entropy`` reads it a second time (see below).

    Args:
        logits: ``[N, V]`` float32/float16/bfloat16 (V up to 2^31 - 2; LLaDA's
            126,464 and Dream's 152,064 are tested). Rows may be strided; the
            vocab dim is used in place when its stride is 1.
        mode: the score, always from the *un-noised* softmax
            ``p = softmax(logits)`` (temperature 1, suppressed ids at -inf):

            - ``"prob"``: ``p[token]``; with ``temperature == 0`` this is the
              max probability (LLaDA ``low_confidence``, Fast-dLLM, Dream
              ``maskgit_plus``).
            - ``"margin"``: ``p_(1) - p_(2)``, the two largest probabilities
              (Dream ``topk_margin``); 0 when the top two logits tie, ``p_(1)``
              when the row has a single finite logit.
            - ``"neg_entropy"``: ``sum_i p_i * log(p_i + 1e-10)`` exactly as
              Dream's ``entropy`` (``0 * log(1e-10) = 0``). It is computed as
              ``s1/S0 - log S0`` from the one-pass moments (``S0 = sum e^{x-m}``,
              ``s1 = sum (x-m) e^{x-m}``) plus the +1e-10 correction
              ``sum p log1p(1e-10/p)``, which needs the final ``S0`` and is
              therefore summed over a second read of the row. It is not
              dropped: it is up to V*1e-10 and, for a confident row, of the
              same order as the entropy itself.
        temperature: 0 = greedy (``token = argmax logits``). With
            ``temperature > 0`` the token is the Gumbel-max sample
            ``argmax_i (logits_i / T + noise_i)``, formed in float64 (one IEEE
            division, one addition), so every backend picks the same token.
            This is LLaDA's ``add_gumbel_noise``: it takes
            ``argmax exp(l) / (-log U)^T``, and since log is increasing and
            T > 0 that is ``argmax l - T log(-log U) = argmax l/T + g`` with
            ``g = -log(-log U)``, a standard Gumbel sample. To reproduce it pass
            ``noise = -torch.log(-torch.log(U)).float()`` with
            ``U = torch.rand(N, V, dtype=torch.float64)``. For Dream's
            ``softmax(logits / T)`` sampling pass ``logits / T`` with
            ``temperature=1`` (then the score is also from ``softmax(logits/T)``,
            as in Dream).
        suppress: optional int64 ``[S]`` ids in ``[0, V)`` (duplicates allowed)
            whose logits count as -inf in every row, for the argmax and the
            softmax (LLaDA's ``logits_eos_inf``).
        noise: float32 ``[N, V]`` Gumbel samples; required iff temperature > 0.
            A -inf logit stays -inf whatever its noise.

    Returns:
        ``token`` int64 ``[N]`` and ``score`` float32 ``[N]``. Ties go to the
        lowest index.

    Raises:
        RuntimeError ``dllm::token_confidence: ...`` for a NaN or +inf logit at
        an id that is not suppressed, NaN noise at a finite logit, a row with no
        finite logit, or a suppress id out of range. On CUDA the check costs one
        4-byte device-to-host read (a sync); inside CUDA-graph capture it is
        skipped and such a row yields token -1 and score NaN.
    """
    return torch.ops.dllm.token_confidence.default(logits, mode, float(temperature), suppress, noise)


def token_confidence_max_prob(logits: torch.Tensor, mode: str = "prob", temperature: float = 0.0,
                              suppress: torch.Tensor | None = None,
                              noise: torch.Tensor | None = None,
                              max_prob_suppress: torch.Tensor | None = None,
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``token_confidence`` plus each row's max probability over a larger id set, in the same pass.

    ``token`` and ``score`` are exactly ``token_confidence(logits, mode,
    temperature, suppress, noise)``'s (the same kernel, the same bits).
    ``max_prob`` is float32 ``[N]``: the largest probability of the *un-noised*,
    temperature-1 softmax over the ids not in ``max_prob_suppress`` (None: no
    id suppressed), e.g. d²Cache's confidence (only the mask token
    suppressed) next to a reveal rule's own score (EOS suppressed too, a
    margin, a sample).

    It comes from the pass's softmax moments (row max ``m`` and ``S0 = sum
    e^{x-m}`` over the unsuppressed ids) plus a correction over the ids of
    ``suppress`` that are not in ``max_prob_suppress`` (the "readmitted"
    ids, logits ``l_j``): ``m2 = max(m, l_j)``, ``S2 = S0 e^{m-m2} + sum_j
    e^{l_j-m2}``, ``max_prob = 1 / S2`` (float64, then rounded). So the op
    needs ``max_prob_suppress ⊆ suppress`` (as sets; duplicates allowed) and
    reads only the few readmitted logits again. With equal sets (nothing
    readmitted) ``max_prob`` has the bits of ``token_confidence(logits,
    "prob", 0.0, suppress)``'s score on the same backend, in every mode and
    temperature of this call; otherwise it is within float32 rounding of
    the float64 softmax (``reference.token_confidence_max_prob``).

    Args:
        logits, mode, temperature, suppress, noise: as ``token_confidence``.
        max_prob_suppress: optional int64 ``[K]`` ids in ``[0, V)``, each also
            in ``suppress``, whose logits count as -inf for ``max_prob``.

    Returns:
        ``token`` int64 ``[N]``, ``score`` float32 ``[N]``, ``max_prob``
        float32 ``[N]``.

    Raises:
        RuntimeError ``dllm::token_confidence_max_prob: ...``: every error of
        ``token_confidence``; a ``max_prob_suppress`` id out of range; ``max_prob_suppress
        must be a subset of suppress``; a NaN or +inf logit at a readmitted
        id (``-inf`` is fine: it adds nothing). On CUDA the checks share the
        one status read-back (a sync); inside CUDA-graph capture they are
        skipped and a bad row yields ``max_prob`` NaN.
    """
    return torch.ops.dllm.token_confidence_max_prob.default(
        logits, mode, float(temperature), suppress, noise, max_prob_suppress)


def select_transfer(score: torch.Tensor, candidate: torch.Tensor, rule: str,
                    k: torch.Tensor | None = None, threshold: float = 0.9,
                    factor: float = 1.0) -> torch.Tensor:
    """Which candidate positions to commit this step (Fast-dLLM transfer rules).

    Candidates are ordered by score descending, ties by lower index first
    (deterministic); non-candidates are never selected.

    Args:
        score: ``[B, L]`` float32/float16/bfloat16 confidences. NaN at a
            candidate is an error; -inf is allowed (ranked last).
        candidate: ``[B, L]`` bool, the positions that may be committed
            (masked tokens of the current block).
        rule:
            - ``"topk"``: the first ``k[b]`` candidates; ``k`` is int64 ``[B]``
              with ``0 <= k[b] <=`` the row's candidate count (else an error).
            - ``"threshold"``: every candidate with ``score >= threshold``
              (compared in float64) plus the first one, so a row with
              candidates commits at least one.
            - ``"factor"``: Fast-dLLM's dynamic rule. With the n candidates'
              sorted scores c_1 >= ... >= c_n and ``thr_j = 1 - factor/(j+1)``
              (``thr_1 = -1``), t = the first j (0-based) with c < thr; commit
              the top t, except: t == 0 commits 1, and t == n-1 ("only the last
              fails") or no failure commits all n (the reference's loop quirk).
        k: per-row counts for ``topk`` only (must be None otherwise).
        threshold: the ``threshold`` rule's tau (not NaN).
        factor: the ``factor`` rule's f (finite).

    Returns:
        ``[B, L]`` bool commit mask.

    On CUDA the argument checks that need the data (k range, NaN) cost one
    4-byte read; they are skipped inside CUDA-graph capture.
    """
    return torch.ops.dllm.select_transfer.default(score, candidate, rule, k, float(threshold),
                                                 float(factor))


def certainty_density(decoded: torch.Tensor, sigma: float = 10.0, left_known: bool = True,
                      right_known: bool = False) -> torch.Tensor:
    """d²Cache's certainty density D(i) over the generated region.

    ``D(i) = sum_{j=-G}^{2G-1} m_j exp(-(i-j)^2 / 2 sigma^2) / Z`` with
    ``Z = sum_{d=-3G}^{3G-1} exp(-d^2 / 2 sigma^2)`` (a constant), where
    ``m_j = decoded[j]`` on the region, the G-wide left pad is ``left_known``
    and the G-wide right pad is ``right_known or decoded[b, G-1]``. d²Cache's
    own rule (prompt known; right side known iff the last generated token is
    decoded) is the default ``left_known=True, right_known=False``;
    ``right_known=True`` says the tokens after the region are decoded.

    The sum is direct over ``|i - j| <= ceil(6.5 sigma)`` in float64; the
    dropped tail is below 3e-10 of D (bound in ``csrc/math/select_math.h``).

    Args:
        decoded: ``[B, G]`` bool, True = decoded token, False = mask.
        sigma: the Gaussian width (finite, > 0; d²Cache uses 10).

    Returns:
        ``[B, G]`` float32 in [0, 1].
    """
    return torch.ops.dllm.certainty_density.default(decoded, float(sigma), bool(left_known),
                                                   bool(right_known))


def certainty_select(masked: torch.Tensor, confidence: torch.Tensor, block_start: int, block_end: int,
                     block_length: int, k: int, sigma: float = 10.0) -> torch.Tensor:
    """d²Cache's stage 1: the masked tokens of each row a call recomputes.

    Over a row's generated region of G positions (blocks of ``block_length``
    from column 0), with ``D = certainty_density(~masked, sigma)`` (prompt
    known, the right pad decoded iff the last position is) and ``score =
    confidence * D`` (the float32 product):

    1. the search window runs from ``block_start`` to the end of the block
       holding the ``k``-th masked position (the region's last block when
       fewer than ``k`` are masked);
    2. its masked positions rank those in the current block ``[block_start,
       block_end)`` first, then by score descending, then by position
       ascending (-0.0 ranks as 0.0);
    3. the first ``k`` of them are chosen (all of them when fewer).

    Every call of the d²Cache policy plans with this one op instead of a
    density op and ~40 small tensor ops.

    Args:
        masked: ``[B, G]`` bool, True = still masked. May be a slice of a
            wider canvas (rows are read in place).
        confidence: ``[B, G]`` float32, the cached confidence of each
            position: finite and >= 0 wherever ``masked`` (elsewhere unread).
        block_start, block_end: the current block, ``0 <= block_start <=
            block_end <= G``; positions before ``block_start`` are never chosen.
        block_length: the block grid of the window (>= 1).
        k: tokens to choose per row (>= 1).
        sigma: the density's width (finite, > 0).

    Returns:
        ``[B, G]`` bool, the chosen positions (``min(k, masked in the
        window)`` per row).

    Raises:
        RuntimeError ``dllm::certainty_select: ...`` on a shape / dtype /
        device mismatch, a block outside the row, ``k < 1``,
        ``block_length < 1``, a bad ``sigma``, or a NaN, infinite or negative
        confidence at a masked position (named by row and position).
    """
    return torch.ops.dllm.certainty_select.default(masked, confidence, int(block_start), int(block_end),
                                                  int(block_length), int(k), float(sigma))


def drift_select(drift: torch.Tensor, region: torch.Tensor, reuse_fraction: float,
                 max_recompute: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split each row's region into reused (lowest drift) and recomputed tokens.

    Per row with n region tokens, the ``floor(reuse_fraction * n)`` tokens of
    lowest drift (ties: lower index counts as lower) are reused; the other
    region tokens are recomputed. Tokens outside the region are neither.

    Args:
        drift: ``[B, T]`` float32/float16/bfloat16 (e.g. ``cosine_drift``);
            NaN inside the region is an error.
        region: ``[B, T]`` bool.
        reuse_fraction: in ``[0, 1)``.
        max_recompute: the static width of ``recompute_idx`` (>= 0).

    Returns:
        ``reuse`` bool ``[B, T]``; ``recompute_idx`` int32
        ``[B, max_recompute]``, each row's recomputed positions ascending,
        padded with -1 (a static shape, CUDA-graph friendly);
        ``recompute_count`` int32 ``[B]``, the real counts.

    Raises:
        RuntimeError when a row needs more than ``max_recompute`` recomputed
        tokens. On CUDA this (and the NaN check) costs one 4-byte read; inside
        CUDA-graph capture it is skipped, ``recompute_idx`` then holds the
        first ``max_recompute`` positions and ``recompute_count`` the real
        (larger) count, so the caller can still detect the overflow.
    """
    return torch.ops.dllm.drift_select.default(drift, region, float(reuse_fraction),
                                              int(max_recompute))


def drift_select_threshold(drift: torch.Tensor, region: torch.Tensor, threshold: float,
                           max_recompute: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The absolute-threshold variant of :func:`drift_select`.

    A region token is recomputed iff ``drift >= threshold`` (compared in
    float64), else reused. Outputs, padding and errors are as in
    :func:`drift_select`; ``threshold`` must not be NaN.
    """
    return torch.ops.dllm.drift_select_threshold.default(drift, region, float(threshold),
                                                        int(max_recompute))


# ---- family: rollout ---------------------------------------------------------


def rollout_scores(probs_rows: torch.Tensor, row_idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Attention-rollout importance ``g = 1ᵀ Ã_L ⋯ Ã_1`` (d²Cache stage 2) in O(L·Q·T).

    ``Ã_l = rownorm(A_l + I)``, where ``A_l`` holds the given attention rows at
    their tokens and ``e_i`` at every other row. This equals the column sums of
    d²Cache's dense product ``R ← Ã_l·R`` (``R₀ = I``), without forming any
    T×T matrix.

    Args:
        probs_rows: ``[L, B, Q, T]`` float32/float16/bfloat16, the head-averaged
            attention rows of the Q recomputed queries of each layer
            (layer 0 = the first layer).
        row_idx: ``[L, B, Q]`` int64, each row's token; ``-1`` marks a padding
            row. The row sets may differ between layers; within one layer of
            one batch row the non-negative entries must be distinct.
        valid: ``[B, T]`` bool, the real (non-padding) positions.

    Padding: a row whose token is not valid is ignored (treated as ``-1``),
    attention entries at invalid key positions are ignored (each used row is
    renormalised over the valid keys plus its diagonal), and invalid columns
    get importance 0. So the result is d²Cache's rollout restricted to the
    valid positions.

    Returns:
        ``[B, T]`` float32 (accumulated in float64).

    Raises:
        RuntimeError ``dllm::rollout_scores: ...`` on shape/dtype mismatch, a
        ``row_idx`` entry outside ``[-1, T)``, a duplicate token within one
        layer, or a used probability (used row, valid key) that is negative or
        not finite.
    """
    return torch.ops.dllm.rollout_scores.default(probs_rows, row_idx, valid)


def nucleus_select(scores: torch.Tensor, candidate: torch.Tensor, p: float, min_k: int = 1) -> torch.Tensor:
    """Per row, the top-p nucleus of the candidate scores (d²Cache's selection).

    Candidates are ordered by score descending, ties by position ascending.
    With ``c_k`` the float64 sum of the k largest (added one at a time in that
    order), the largest k with ``c_k / c_n <= p`` is kept, then raised to
    ``min_k`` and capped at the number of candidates n. A row whose candidate
    scores are all zero has cumulative share 0 everywhere and keeps every
    candidate.

    Args:
        scores: ``[B, T]`` float32/float16/bfloat16; finite and ``>= 0`` at
            candidates (other positions are ignored).
        candidate: ``[B, T]`` bool, the positions that may be selected.
        p: nucleus mass in ``(0, 1]``.
        min_k: at least this many candidates are kept (``>= 0``).

    Returns:
        ``[B, T]`` bool mask, False outside ``candidate``.
    """
    return torch.ops.dllm.nucleus_select.default(scores, candidate, float(p), int(min_k))


# ---- family: sparse_kv -------------------------------------------------------
# Index conventions shared by these ops: ``idx [B, Q]`` int64 names rows of a
# length-T axis; a negative entry is padding (that row is skipped / zero);
# an entry >= T is an error. On CUDA the index checks read one small error
# record back to the host (one device sync per call).


def rope_scatter_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    idx: torch.Tensor) -> None:
    """Rotate q in place and write rotated k and raw v into the post-RoPE caches.

    For every token ``(b, j)`` with ``idx[b, j] >= 0``: NeoX rotate-half RoPE at
    position ``positions[b, j]`` is applied (in fp32, rounded once to the
    input dtype) to every head of ``q[b, j]`` (in place) and of ``k[b, j]``;
    the rotated ``k[b, j, h]`` goes to ``k_cache[b, h, idx[b, j]]`` and
    ``v[b, j, h]`` to ``v_cache[b, h, idx[b, j]]``. Padding tokens
    (``idx < 0``) are skipped entirely: their q is not rotated and their
    position is not checked.

    Args:
        q: ``[B, Q, H, d]``, mutated in place (may be non-contiguous).
        k, v: ``[B, Q, H_kv, d]``, same dtype as q (fp32/fp16/bf16).
        positions: ``[B, Q]`` int64 RoPE positions, in ``[0, cos_sin.shape[0])``.
        cos_sin: ``[max_positions, d]`` fp32 table from :func:`dllm_ops.rope.rope_cos_sin`.
        k_cache, v_cache: ``[B, H_kv, T, d]``, same dtype, written in place.
        idx: ``[B, Q]`` int64 cache slots; distinct within a row.

    Raises:
        RuntimeError ``dllm::rope_scatter_kv: ...`` on a shape/dtype/device
        mismatch, odd ``d``, ``H`` not a multiple of ``H_kv``, ``idx >= T``, a
        duplicate ``idx`` in a row, or a position outside the table. All
        indices are checked before anything is written.
    """
    torch.ops.dllm.rope_scatter_kv.default(q, k, v, positions, cos_sin, k_cache, v_cache, idx)


def sparse_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     key_valid: torch.Tensor | None, scale: float,
                     return_probs: bool = False, query_counts: Sequence[int] | None = None,
                     key_counts: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention of Q selected queries over all T cached keys.

    ``out[b, j, h] = softmax_t(scale * q[b, j, h] . k_cache[b, h // G, t]) @
    v_cache[b, h // G]`` with ``G = H // H_kv`` (GQA) and keys with
    ``key_valid[b, t] == False`` excluded. Scores, softmax and sums are fp32.

    Args:
        q: ``[B, Q, H, d]`` (already RoPE-rotated), fp32/fp16/bf16.
        k_cache, v_cache: ``[B, H_kv, T, d]``, same dtype; ``d <= 256``.
        key_valid: ``[B, T]`` bool or None (every key valid).
        scale: score multiplier, usually ``d ** -0.5``.
        return_probs: also return the head-averaged probabilities.
        query_counts, key_counts: per batch row, how many of its queries and
            keys it has (each list B ints in ``[0, Q]`` / ``[0, T]``; None:
            all). Row ``b`` then attends with ``q[b, :query_counts[b]]`` over
            keys ``[0, key_counts[b])`` only (what lies past them is never
            read, NaN included), ``out[b, query_counts[b]:] == 0``, and its
            outputs are **bit for bit** those of a call on that row alone
            (``q[b:b+1, :n]`` over ``k_cache[b:b+1, :, :t]``) on every
            backend, whatever the other rows hold: ragged rows of unrelated
            decodes share one launch (the server's stacked cohorts) and each
            gets its own answer. Not with ``return_probs``. On CUDA each row
            keeps the key split its own call would pick (below), and the
            plans travel to the device through pinned memory without a sync
            (not under CUDA graph capture).

    Returns:
        ``(out, probs_mean)``: ``out [B, Q, H, d]`` in q's dtype; with
        ``return_probs``, ``probs_mean [B, Q, T]`` float32 = the attention
        probabilities averaged over the H query heads, exactly 0 on invalid
        keys, rows summing to 1 (up to fp32 rounding). Without
        ``return_probs``, ``probs_mean`` is an empty float32 tensor of shape
        ``[0]``.

        A batch row with no valid key at all has ``out == 0`` and
        ``probs_mean == 0`` for every query (rather than NaN).

    CUDA, split-KV: a block of the kernel owns a tile of 16 of the ``Q * G``
    query rows of one KV head (8 for ``d > 128``) and streams all T keys, so
    the grid has ``B * H_kv * ceil(Q * G / 16)`` blocks however long T is. Where that is under ``2 * SMs`` (two resident blocks per SM, so one
    computes while the other waits for its next K/V tile), the keys are cut
    into chunks as flash-decoding does: each block folds one chunk and parks
    its (max, sum, unnormalised fp32 output), and a combine kernel merges the
    chunks by log-sum-exp. Chunks are whole key tiles (32 keys; 16 for
    ``d > 128``) of at least 128 keys, and their count is the smallest that
    reaches ``2 * SMs`` blocks (``csrc/cuda/attention_tile.cuh``
    ``attention_key_splits``). On an H200 (132 SMs: a target of 264 blocks) at
    LLaDA-8B shapes (B = 1, H = H_kv = 32, d = 128):

    ====  ====  ======================  ======  ==========  ==========
    Q     T     blocks unsplit          chunks  keys/chunk  blocks
    ====  ====  ======================  ======  ==========  ==========
    32    768   32 heads x 2 = 64       5       160         320
    32    4096  64                      5       832         320
    1-16  768   32 x 1 = 32             6 [1]   128         192
    1-16  4096  32                      9       480         288
    128   4096  32 x 8 = 256            2       2048        512
    768   768   32 x 48 = 1536          1       (no split)  1536
    ====  ====  ======================  ======  ==========  ==========

    [1] 9 wanted (264 / 32), but 768 keys hold only 6 chunks of 128. Dream-7B
    (H = 28, H_kv = 4: 7 heads a KV head) at Q = 32 has 4 x 14 = 56 blocks:
    5 chunks. The cost of a split: the workspace, ``chunks * B * Q * H * (d +
    2)`` fp32 written and read once (Q = 32: 2.7 MB for 5 chunks, against
    12.6 MB of bf16 K and V at T = 768 and 67 MB at T = 4096; it fits the
    H200's 60 MB L2), and one more launch. The split only changes the order of
    fp32 sums (the same error bounds hold); the probabilities are normalised
    with the merged (max, sum), so ``return_probs`` (d2cache) splits too. As
    the choice depends on B, a row's output can differ in the last bits
    between a batched and a single call (unless the call gives per-row counts). ``DLLM_ATTN_SM_COUNT`` (run time)
    overrides the SM count the rule plans for (0: never split); the
    simulated kernels (``torch.ops.dllm_sim``) plan for 0 SMs unless it is set.
    Nothing of this was timed (no GPU at hand): the target of two blocks per
    SM and the 128-key floor are the reasoning above, to be tuned on a device.
    """
    # Not routed to torch SDPA when return_probs is False. Measured on this
    # project's 2-core Sapphire Rapids CPU (AMX), LLaDA-8B layer H=32, d=128,
    # T=768, B=1, min of interleaved runs, one thread (the shared machine was
    # loaded; two-thread runs were too noisy to rank): Q=32 bf16 3.02 ms vs
    # SDPA 2.94 ms (parity), fp32 9.24 vs 10.98 ms (dllm faster); Q=768 bf16
    # 107 vs 73 ms and fp32 213 vs 201 ms (SDPA faster). The sparse steps
    # (small Q) are the hot path and are at parity or better; routing the
    # block-start refresh would change the contract (SDPA gives NaN for a
    # row without valid keys, a non-contiguous output, a converted mask) for
    # a CPU-only gain at Q ~ T, so the op always runs its own kernel.
    return torch.ops.dllm.sparse_attention.default(
        q, k_cache, v_cache, key_valid, float(scale), bool(return_probs),
        None if query_counts is None else [int(n) for n in query_counts],
        None if key_counts is None else [int(t) for t in key_counts])


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``out[b, j] = x[b, idx[b, j]]``; rows with ``idx < 0`` are zeros.

    Args:
        x: ``[B, T, C]`` of any dtype (may be non-contiguous).
        idx: ``[B, Q]`` int64; repeats are allowed.

    Returns:
        ``[B, Q, C]`` contiguous, x's dtype.
    """
    return torch.ops.dllm.gather_rows.default(x, idx)


def scatter_rows(dst: torch.Tensor, src: torch.Tensor, idx: torch.Tensor) -> None:
    """``dst[b, idx[b, j]] = src[b, j]`` in place; ``idx < 0`` rows are skipped.

    Args:
        dst: ``[B, T, C]`` (written in place, may be non-contiguous).
        src: ``[B, Q, C]``, same dtype as dst.
        idx: ``[B, Q]`` int64, distinct non-negative entries within a row.
    """
    torch.ops.dllm.scatter_rows.default(dst, src, idx)


# ---- family: quant ------------------------------------------------------------
# dLLM-KVQ packed KV cache. Layouts and numerics: dllm_ops/packed_layout.py. On
# CUDA each op reads one 4-byte status word back (one device sync per call) to
# report data-dependent errors.

from .packed_layout import PackedK, PackedV  # noqa: E402


def quantize_k(k: torch.Tensor, bits: int = 4, group: int = 32, protect_p: int = 0,
               importance: torch.Tensor | None = None) -> PackedK:
    """Quantize a K cache per channel over groups of ``group`` tokens (KIVI's K
    layout), keeping the ``protect_p`` most important tokens of each group in
    high precision (dLLM-KVQ).

    Args:
        k: ``[B, H_kv, T, d]`` fp32/fp16/bf16 (the post-RoPE cache), ``d <= 256``,
            finite. Non-contiguous input is accepted.
        bits: 2 or 4.
        group: 8, 16, 32, 64 or 128 tokens. ``T`` need not be a multiple: the
            last group is quantized over its real tokens only.
        protect_p: 0..8 (``<= group``) tokens per group kept exactly; with 0
            this is plain KIVI K quantization.
        importance: ``[B, T]`` (shared by the heads) or ``[B, H_kv, T]`` float
            scores; required iff ``protect_p > 0`` (ignored otherwise). In each
            group the top ``protect_p`` real tokens are protected, ties to the
            lower index. Protected tokens are excluded from the group's min/max.

    Returns:
        :class:`dllm_ops.quant.PackedK` (codes, scale, min, prot_idx, prot_val,
        bits, group, length=T).

    Raises:
        RuntimeError ``dllm::quantize_k: ...`` for bad shapes/arguments, NaN or
        +-inf in ``k``, NaN importance (at a real token, when ``protect_p > 0``),
        or a group range whose scale overflows the dtype.
    """
    codes, scale, mn, prot_idx, prot_val = torch.ops.dllm.quantize_k.default(
        k, int(bits), int(group), int(protect_p), importance)
    return PackedK(codes, scale, mn, prot_idx, prot_val, int(bits), int(group), int(k.shape[2]))


def dequantize_k(packed: PackedK) -> torch.Tensor:
    """The ``[B, H_kv, T, d]`` K cache a :class:`PackedK` stands for (cache dtype):
    ``code * scale + min`` per element, protected tokens from ``prot_val``.

    Raises ``dllm::dequantize_k: ...`` on inconsistent shapes or a corrupt
    ``prot_idx`` (an entry that is not 255 and not below its group's real
    token count, or repeated within a group)."""
    return torch.ops.dllm.dequantize_k.default(*packed.tensors(), packed.bits, packed.group,
                                               packed.length)


def k_quant_error(k: torch.Tensor, bits: int = 4, group: int = 32) -> torch.Tensor:
    """dLLM-KVQ's "quantization error" importance: per token, the squared L2
    reconstruction error of plain (``protect_p = 0``) K quantization,

    ``err[b, h, t] = sum_c (k[b, h, t, c] - dequantize_k(quantize_k(k, bits, group))[b, h, t, c])^2``

    with both operands widened to fp32 and summed in fp32. ``k`` as in
    :func:`quantize_k`. Returns float32 ``[B, H_kv, T]``; average over heads
    for a ``[B, T]`` importance.
    """
    return torch.ops.dllm.k_quant_error.default(k, int(bits), int(group))


def quantize_v(v: torch.Tensor, bits: int = 4, group: int = 32) -> PackedV:
    """Quantize a V cache per token over groups of ``group`` channels (KIVI's V
    layout). ``v``: ``[B, H_kv, T, d]`` float, finite, ``d`` a multiple of
    ``group`` (8, 16, 32, 64, 128), ``d <= 256``; bits 2 or 4.

    Returns :class:`dllm_ops.quant.PackedV`. Raises ``dllm::quantize_v: ...``
    on bad arguments, NaN/+-inf in ``v`` or a scale overflowing the dtype.
    """
    codes, scale, mn = torch.ops.dllm.quantize_v.default(v, int(bits), int(group))
    return PackedV(codes, scale, mn, int(bits), int(group))


def dequantize_v(packed: PackedV) -> torch.Tensor:
    """The ``[B, H_kv, T, d]`` V cache a :class:`PackedV` stands for (cache dtype)."""
    return torch.ops.dllm.dequantize_v.default(*packed.tensors(), packed.bits, packed.group)


def quant_attention(q: torch.Tensor, k: PackedK, v: PackedV, key_valid: torch.Tensor | None,
                    scale: float) -> torch.Tensor:
    """Softmax attention of a block of queries over the packed KV cache.

    Equals ``sparse_attention(q, dequantize_k(k), dequantize_v(v), key_valid,
    scale)[0]``: the kernels dequantize the cache on the fly (values rounded
    to the cache dtype exactly as the dequantize ops produce them, protected
    tokens from ``prot_val``) and accumulate scores, softmax and output in
    fp32. CUDA dequantizes each key/value tile into shared memory. The CPU
    dequantizes one KV head at a time into cache-dtype scratch that stays in
    cache and runs ``sparse_attention``'s own tile over it, so there the
    equality is bit for bit.

    Args:
        q: ``[B, Q, H, d]`` (RoPE-rotated) in the cache dtype; ``H`` a multiple
            of ``H_kv`` (GQA).
        k, v: packed caches of the same ``B``, ``H_kv``, ``T = k.length`` and
            ``d``; their bits and groups may differ.
        key_valid: ``[B, T]`` bool or None; a batch row with no valid key gives
            zeros.
        scale: score multiplier, usually ``d ** -0.5``.

    Returns:
        ``[B, Q, H, d]`` in q's dtype.

    CUDA: the kernel has ``sparse_attention``'s tiles and splits the keys
    (split-KV) by the same occupancy rule, so its H200 arithmetic at LLaDA-8B
    shapes is the one tabled there: Q = 32 is 64 blocks for 132 SMs, cut into
    5 key chunks (T = 768: 160 keys each; T = 4096: 832) for 320 blocks; Q <=
    16 is 32 blocks, cut into 6 chunks of 128 keys at T = 768 (192 blocks)
    and 9 of 480 at T = 4096 (288 blocks); Q = 768 is 1536 blocks and is not
    split. Chunk boundaries need not meet K groups or packed code bytes: a
    chunk dequantizes exactly the tokens it reads. Block 0 of each (batch row,
    KV head) still validates every K group's ``prot_idx``, so a corrupt entry
    is reported whichever chunk reads it.
    """
    if k.length != v.codes.shape[2]:
        raise ValueError(f"quant_attention: packed K holds {k.length} tokens but packed V "
                         f"{v.codes.shape[2]}")
    return torch.ops.dllm.quant_attention.default(
        q, *k.tensors(), k.bits, k.group, *v.tensors(), v.bits, v.group, key_valid, float(scale))



def two_source_attention(q: torch.Tensor, k: PackedK, v: PackedV,
                         packed_valid: torch.Tensor | None, k_full: torch.Tensor,
                         v_full: torch.Tensor, full_valid: torch.Tensor | None, scale: float,
                         return_probs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One exact softmax attention over two key/value sources: a packed
    2/4-bit cache and a full-precision one (e.g. the active block's columns).

    This op exists so the decode loop reads the packed codes instead of
    dequantizing the whole packed region into a ``[B, H_kv, T, d]`` work
    buffer and copying the full columns beside it before one
    ``sparse_attention``. It reads, per (batch row, KV head), the packed K
    codes (``Tp * d * k.bits / 8`` bytes), the V codes (``Tp * d * v.bits /
    8``), K's per-group scales and mins (``2 * ceil(Tp / k.group) * d``
    values), V's per-token ones (``2 * Tp * d / v.group``), the protected
    indices and values (``ceil(Tp / k.group) * p`` bytes and as many rows of
    ``d`` values), plus the full columns ``k_full`` and ``v_full`` (``2 * Tf *
    d`` values in q's dtype) and the masks.

    Equals, with ``Tp = k.length`` and ``Tf = k_full.shape[2]``::

        sparse_attention(q, cat([dequantize_k(k), k_full], 2),
                         cat([dequantize_v(v), v_full], 2),
                         cat([packed_valid, full_valid], 1), scale, return_probs)

    (a None mask: every key of that source valid): keys ``0 .. Tp-1`` are the
    packed tokens, ``Tp .. Tp+Tf-1`` the full ones. Dequantized values are
    rounded to the cache dtype exactly as the dequantize ops produce them
    (protected tokens from ``prot_val``); scores, softmax and output
    accumulate in fp32. The CPU fills one KV head's scratch with its
    dequantized packed tokens followed by its full columns and runs
    ``sparse_attention``'s own tile over it, so there the equality is bit for
    bit, probabilities included (``quant_attention`` is the ``Tf = 0``,
    no-probabilities case of the same kernel). CUDA walks the concatenated
    key axis tile by tile (packed tiles dequantized into shared memory, full
    ones loaded), splits the keys by ``sparse_attention``'s occupancy rule
    (chunks may straddle the two sources) and merges chunks by log-sum-exp;
    probabilities are recomputed with the merged max and sum, as
    ``sparse_attention`` does.

    Args:
        q: ``[B, Q, H, d]`` (RoPE-rotated) in the cache dtype; ``H`` a multiple
            of ``H_kv`` (GQA). Non-contiguous tensors are accepted.
        k, v: packed caches of the same ``B``, ``H_kv``, ``Tp = k.length`` and
            ``d``; their bits and groups may differ. ``Tp`` may be 0 (the
            packed layout allows an empty cache).
        packed_valid: ``[B, Tp]`` bool or None.
        k_full, v_full: ``[B, H_kv, Tf, d]`` in q's dtype; ``Tf`` may be 0,
            but ``Tp + Tf`` must be > 0.
        full_valid: ``[B, Tf]`` bool or None.
        scale: score multiplier, usually ``d ** -0.5``.
        return_probs: also return the head-averaged probabilities.

    Returns:
        ``(out, probs_mean)``: ``out [B, Q, H, d]`` in q's dtype (zeros for a
        batch row with no valid key in either source); ``probs_mean [B, Q, Tp
        + Tf]`` float32, averaged over the H heads, 0 on invalid keys (an
        empty ``[0]`` tensor when ``return_probs`` is False).

    Raises:
        RuntimeError ``dllm::two_source_attention: ...`` for bad shapes,
        dtypes, devices, bits / groups, a non-finite scale, and a corrupt
        ``prot_idx`` (as ``quant_attention`` reports it).
    """
    if k.length != v.codes.shape[2]:
        raise ValueError(f"two_source_attention: packed K holds {k.length} tokens but packed V "
                         f"{v.codes.shape[2]}")
    return torch.ops.dllm.two_source_attention.default(
        q, *k.tensors(), k.bits, k.group, *v.tensors(), v.bits, v.group, packed_valid, k_full,
        v_full, full_valid, float(scale), bool(return_probs))

# ---- family: layer -------------------------------------------------------------
# The fused epilogues of a pre-norm transformer layer. Their roundings are
# those of the eager torch code they replace (dllm_ops/models/transformer.py;
# csrc/math/layer_math.h), so a model that calls them keeps its bits up to
# the order of one fp32 sum (the norm) and the exp of SiLU.


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> None:
    """Residual add + RMSNorm in one pass, in place (vLLM's ``fused_add_rms_norm``):
    ``residual += x``, then ``x = rmsnorm(residual) * weight``.

    Per row of ``C`` elements, with ``T(.)`` rounding fp32 to the dtype:
    ``r = T(residual + x)`` (torch's add), ``inv = 1 / sqrt(Σ r² / C + eps)``
    summed in fp32, ``x = T(T(r · inv) · weight)`` -- exactly the steps of
    ``xf = r.float(); (xf * rsqrt(xf.pow(2).mean(-1) + eps)).to(T) * weight``
    (LLaDA's and Dream's RMSNorm). The residual update is bit for bit that of
    ``residual + x``; the normed rows differ from the float64 oracle only by
    the fp32 sum's error (its order differs per backend and CPU instruction
    set), i.e. within an ulp or two of the dtype. A row's result does not
    depend on the other rows of the call.

    Args:
        x: ``[..., C]`` float32 / float16 / bfloat16; read, then overwritten
            with the normed rows (may be non-contiguous).
        residual: same shape, dtype and device as ``x``, not overlapping it;
            updated in place (may be non-contiguous).
        weight: ``[C]``, the same dtype.
        eps: added to the mean of squares, finite and ``>= 0``.

    Raises:
        RuntimeError ``dllm::add_rms_norm_: ...`` on a shape, dtype or device
        mismatch, overlapping ``x`` / ``residual``, or a bad ``eps``.
    """
    torch.ops.dllm.add_rms_norm_.default(x, residual, weight, float(eps))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated MLP's activation, ``F.silu(gate) * up``, in one pass.

    Two tensors, as the models' separate gate / up projections produce them;
    rows of a wider tensor work without a copy (e.g. the halves
    ``gu[..., :I], gu[..., I:]`` of one concatenated projection). Per element,
    ``T(T(silu(g)) · u)`` with ``silu(g) = g / (1 + e^-g)`` in fp32: the eager
    code's two roundings, so the bits are eager torch's up to the exp (within
    2 fp32 ulp; equal after rounding to bf16 / fp16 but for rare ties).

    Args:
        gate, up: ``[..., I]`` float32 / float16 / bfloat16, same shape, dtype
            and device; the last dim need not be contiguous (a copy is made).

    Returns:
        ``[..., I]`` contiguous, the inputs' dtype.

    Raises:
        RuntimeError ``dllm::silu_mul: ...`` on a shape, dtype or device mismatch.
    """
    return torch.ops.dllm.silu_mul.default(gate, up)
