"""The block-wise diffusion decode loop.

One loop serves every cache method: a Policy says which tokens each model
call recomputes (dllm_ops/policies), the model runs only those
(DiffusionLM.step), and the reveal rules run as dllm ops
(dllm.token_confidence, dllm.select_transfer).

Semantics reproduced (from LLaDA's and Fast-dLLM's public generation code):
- LLaDA `generate` (unmask="topk"): per block, ``steps / num_blocks`` steps with
  the quota schedule ``base = n // steps`` and +1 for the first ``n % steps``.
- Fast-dLLM `generate` / `_with_prefix_cache` / `_with_dual_cache`: the block
  starts with a full forward whose logits commit step 0; "threshold" commits
  every masked token with confidence >= tau plus the argmax; "factor" is the
  ``1 - f/(n+1)`` rule.
- Dream: logits are shifted by one position (token j is predicted from the
  hidden state at j-1). With a cache it runs Fast-dLLM's block loop (the
  block-start call commits only the token at the block start, its argmax;
  later steps follow the chosen `alg`); without a cache it is Dream's own
  ``diffusion_generate`` (dllm_ops/reveal.py says exactly how).
The reveal rules (which candidates a call commits) live in dllm_ops/reveal.py.
"""
from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, field

import torch

from . import ops
from .models import DiffusionLM
from .plan import KVCache, StepPlan, mask_to_idx
from .errors import DecodeError
from .dare import DareReuse, LayerTimer, make_dare
from .policies import Policy, make_policy
from .quant.reuse import quantized_policy
from .reveal import DREAM_ALGS, LLADA_RULES, CertaintyPrior, RevealCall, RevealRule, reveal_rule
from .reveal import dream_quota, quota_schedule  # noqa: F401  (re-exported)


@dataclass
class GenerateOutput:
    tokens: torch.Tensor            # [B, gen_length] the whole generated region
    sequences: list[list[int]]      # per row, generated ids up to (excluding) the first EOS
    text: list[str] | None          # decoded `sequences` when a tokenizer was given
    stats: dict = field(default_factory=dict)


@dataclass
class LogitRowScores:
    """``dllm.token_confidence`` of each logits row of the last call, ``[B, P]``
    (rows follow ``DecodeState.last_plan.logits_idx``), so a policy reads the
    call's scores instead of scoring the same logits again."""
    token: torch.Tensor
    score: torch.Tensor
    #: the score is the max softmax probability with only the mask token
    #: suppressed (rule mode "prob", greedy, no EOS suppression, no Dream filter)
    is_max_prob: bool


@dataclass
class DecodeState:
    """Everything a policy may look at; owned and advanced by the loop."""
    model: DiffusionLM
    x: torch.Tensor                # [B, T] canvas: left pad | prompt | generated region
    cache: KVCache
    gen_start: int
    block_length: int
    active: torch.Tensor           # [B] rows still decoding (False once finished at EOS)
    block_start: int = 0
    block_end: int = 0
    step: int = 0                  # model calls in the current block
    nfe: int = 0
    recomputed: list = field(default_factory=list)   # tokens run per call (per layer)
    last_plan: StepPlan | None = None      # the last call's plan and its logits [B, P, V]
    last_logits: torch.Tensor | None = None  # (rows follow last_plan.logits_idx)
    last_scores: LogitRowScores | None = None  # the reveal's scores of those rows

    @property
    def mask_id(self) -> int:
        return self.model.config.mask_id

    def valid_and_active(self) -> torch.Tensor:
        return self.cache.key_valid & self.active[:, None]

    def masked(self) -> torch.Tensor:
        return self.x == self.mask_id

    def candidates(self) -> torch.Tensor:
        """[B, T] masked positions of the current block in active rows."""
        c = torch.zeros_like(self.x, dtype=torch.bool)
        c[:, self.block_start:self.block_end] = self.masked()[:, self.block_start:self.block_end]
        return c & self.active[:, None]

    def plan_for(self, run: torch.Tensor) -> StepPlan:
        """A plan running `run` and returning logits for the block's candidates."""
        want = self.candidates()
        if self.model.config.logit_shift:
            # Token j is predicted from position j-1. In a chunk that does not
            # run j-1 (j = chunk start after the block-start call) that token is
            # already committed, so it never needs logits.
            want = torch.roll(want, -1, dims=1)
            want[:, -1] = False
        return StepPlan(mask_to_idx(run), mask_to_idx(want & run))


