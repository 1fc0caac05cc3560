"""The block-wise diffusion decode loop.

One loop serves every cache method: a Policy says which tokens each model
call recomputes (dllm_ops/policies), the model runs only those
(DiffusionLM.step), and the reveal rules run as dllm ops
(dllm.token_confidence, dllm.select_transfer).

Semantics reproduced (see shared/reference/fastdllm_llada_dream.md):
- LLaDA `generate` (unmask="topk"): per block, ``steps / num_blocks`` steps with
  the quota schedule ``base = n // steps`` and +1 for the first ``n % steps``.
- Fast-dLLM `generate` / `_with_prefix_cache` / `_with_dual_cache`: the block
  starts with a full forward whose logits commit step 0; "threshold" commits
  every masked token with confidence >= tau plus the argmax; "factor" is the
  ``1 - f/(n+1)`` rule.
- Dream: logits are shifted by one position (token j is predicted from the
  hidden state at j-1); the block-start call commits only the token at the
  block start (its argmax); later steps follow the chosen `alg`.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from . import ops
from .models import DiffusionLM
from .plan import KVCache, StepPlan, mask_to_idx
from .policies import Policy, make_policy

# Dream's algorithms -> (confidence mode of dllm.token_confidence, reveal rule)
DREAM_ALGS = {"maskgit_plus": ("prob", "topk"), "topk_margin": ("margin", "topk"),
              "entropy": ("neg_entropy", "topk"), "confidence_threshold": ("prob", "threshold")}


class DecodeError(ValueError):
    pass


@dataclass
class GenerateOutput:
    tokens: torch.Tensor            # [B, gen_length] the whole generated region
    sequences: list[list[int]]      # per row, generated ids up to (excluding) the first EOS
    text: list[str] | None          # decoded `sequences` when a tokenizer was given
    stats: dict = field(default_factory=dict)


def quota_schedule(n: int, steps: int) -> list[int]:
    """LLaDA's get_num_transfer_tokens for one block: n tokens over `steps` steps."""
    base, rem = divmod(n, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


def dream_quota(n_mask: int, step: int, steps: int, eps: float = 1e-3) -> int:
    """Dream's timestep quota: ``int(n_mask * (1 - s/t))`` on ``linspace(1, eps, steps+1)``,
    everything on the last step."""
    if step >= steps - 1:
        return n_mask
    t = 1 - step * (1 - eps) / steps
    s = 1 - (step + 1) * (1 - eps) / steps
    return int(n_mask * (1 - s / t))


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
        ids = [t.tolist()] if t.dim() == 1 else [r.tolist() for r in t]
    else:
        seqs = list(tokenizer_or_ids)
        ids = [list(seqs)] if seqs and isinstance(seqs[0], int) else [list(s) for s in seqs]
    if not ids:
        raise DecodeError("dllm_ops.generate: no prompts given")
    return ids, tok


def _validate(model, ids, gen_length, block_length, steps, unmask):
    c = model.config
    if gen_length <= 0 or block_length <= 0 or gen_length % block_length:
        raise DecodeError(f"dllm_ops.generate: gen_length ({gen_length}) must be a positive "
                          f"multiple of block_length ({block_length})")
    nb = gen_length // block_length
    if unmask == "topk" and (steps <= 0 or steps % nb):
        raise DecodeError(f"dllm_ops.generate: steps ({steps}) must be a positive multiple of the "
                          f"number of blocks ({nb}) for unmask='topk'")
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
             gen_length: int = 128, block_length: int = 32, steps: int | None = None,
             unmask: str = "topk", threshold: float = 0.9, factor: float = 1.0,
             temperature: float = 0.0, remasking: str = "low_confidence", cache: str = "none",
             alg: str | None = None, suppress_eos: bool = False, stop_at_eos: bool = True,
             seed: int = 0, policy: Policy | None = None,
             max_blocks: int | None = None) -> GenerateOutput:
    """Decode `gen_length` tokens after each prompt.

    Args:
        tokenizer_or_ids: a tokenizer (then pass ``prompt=`` text(s) or chat
            ``messages=``; instruct checkpoints get their chat template), or
            token ids: one list, a list of lists (a batch) or a tensor.
        gen_length, block_length: the generated region and its block size.
        steps: model calls budgeted for the whole region (default gen_length);
            sets the top-k quota. Threshold/factor decoding runs until each block
            has no masks left.
        unmask: "topk" | "threshold" | "factor" (LLaDA); for Dream pass ``alg``.
        remasking: "low_confidence" (max softmax probability) | "random".
        temperature: > 0 samples with Gumbel noise, LLaDA's add_gumbel_noise.
        cache: "none" | "prefix" | "dual" (Fast-dLLM), or pass a ``policy``.
        alg: Dream's "entropy" | "maskgit_plus" | "topk_margin" | "confidence_threshold".
        suppress_eos: LLaDA's logits_eos_inf (EOS logits count as -inf). The
            mask token's logit always counts as -inf: it is never committed.
        stop_at_eos: a row whose text has reached EOS (an EOS with no mask
            before it) stops running; its remaining masks are filled with EOS
            and counted in ``stats["eos_filled"]``.
        seed: seeds the Gumbel noise and random remasking.
        max_blocks: benchmark knob: decode only the first blocks. The rest of
            the region stays masked and ``stats["blocks_decoded"]`` says so.
    """
    c = model.config
    ids, tok = _as_prompt_ids(model, tokenizer_or_ids, prompt, messages)
    steps = gen_length if steps is None else steps
    if c.arch == "dream":
        alg = alg or "entropy"
        if alg not in DREAM_ALGS:
            raise DecodeError(f"dllm_ops.generate: unknown Dream alg {alg!r}; choose from {sorted(DREAM_ALGS)}")
        mode, unmask = DREAM_ALGS[alg]
    else:
        if unmask not in ("topk", "threshold", "factor"):
            raise DecodeError(f"dllm_ops.generate: unknown unmask {unmask!r}")
        if remasking not in ("low_confidence", "random"):
            raise DecodeError(f"dllm_ops.generate: unknown remasking {remasking!r}")
        mode = "prob"
    _validate(model, ids, gen_length, block_length, steps, unmask)
    policy = policy or make_policy(cache)

    device = model.device
    B, L = len(ids), max(len(p) for p in ids)
    T = L + gen_length
    x = torch.full((B, T), c.mask_id, dtype=torch.long, device=device)
    valid = torch.ones((B, T), dtype=torch.bool, device=device)
    for r, p in enumerate(ids):  # left padding, masked out of attention
        x[r, : L - len(p)] = c.pad_id
        valid[r, : L - len(p)] = False
        x[r, L - len(p): L] = torch.tensor(p, device=device)
    state = DecodeState(model=model, x=x, cache=model.new_cache(valid), gen_start=L,
                        block_length=block_length, active=torch.ones(B, dtype=torch.bool, device=device))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    # The mask token is never a decoding outcome: committing it would leave the
    # position masked and a threshold loop would never end (random or small
    # models do predict it). Real checkpoints give it negligible mass.
    suppress = torch.tensor([c.mask_id] + ([c.eos_id] if suppress_eos else []), device=device)
    num_blocks = gen_length // block_length
    steps_per_block = steps // num_blocks if unmask == "topk" else None
    flops = 0.0
    eos_filled = torch.zeros(B, dtype=torch.long)
    t0 = time.perf_counter()

    blocks_decoded = 0
    for blk in range(num_blocks if max_blocks is None else min(num_blocks, max_blocks)):
        blocks_decoded += 1
        state.block_start = L + blk * block_length
        state.block_end = state.block_start + block_length
        state.step = 0
        quota = quota_schedule(block_length, steps_per_block) if c.arch == "llada" and steps_per_block else None
        while bool(state.candidates().any()):
            plan = policy.on_block_start(state) if state.step == 0 else policy.plan(state)
            logits = model.step(state.x, plan, state.cache, return_probs=policy.wants_probs)
            state.nfe += 1
            state.recomputed.append(plan.n_tokens)
            flops += step_flops(model, plan, T)
            commit = _reveal(state, plan, logits, mode=mode, unmask=unmask, quota=quota,
                             steps_per_block=steps_per_block, threshold=threshold, factor=factor,
                             temperature=temperature, remasking=remasking, suppress=suppress, gen=gen)
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
                 blocks_decoded=blocks_decoded, blocks=num_blocks)
    text = [tok.decode(s) for s in sequences] if tok is not None else None
    return GenerateOutput(tokens=tokens, sequences=sequences, text=text, stats=stats)


