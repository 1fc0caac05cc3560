"""One call's outcome: score the logits rows the call returned and commit tokens.

``commit_tokens`` turns a call's ``[B, P, V]`` logits into the ``[B, T]``
commit mask of the current block: ``dllm.token_confidence`` on the rows (after
Dream's logit filter), random draws from each row's own generator, and the
reveal rule's choice. ``finish_rows_at_eos`` retires rows whose text ended.
No tensor of block × vocabulary is formed, so a call costs what it recomputes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import ops
from .errors import DecodeError
from .plan import StepPlan
from .reveal import RevealCall, RevealRule
from .state import DecodeState, LogitRowScores


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn and scored (from a RevealConfig and the model)."""
    temperature: float
    remasking: str | None        # LLaDA's "low_confidence" | "random"; None for Dream
    top_p: float | None
    top_k: int | None
    dream: bool
    suppress: torch.Tensor       # token ids whose logits count as -inf (mask, EOS if suppressed)
    generators: list             # one torch.Generator per row
    wants_max_prob: bool = False  # the policy reads each row's max probability (Policy.wants_max_prob)

    @functools.cached_property
    def suppress_ids(self) -> frozenset[int]:
        """``suppress`` as a set of Python ints (read once per decode, not per call)."""
        return frozenset(self.suppress.tolist())


def dream_filter_logits(logits: torch.Tensor, temperature: float, top_p: float | None,
                        top_k: int | None) -> torch.Tensor:
    """Dream's sample_tokens logit processing: ``/ T``, then top-p (keep the
    shortest prefix of the sorted distribution whose mass exceeds p, at least
    one token), then top-k; removed tokens become -inf."""
    x = logits / temperature if temperature > 0 else logits
    neg_inf = torch.tensor(float("-inf"), dtype=x.dtype, device=x.device)
    if top_p is not None and top_p < 1:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(-1)
        drop = cum > top_p
        drop[..., 1:] = drop[..., :-1].clone()
        drop[..., 0] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), neg_inf)
    if top_k is not None:
        k = min(int(top_k), x.shape[-1])
        kth = torch.topk(x, k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, neg_inf)
    return x