def _is_id(v) -> bool:
    """An integer token id (Python / numpy / 0-d integer tensor), not a bool or float."""
    if isinstance(v, torch.Tensor):
        return v.dim() == 0 and not (v.is_floating_point() or v.is_complex() or v.dtype == torch.bool)
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _as_prompt_ids(model, tokenizer_or_ids, prompt, messages):
    tok = None
    if hasattr(tokenizer_or_ids, "encode"):
        tok = tokenizer_or_ids
        if messages is not None:
            convs = messages if messages and isinstance(messages[0], list) else [messages]
            texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
                     for c in convs]
        elif prompt is not None:
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
        else:
            raise DecodeError("dllm_ops.generate: give `prompt=` or `messages=` with a tokenizer")
        ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    elif isinstance(tokenizer_or_ids, torch.Tensor):
        t = tokenizer_or_ids
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool or t.dim() not in (1, 2):
            raise DecodeError(f"dllm_ops.generate: prompt ids must be an integer tensor [L] or [B, L], "
                              f"got {t.dtype} of shape {tuple(t.shape)}")
        ids = [t.tolist()] if t.dim() == 1 else [r.tolist() for r in t]
    else:
        seqs = list(tokenizer_or_ids)
        flat = seqs and (isinstance(seqs[0], numbers.Number) or getattr(seqs[0], "ndim", None) == 0)
        ids = [seqs] if flat else [list(s) for s in seqs]
        for r, p in enumerate(ids):
            bad = next((v for v in p if not _is_id(v)), None)
            if bad is not None:
                raise DecodeError(f"dllm_ops.generate: prompt {r} holds {bad!r}: token ids must be "
                                  f"integers")
            ids[r] = [int(v) for v in p]
    if not ids:
        raise DecodeError("dllm_ops.generate: no prompts given")
    return ids, tok


def _validate(model, ids, gen_length, block_length, steps, needs_steps):
    c = model.config
    if gen_length <= 0 or block_length <= 0 or gen_length % block_length:
        raise DecodeError(f"dllm_ops.generate: gen_length ({gen_length}) must be a positive "
                          f"multiple of block_length ({block_length})")
    nb = gen_length // block_length
    if needs_steps and (steps <= 0 or steps % nb):
        raise DecodeError(f"dllm_ops.generate: steps ({steps}) must be a positive multiple of the "
                          f"number of blocks ({nb}) for {needs_steps}")
    for r, p in enumerate(ids):
        if len(p) == 0:
            raise DecodeError(f"dllm_ops.generate: prompt {r} is empty")
        if len(p) + gen_length > c.max_seq_len:
            raise DecodeError(f"dllm_ops.generate: prompt {r} ({len(p)} tokens) + gen_length "
                              f"({gen_length}) exceeds the model's maximum of {c.max_seq_len}")
        if c.mask_id in p:
            raise DecodeError(f"dllm_ops.generate: prompt {r} contains the mask id {c.mask_id}")
        if min(p) < 0 or max(p) >= c.vocab_size:
            raise DecodeError(f"dllm_ops.generate: prompt {r} has ids outside [0, {c.vocab_size})")


def _validate_sampling(arch, temperature, top_p, top_k, alg_temp):
    if temperature < 0:
        raise DecodeError(f"dllm_ops.generate: temperature ({temperature}) must be >= 0")
    dream_only = {"top_p": top_p, "top_k": top_k, "alg_temp": alg_temp}
    if arch != "dream":
        given = [k for k, v in dream_only.items() if v is not None]
        if given:
            raise DecodeError(f"dllm_ops.generate: {', '.join(given)} are Dream sampling options; "
                              f"LLaDA's generate has none")
        return
    if top_p is not None and not 0 < top_p <= 1:
        raise DecodeError(f"dllm_ops.generate: top_p ({top_p}) must be in (0, 1]")
    if top_k is not None and (int(top_k) != top_k or top_k < 1):
        raise DecodeError(f"dllm_ops.generate: top_k ({top_k}) must be a positive integer")
    if alg_temp is not None and alg_temp < 0:
        raise DecodeError(f"dllm_ops.generate: alg_temp ({alg_temp}) must be >= 0")