def _reveal(state: DecodeState, plan: StepPlan, logits, *, mode, unmask, quota, steps_per_block,
            threshold, factor, temperature, remasking, suppress, gen) -> torch.Tensor:
    """Pick and commit tokens of the current block; returns the ``[B, T]`` commit mask."""
    c = state.model.config
    B, T = state.x.shape
    s, e = state.block_start, state.block_end
    cand = state.candidates()[:, s:e]                              # [B, n]
    n = e - s
    # Logit rows per block position (plan.logits_idx is ascending, -1 padded).
    src = torch.arange(s, e, device=state.x.device) - (1 if c.logit_shift else 0)
    V = logits.shape[-1]
    P = plan.logits_idx.shape[1]
    where = (plan.logits_idx[:, None, :] == src[None, :, None])    # [B, n, P]
    has = where.any(-1)
    row = where.float().argmax(-1)                                  # [B, n]
    flat = torch.zeros(B, n, V, dtype=logits.dtype, device=logits.device)
    if P:
        flat = torch.where(has[..., None], logits.gather(1, row[..., None].expand(B, n, V)), flat)
    if bool((cand & ~has).any()):
        raise DecodeError("dllm_ops.generate: the policy's plan has no logits for a candidate")
    noise = None
    if temperature > 0:
        u = torch.rand((B * n, V), generator=gen, dtype=torch.float64).clamp_min(1e-300)
        noise = (-torch.log(-torch.log(u))).float().to(logits.device)
    token, score = ops.token_confidence(flat.reshape(B * n, V).float(), mode, float(temperature),
                                        suppress, noise)
    token, score = token.view(B, n), score.view(B, n)
    if remasking == "random":
        score = torch.rand((B, n), generator=gen).to(score.device)
    if c.arch == "dream" and state.step == 0:
        # Dream's block start commits exactly the token at the block start.
        commit = torch.zeros_like(cand)
        commit[:, 0] = cand[:, 0]
        if not bool(commit.any()):
            commit = _transfer(score, cand, "topk", torch.ones(B, dtype=torch.long), threshold, factor)
    elif unmask == "topk":
        if quota is not None:
            k = quota[min(state.step, len(quota) - 1)]
            kk = torch.full((B,), k, dtype=torch.long)
        else:  # Dream timestep quota, over the remaining masks of each row
            steps_left = max(1, steps_per_block - 1)
            kk = torch.tensor([dream_quota(int(m), state.step - 1, steps_left) for m in cand.sum(1)])
        kk = torch.minimum(kk, cand.sum(1).cpu())
        commit = _transfer(score, cand, "topk", kk, threshold, factor)
    else:
        commit = _transfer(score, cand, unmask, None, threshold, factor)
    commit &= cand
    block = state.x[:, s:e]
    state.x[:, s:e] = torch.where(commit, token, block)
    full = torch.zeros((B, T), dtype=torch.bool, device=state.x.device)
    full[:, s:e] = commit
    return full


def _transfer(score, cand, rule, k, threshold, factor):
    k_t = k.to(score.device) if k is not None else None
    return ops.select_transfer(score.float().contiguous(), cand.contiguous(), rule, k_t,
                               float(threshold), float(factor))


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