def _block_positions(state: DecodeState, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`block_positions` of the state's current block."""
    return block_positions(plan.logits_idx, state.block_start, state.block_end - state.block_start,
                           state.model.config.logit_shift)


def block_positions(logits_idx: torch.Tensor, start, n: int,
                    logit_shift: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """For each logits row of a call (``[B, P]`` canvas positions, −1 pads): the
    position it predicts in its row's block of ``n`` from column ``start`` (an
    int, or ``[B, 1]``: each row's own block) and whether that is in the block."""
    shift = 1 if logit_shift else 0  # Dream: row j-1 predicts token j
    pos = logits_idx + shift - start
    in_block = (logits_idx >= 0) & (pos >= 0) & (pos < n)
    return pos, in_block


def _rows_to_block(values: torch.Tensor, pos: torch.Tensor, in_block: torch.Tensor, n: int,
                   fill) -> torch.Tensor:
    """Scatter per-row ``[B, P]`` values to ``[B, n]`` block positions; positions no row
    predicts hold `fill`. Rows outside the block go to a spare column that is dropped."""
    B = values.shape[0]
    out = torch.full((B, n + 1), fill, dtype=values.dtype, device=values.device)
    out.scatter_(1, torch.where(in_block, pos, n), values)
    return out[:, :n]


def _gumbel_noise_rows(generators, drawing: list[bool], pos: torch.Tensor, in_block: torch.Tensor,
                       n: int, V: int, device) -> torch.Tensor:
    """``[B*P, V]`` float32 Gumbel noise for the call's logits rows.

    A drawing row consumes its generator's stream exactly as a decode always has:
    one ``(n, V)`` float64 uniform per call, block position by position, so a
    row samples the same tokens alone or in any batch and whatever the cache.
    Only the rows that have logits are transformed and kept (gathered from
    the draw); the draw itself stays ``n × V``, which is the price of that stream.
    """
    B, P = pos.shape
    noise = torch.zeros(B, P, V, dtype=torch.float32)
    rows, keep = pos.clamp(0, n - 1).cpu(), in_block.cpu()
    for r in range(B):
        if drawing[r]:
            u = torch.rand((n, V), generator=generators[r], dtype=torch.float64)
            g = -torch.log(-torch.log(u.index_select(0, rows[r]).clamp_min(1e-300)))
            noise[r] = torch.where(keep[r, :, None], g.float(), 0.0)
    return noise.to(device).reshape(B * P, V)


def _uniform_draws(generators, drawing: list[bool], B: int, n: int, device) -> torch.Tensor:
    """``[B, n]``: one uniform per block position from each drawing row's generator."""
    uniform = torch.zeros(B, n)
    for r in range(B):
        if drawing[r]:
            uniform[r] = torch.rand((n,), generator=generators[r])
    return uniform.to(device)


def commit_tokens(state: DecodeState, plan: StepPlan, logits, rule: RevealRule,
                  sampling: Sampling) -> torch.Tensor:
    """Pick and commit tokens of the current block; returns the ``[B, T]`` commit mask.

    Scores come from the ``[B, P, V]`` logits rows the call returned and are
    scattered to ``[B, n]`` block positions: no tensor of block × vocabulary is
    formed (a sampled decode still draws its ``n × V`` uniform stream, see
    ``_gumbel_noise_rows``), so a call costs what it recomputes.
    """
    B, T = state.x.shape
    s, e = state.block_start, state.block_end
    n = e - s
    pos, in_block = _block_positions(state, plan)
    has = _rows_to_block(in_block, pos, in_block, n, False)          # [B, n]
    cand = state.block_candidates()                                # [B, n]
    if plan.partial_logits:
        # d²Cache: a mask this call did not predict is not its candidate. A row
        # left with none while it has candidates would make no progress, call
        # after call (a plan that predicts none of them is a policy's bug): an
        # error rather than a decode that never ends.
        fresh = cand & has
        if bool((cand.any(1) & ~fresh.any(1)).any()):
            raise DecodeError("the policy's plan has logits for none of a row's candidates "
                              "(partial_logits): the decode would make no progress")
        cand = fresh
    elif bool((cand & ~has).any()):
        raise DecodeError("the policy's plan has no logits for a candidate")
    token, score, uniform = block_scores(state, logits, pos, in_block, cand, rule, sampling)
    region = state.x[:, state.gen_start:] != state.mask_id
    commit = rule.select(RevealCall(score, cand, state.step, uniform, region, s - state.gen_start)) & cand
    block = state.x[:, s:e]
    state.x[:, s:e] = torch.where(commit, token, block)
    full = torch.zeros((B, T), dtype=torch.bool, device=state.x.device)
    full[:, s:e] = commit
    return full


def block_scores(state, logits: torch.Tensor, pos: torch.Tensor, in_block: torch.Tensor,
                 cand: torch.Tensor, rule: RevealRule, sampling: Sampling):
    """Each block position's token and ranking score ``[B, n]`` from the call's
    ``[B, P, V]`` logits rows (``pos`` / ``in_block``: where each row predicts, as
    ``_block_positions`` gives them; ``cand [B, n]``: the rows' candidates), and
    the uniform draws ``[B, n]`` when the rule or the remasking draws (else None).
    ``state`` gives ``mask_id`` and receives ``last_scores``; rows are independent,
    so the server's stacked decodes (rows at different blocks) use it as is."""
    B, P, V = logits.shape
    n = cand.shape[1]
    # Random draws, per row from the row's own generator, only for rows that
    # decode this call: a row's stream is the one it would consume alone.
    # (A greedy decode draws nothing and does not read the rows back.)
    draws_noise = sampling.temperature > 0
    draws_uniform = sampling.remasking == "random" or rule.draws_uniform
    drawing = cand.any(1).tolist() if draws_noise or draws_uniform else None
    noise = None
    if draws_noise:
        noise = _gumbel_noise_rows(sampling.generators, drawing, pos, in_block, n, V, logits.device)
    uniform = None
    if draws_uniform:
        uniform = _uniform_draws(sampling.generators, drawing, B, n, cand.device)
    token, score = _row_scores(state, logits, rule.mode, sampling, noise)
    token = _rows_to_block(token.view(B, P), pos, in_block, n, state.mask_id)
    score = _rows_to_block(score.view(B, P), pos, in_block, n, 0.0)
    if sampling.remasking == "random":
        score = uniform
    return token, score, uniform


def _row_scores(state: DecodeState, logits, mode: str, sampling: Sampling,
                noise) -> tuple[torch.Tensor, torch.Tensor]:
    """``dllm.token_confidence`` over the call's ``[B*P, V]`` logits rows (Dream's
    filter first); records them on ``state.last_scores`` for the policy.

    A policy that wants each row's max probability with only the mask token
    suppressed (``sampling.wants_max_prob``, d²Cache) gets it from the same
    pass: it is the score itself for a greedy "prob" rule suppressing only the
    mask, else ``dllm.token_confidence_max_prob`` adds it (one pass per call)."""
    B, P, V = logits.shape
    temperature, suppress = sampling.temperature, sampling.suppress
    top_p, top_k = sampling.top_p, sampling.top_k
    # The op reads bf16 / fp16 rows itself (widened exactly, same bits as on
    # their float32 copy), so only Dream's filter, which edits the rows, needs
    # a float32 copy.
    scores = logits.reshape(B * P, V)
    conf_temperature = float(temperature)
    filtered = False
    if sampling.dream:
        scores = scores.float()
        # Dream's sample_tokens: the mask token is removed first (it is never an
        # outcome here), then / T, top-p, top-k; token and confidence both come
        # from the processed distribution, so the op runs at temperature 1.
        scores = scores.index_fill(-1, suppress, float("-inf"))
        scores = dream_filter_logits(scores, float(temperature), top_p, top_k)
        conf_temperature = 1.0 if temperature > 0 else 0.0
        filtered = temperature > 0 or (top_p is not None and top_p < 1) or top_k is not None
    only_mask = sampling.suppress_ids == {state.mask_id}
    is_max_prob = mode == "prob" and temperature == 0 and not filtered and only_mask
    # The max probability over the ids other than the mask is a function of the
    # raw rows. The op's rows are those rows (converted to float32) except for
    # Dream: its filter changes the rows (/ T, top-p, top-k), and then the second
    # quantity is over different inputs, so d²Cache keeps scoring the raw rows
    # itself. Unfiltered Dream rows differ from the raw ones only at the
    # suppressed ids, which the max probability leaves out when suppress is
    # just the mask. max_prob_suppress = [mask] ⊆ suppress is the op's rule.
    raw_rows = not sampling.dream or (not filtered and only_mask)
    if (sampling.wants_max_prob and not is_max_prob and raw_rows
            and state.mask_id in sampling.suppress_ids):
        keep = torch.tensor([state.mask_id], device=suppress.device)
        token, score, max_prob = ops.token_confidence_max_prob(scores, mode, conf_temperature,
                                                               suppress, noise, keep)
        max_prob = max_prob.view(B, P)
    else:
        token, score = ops.token_confidence(scores, mode, conf_temperature, suppress, noise)
        max_prob = None
    if is_max_prob:
        max_prob = score.view(B, P)
    state.last_scores = LogitRowScores(token.view(B, P), score.view(B, P), max_prob)
    return token, score


def finish_rows_at_eos(state: DecodeState) -> torch.Tensor:
    """Retire rows whose text reached EOS; return how many masks each row had filled."""
    c = state.model.config
    g = state.x[:, state.gen_start:]
    return fill_rows_ended_at_eos(g, g == c.eos_id, g == c.mask_id, state.active, c.eos_id)


def fill_rows_ended_at_eos(g: torch.Tensor, is_eos: torch.Tensor, masked: torch.Tensor,
                           active: torch.Tensor, eos_id: int) -> torch.Tensor:
    """The EOS stop on canvas rows ``g [B, G]`` whose generated positions hold
    ``is_eos`` / ``masked`` (False outside a row's region): a row is done when it
    has an EOS and no mask before the first one; its masks become EOS (in
    ``g``) and it leaves ``active`` (in place). Returns the masks filled per row."""
    # A position precedes the row's first EOS iff no EOS is at or before it
    # (the inclusive running count is still 0).
    before_first_eos = is_eos.cumsum(1) == 0
    done = active & is_eos.any(1) & ~(masked & before_first_eos).any(1)
    # Branch-free: no host read of `done` (a device sync per call on CUDA).
    fill = masked & done[:, None]
    g.masked_fill_(fill, eos_id)
    active &= ~done
    return fill.sum(1)