def step_flops(model: DiffusionLM, plan: StepPlan, key_len: int) -> float:
    """Model FLOPs of one call: projections + attention over `key_len` keys + LM head rows."""
    c = model.config
    n = plan.n_tokens
    proj = 2 * c.hidden_size * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads)
    mlp = 6 * c.hidden_size * c.intermediate_size
    attn = 4 * key_len * c.n_heads * c.head_dim
    return c.n_layers * n * (proj + mlp + attn) + int((plan.logits_idx >= 0).sum()) * 2 * c.hidden_size * c.vocab_size


@torch.no_grad()
def generate(model: DiffusionLM, tokenizer_or_ids, *, prompt=None, messages=None,
             kv_quant: dict | None = None,
             gen_length: int = 128, block_length: int = 32, steps: int | None = None,
             unmask: str = "topk", threshold: float = 0.9, factor: float = 1.0,
             temperature: float = 0.0, remasking: str = "low_confidence", cache: str = "none",
             alg: str | None = None, top_p: float | None = None, top_k: int | None = None,
             alg_temp: float | None = None, suppress_eos: bool = False, stop_at_eos: bool = True,
             seed: int = 0, policy: Policy | None = None,
             max_blocks: int | None = None, dare=None, dare_opts: dict | None = None,
             time_layers: bool = False, d2cache: dict | None = None,
             sigma: float | None = None) -> GenerateOutput:
    """Decode `gen_length` tokens after each prompt.

    Args:
        tokenizer_or_ids: a tokenizer (then pass ``prompt=`` text(s) or chat
            ``messages=``; instruct checkpoints get their chat template), or
            token ids: one list, a list of lists (a batch) or a tensor.
        gen_length, block_length: the generated region and its block size.
        steps: model calls budgeted for the whole region (default gen_length),
            split evenly over the blocks; sets the top-k quota (LLaDA) and
            Dream's timestep schedule. Threshold/factor decoding runs until each
            block has no masks left.
        unmask: LLaDA's reveal rule, "topk" | "threshold" | "factor".
        remasking: "low_confidence" (max softmax probability) | "random" (LLaDA).
        temperature: > 0 samples. LLaDA: Gumbel-max on ``logits / T`` (its
            add_gumbel_noise), confidence from the un-tempered softmax. Dream:
            a sample of ``softmax(logits / T)`` after top_p / top_k (drawn as a
            Gumbel-max), confidence from that same distribution, as Dream's
            sample_tokens.
        cache: "none" | "prefix" | "dual" (Fast-dLLM), "d2cache" (d²Cache,
            dllm_ops/policies/d2cache.py), or pass a ``policy``.
        d2cache: d²Cache's options with ``cache="d2cache"``, a dict of
            ``rollout_p`` (0.1), ``current_k`` (32), ``sigma`` (10); an error
            with any other cache. (Or pass ``policy=dllm_ops.policies.D2Cache(...)``.)
        sigma: certainty-prior decoding with any cache and rule: candidates are
            ranked by score × D(σ) (dllm_ops.reveal.CertaintyPrior). None or 0
            (default): off, as in the reference; its d²Cache runs use 10.
        alg: Dream's "origin" | "maskgit_plus" | "topk_margin" | "entropy" |
            "confidence_threshold" (default "entropy"). Without a cache Dream
            runs its own diffusion_generate schedule (on each block in turn when
            ``block_length < gen_length``); with a cache Fast-dLLM's block loop
            ("origin" exists only without one). See dllm_ops/reveal.py.
        top_p, top_k, alg_temp: Dream's token filters and position-sampling
            temperature (``alg_temp > 0`` samples the committed positions from
            ``softmax(confidence / alg_temp)`` instead of taking the top ones).
        suppress_eos: LLaDA's logits_eos_inf (EOS logits count as -inf). The
            mask token's logit always counts as -inf: it is never committed.
        stop_at_eos: a row whose text has reached EOS (an EOS with no mask
            before it) stops running; its remaining masks are filled with EOS
            and counted in ``stats["eos_filled"]``.
        seed: seeds the sampling. Every row draws from its own generator seeded
            with ``seed``, so a row of a batch decodes exactly as it would alone.
        max_blocks: benchmark knob: decode only the first blocks. The rest of
            the region stays masked and ``stats["blocks_decoded"]`` says so.
        dare: DARE's per-layer reuse inside each model call (dllm_ops/dare.py):
            "kv" (only drifting tokens recompute K/V) | "o" (only drifting
            tokens attend; the others reuse their attention output), narrowing
            the tokens the cache mode runs; block starts reuse nothing. Or a
            ``DareReuse`` from ``dllm_ops.dare.make_dare`` (to keep its log).
        dare_opts: ``dict(rho=...)`` (target reuse fraction in [0, 1), split
            over layers by redundancy, optional ``phi_max`` in [rho, 1), default
            (1 + rho) / 2) or ``dict(tau=...)`` (reuse iff drift < tau, tau >= 0).
            ``stats`` gains ``dare_reuse_share`` (overall and per layer) and
            ``model_flops`` counts only what ran.
        time_layers: record each call's per-layer wall seconds in
            ``stats["layer_seconds"]`` (``stats["layer_seconds_block_start"]``
            marks the block-start calls).
        kv_quant: with cache "prefix" / "dual": store the reused region packed,
            ``dict(bits=2|4, method="kivi"|"kvq", policy=<table or path>, group=32)``
            (dllm_ops/quant/reuse.py); ``stats`` then reports the cache bytes.
    """
    c = model.config
    ids, tok = _as_prompt_ids(model, tokenizer_or_ids, prompt, messages)
    steps = gen_length if steps is None else steps
    if policy is not None and d2cache is not None:
        raise DecodeError("dllm_ops.generate: give d2cache options or a policy, not both")
    if sigma is not None and (isinstance(sigma, bool) or not isinstance(sigma, (int, float))
                              or not math.isfinite(sigma) or sigma < 0):
        raise DecodeError(f"dllm_ops.generate: sigma must be a finite number >= 0 (0 or None: off), "
                          f"got {sigma!r}")
    policy = policy or make_policy(cache, d2cache)
    if kv_quant is not None:
        try:
            policy = quantized_policy(model, policy, kv_quant)
        except ValueError as e:
            raise DecodeError(str(e)) from None
    reuse = dare if isinstance(dare, DareReuse) else make_dare(dare, dare_opts, c)
    if c.arch == "dream":
        rule_name = alg or "entropy"
        if rule_name not in DREAM_ALGS:
            raise DecodeError(f"dllm_ops.generate: unknown Dream alg {rule_name!r}; "
                              f"choose from {sorted(DREAM_ALGS)}")
        # Dream without a cache is its own diffusion_generate; with one, Fast-dLLM's block loop.
        own_loop = policy.name == "none"
        needs_steps = f"Dream's alg {rule_name!r}" if own_loop or rule_name != "confidence_threshold" else None
    else:
        rule_name = unmask
        if unmask not in LLADA_RULES:
            raise DecodeError(f"dllm_ops.generate: unknown unmask {unmask!r}; choose from {list(LLADA_RULES)}")
        if remasking not in ("low_confidence", "random"):
            raise DecodeError(f"dllm_ops.generate: unknown remasking {remasking!r}")
        own_loop = False
        needs_steps = "unmask='topk'" if unmask == "topk" else None
    _validate(model, ids, gen_length, block_length, steps, needs_steps)
    _validate_sampling(c.arch, temperature, top_p, top_k, alg_temp)

    device = model.device
    B, L = len(ids), max(len(p) for p in ids)
    T = L + gen_length
    num_blocks = gen_length // block_length
    generators = [torch.Generator(device="cpu").manual_seed(seed) for _ in range(B)]
    try:
        rule = reveal_rule(c.arch, rule_name, dream_own_loop=own_loop, steps_per_block=steps // num_blocks,
                           threshold=threshold, factor=factor, alg_temp=alg_temp, generators=generators)
        if sigma:
            rule = CertaintyPrior(rule, sigma)
        rule.check(block_length, steps // num_blocks)
    except ValueError as e:
        raise DecodeError(f"dllm_ops.generate: {e}") from None
    sampling = dict(temperature=float(temperature), remasking=remasking if c.arch != "dream" else None,
                    top_p=top_p, top_k=top_k, dream=c.arch == "dream")

    x = torch.full((B, T), c.mask_id, dtype=torch.long, device=device)
    valid = torch.ones((B, T), dtype=torch.bool, device=device)
    for r, p in enumerate(ids):  # left padding, masked out of attention
        x[r, : L - len(p)] = c.pad_id
        valid[r, : L - len(p)] = False
        x[r, L - len(p): L] = torch.tensor(p, device=device)
    state = DecodeState(model=model, x=x, cache=(policy.new_cache(model, valid) if kv_quant is not None
                                               else model.new_cache(valid)), gen_start=L,
                        block_length=block_length, active=torch.ones(B, dtype=torch.bool, device=device))
    # The mask token is never a decoding outcome: committing it would leave the
    # position masked and a threshold loop would never end (random or small
    # models do predict it). Real checkpoints give it negligible mass.
    suppress = torch.tensor([c.mask_id] + ([c.eos_id] if suppress_eos else []), device=device)
    flops = 0.0
    eos_filled = torch.zeros(B, dtype=torch.long)
    layer_seconds, layer_block_start = [], []
    t0 = time.perf_counter()

    blocks_decoded = 0
    for blk in range(num_blocks if max_blocks is None else min(num_blocks, max_blocks)):
        blocks_decoded += 1
        state.block_start = L + blk * block_length
        state.block_end = state.block_start + block_length
        state.step = 0
        rule.start_block(state.candidates()[:, state.block_start:state.block_end])
        while bool(state.candidates().any()):
            plan = policy.on_block_start(state) if state.step == 0 else policy.plan(state)
            if reuse is not None:
                reuse.begin_call(refresh=state.step == 0)
            timer = LayerTimer(device) if time_layers else None
            logits = model.step(state.x, plan, state.cache, return_probs=policy.wants_probs,
                                reuse=reuse, layer_timer=timer)
            if timer is not None:
                layer_seconds.append(timer.seconds)
                layer_block_start.append(state.step == 0)
            state.last_plan, state.last_logits, state.last_scores = plan, logits, None
            state.nfe += 1
            state.recomputed.append(plan.n_tokens)
            flops += step_flops(model, plan, T)
            commit = _reveal(state, plan, logits, rule, suppress=suppress, generators=generators, **sampling)
            policy.on_step_end(state, commit)
            state.step += 1
            if stop_at_eos:
                eos_filled += _finish_rows_at_eos(state).cpu()
        if not bool(state.active.any()):
            break
    wall = time.perf_counter() - t0

    tokens = state.x[:, L:].cpu()
    sequences = []
    for r in range(B):
        row = tokens[r].tolist()
        sequences.append(row[: row.index(c.eos_id)] if c.eos_id in row else row)
    n_gen = sum(sum(1 for t in s if t != c.mask_id) for s in sequences)  # masks: max_blocks runs
    stats = dict(nfe=state.nfe, wall_s=wall, generated_tokens=n_gen,
                 tokens_per_s=n_gen / wall if wall > 0 else float("nan"),
                 tokens_recomputed=sum(state.recomputed) * c.n_layers,
                 recomputed_per_step=list(state.recomputed), n_layers=c.n_layers,
                 model_flops=flops, eos_filled=eos_filled.tolist(), cache=policy.name,
                 reveal=rule.name, blocks_decoded=blocks_decoded, blocks=num_blocks)
    if kv_quant is not None:
        stats.update(policy.kv_quant_stats())
    if reuse is not None:
        stats.update(reuse.stats())
        stats["model_flops"] = flops - reuse.flops_saved
    if time_layers:
        stats.update(layer_seconds=layer_seconds, layer_seconds_block_start=layer_block_start)
    text = [tok.decode(s) for s in sequences] if tok is not None else None
    return GenerateOutput(tokens=tokens, sequences=sequences, text=text, stats=stats)


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
    """For each logits row of the call (``[B, P]``, following ``plan.logits_idx``): the
    block position it predicts (0 .. n-1) and whether that position is in the block."""
    shift = 1 if state.model.config.logit_shift else 0  # Dream: row j-1 predicts token j
    pos = plan.logits_idx + shift - state.block_start
    in_block = (plan.logits_idx >= 0) & (pos >= 0) & (pos < state.block_end - state.block_start)
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


def _reveal(state: DecodeState, plan: StepPlan, logits, rule: RevealRule, *, temperature, remasking,
            top_p, top_k, dream, suppress, generators) -> torch.Tensor:
    """Pick and commit tokens of the current block; returns the ``[B, T]`` commit mask.

    Scores come from the ``[B, P, V]`` logits rows the call returned and are
    scattered to ``[B, n]`` block positions: no tensor of block × vocabulary is
    formed (a sampled decode still draws its ``n × V`` uniform stream, see
    ``_gumbel_noise_rows``), so a call costs what it recomputes.
    """
    B, T = state.x.shape
    s, e = state.block_start, state.block_end
    n = e - s
    P, V = logits.shape[1], logits.shape[2]
    pos, in_block = _block_positions(state, plan)
    has = _rows_to_block(in_block, pos, in_block, n, False)          # [B, n]
    cand = state.candidates()[:, s:e]                              # [B, n]
    if getattr(plan, "partial_logits", False):
        cand = cand & has  # d²Cache: a mask this call did not predict is not its candidate
    elif bool((cand & ~has).any()):
        raise DecodeError("dllm_ops.generate: the policy's plan has no logits for a candidate")
    # Random draws, per row from the row's own generator, only for rows that
    # decode this call: a row's stream is the one it would consume alone.
    drawing = cand.any(1).tolist()
    noise = None
    if temperature > 0:
        noise = _gumbel_noise_rows(generators, drawing, pos, in_block, n, V, logits.device)
    uniform = None
    if remasking == "random" or rule.draws_uniform:
        uniform = _uniform_draws(generators, drawing, B, n, state.x.device)
    token, score = _row_scores(state, logits, rule.mode, temperature=temperature, top_p=top_p,
                               top_k=top_k, dream=dream, suppress=suppress, noise=noise)
    token = _rows_to_block(token.view(B, P), pos, in_block, n, state.mask_id)
    score = _rows_to_block(score.view(B, P), pos, in_block, n, 0.0)
    if remasking == "random":
        score = uniform
    region = state.x[:, state.gen_start:] != state.mask_id
    commit = rule.select(RevealCall(score, cand, state.step, uniform, region, s - state.gen_start)) & cand
    block = state.x[:, s:e]
    state.x[:, s:e] = torch.where(commit, token, block)
    full = torch.zeros((B, T), dtype=torch.bool, device=state.x.device)
    full[:, s:e] = commit
    return full


def _row_scores(state: DecodeState, logits, mode: str, *, temperature, top_p, top_k, dream, suppress,
                noise) -> tuple[torch.Tensor, torch.Tensor]:
    """``dllm.token_confidence`` over the call's ``[B*P, V]`` logits rows (Dream's
    filter first); records them on ``state.last_scores`` for the policy."""
    B, P, V = logits.shape
    scores = logits.reshape(B * P, V).float()
    conf_temperature = float(temperature)
    filtered = False
    if dream:
        # Dream's sample_tokens: the mask token is removed first (it is never an
        # outcome here), then / T, top-p, top-k; token and confidence both come
        # from the processed distribution, so the op runs at temperature 1.
        scores = scores.index_fill(-1, suppress, float("-inf"))
        scores = dream_filter_logits(scores, float(temperature), top_p, top_k)
        conf_temperature = 1.0 if temperature > 0 else 0.0
        filtered = temperature > 0 or (top_p is not None and top_p < 1) or top_k is not None
    token, score = ops.token_confidence(scores, mode, conf_temperature, suppress, noise)
    max_prob = (mode == "prob" and temperature == 0 and not filtered
                and suppress.numel() == 1 and int(suppress[0]) == state.mask_id)
    state.last_scores = LogitRowScores(token.view(B, P), score.view(B, P), max_prob)
    return token, score


def _finish_rows_at_eos(state: DecodeState) -> torch.Tensor:
    """Retire rows whose text reached EOS; return how many masks each row had filled."""
    c = state.model.config
    g = state.x[:, state.gen_start:]
    is_eos = g == c.eos_id
    masked = g == c.mask_id
    G = g.shape[1]
    first_eos = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full_like(is_eos[:, 0], G, dtype=torch.long))
    before = torch.arange(G, device=g.device)[None, :] < first_eos[:, None]
    done = state.active & is_eos.any(1) & ~(masked & before).any(1)
    filled = torch.zeros(g.shape[0], dtype=torch.long, device=g.device)
    if bool(done.any()):
        fill = masked & done[:, None]
        filled = fill.sum(1)
        g[fill] = c.eos_id
        state.active &= ~done
    return filled
