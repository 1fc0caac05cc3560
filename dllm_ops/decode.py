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

What a decode runs is one :class:`dllm_ops.config.DecodeConfig`; every method's
wiring lives in its own module and the loop only calls it:

- cache method -> ``Policy`` (dllm_ops/policies): ``on_block_start`` / ``plan`` /
  ``on_step_end``;
- per-layer reuse -> ``DareReuse`` (dllm_ops/dare.py): ``begin_call``, then
  ``model.step`` asks it per layer;
- storage -> ``FullStorage`` / ``PackedStorage`` (dllm_ops/quant/storage.py):
  ``new_cache``, ``begin_block``, ``stats``;
- reveal -> ``RevealRule`` (dllm_ops/reveal.py) through ``commit_tokens``
  (dllm_ops/commit.py).

:class:`Decoder` is the loop made resumable: one ``step()`` is one model call;
``generate`` steps it to the end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .commit import Sampling, commit_tokens, finish_rows_at_eos
from .config import CacheConfig, DecodeConfig, config_from_generate_kwargs, merge
from .dare import DareReuse, make_dare
from .errors import DecodeError
from .layer_timer import LayerTimer
from .models import DiffusionLM
from .plan import StepPlan
from .policies import Policy, make_policy
from .prompts import check_prompts, prompt_ids
from .quant.storage import make_storage
from .reveal import build_reveal
from .reveal import dream_quota, quota_schedule  # noqa: F401  (re-exported)
from .state import DecodeState, LogitRowScores  # noqa: F401  (re-exported)
from .stats import DecodeStats, LayerTimes


@dataclass
class PendingCall:
    """A model call planned by :meth:`Decoder.begin_call`, awaiting its logits."""
    plan: StepPlan
    first: bool                   # the block's first call
    timer: LayerTimer | None


@dataclass
class GenerateOutput:
    tokens: torch.Tensor            # [B, gen_length] the whole generated region
    sequences: list[list[int]]      # per row, generated ids up to (excluding) the first EOS
    text: list[str] | None          # decoded `sequences` when a tokenizer was given
    stats: DecodeStats


def step_flops(model: DiffusionLM, plan: StepPlan, key_len: int) -> float:
    """Model FLOPs of one call: projections + attention over `key_len` keys + LM head rows."""
    return call_flops(model, plan.n_tokens, plan.n_logits, key_len)


def call_flops(model: DiffusionLM, n_tokens: int, n_logits: int, key_len: int) -> float:
    """Model FLOPs of a call running ``n_tokens`` tokens (attending over ``key_len``
    keys) and returning ``n_logits`` logits rows."""
    c = model.config
    proj = 2 * c.hidden_size * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads)
    mlp = 6 * c.hidden_size * c.intermediate_size
    attn = 4 * key_len * c.n_heads * c.head_dim
    return c.n_layers * n_tokens * (proj + mlp + attn) + n_logits * 2 * c.hidden_size * c.vocab_size


def _canvas(model: DiffusionLM, ids: list[list[int]], gen_length: int):
    """``x [B, T]`` (left pad | prompt | masked region) and ``valid [B, T]`` (pads out)."""
    c, device = model.config, model.device
    L = max(len(p) for p in ids)
    x = torch.full((len(ids), L + gen_length), c.mask_id, dtype=torch.long, device=device)
    valid = torch.ones_like(x, dtype=torch.bool)
    for r, p in enumerate(ids):
        x[r, : L - len(p)] = c.pad_id
        valid[r, : L - len(p)] = False
        x[r, L - len(p): L] = torch.tensor(p, device=device)
    return x, valid


def decode_parts(model: DiffusionLM, ids: list[list[int]], config: DecodeConfig, generators, *,
                 policy: Policy | None = None, reuse: DareReuse | None = None):
    """Every check a decode of ``ids`` runs before its first call, and the objects
    it builds: ``(policy, storage, reuse rule, reveal rule)``; no cache is
    allocated (the server checks a request with this before queueing it)."""
    check_prompts(model, ids, config.shape.gen_length)
    policy = policy if policy is not None else make_policy(config.cache)
    storage = make_storage(model, config.storage, policy.name)
    reuse = reuse if reuse is not None else make_dare(config.reuse, model.config)
    rule = build_reveal(model.config.arch, config.reveal, config.shape, policy.name, generators)
    return policy, storage, reuse, rule


def up_to_eos(region: list[int], eos_id: int) -> list[int]:
    """A row's generated ids up to (excluding) its first EOS."""
    return region[: region.index(eos_id)] if eos_id in region else region


def generated_count(sequence: list[int], mask_id: int) -> int:
    """The tokens a sequence holds (masks left by ``max_blocks`` do not count)."""
    return sum(1 for t in sequence if t != mask_id)


def make_sampling(model: DiffusionLM, config: DecodeConfig, generators,
                  wants_max_prob: bool = False) -> Sampling:
    """How a decode of ``config`` on ``model`` draws and scores tokens (one
    generator per row)."""
    c, r = model.config, config.reveal
    # The mask token is never a decoding outcome: committing it would leave the
    # position masked and a threshold loop would never end (random or small
    # models do predict it). Real checkpoints give it negligible mass.
    suppress = torch.tensor([c.mask_id] + ([c.eos_id] if r.suppress_eos else []), device=model.device)
    return Sampling(temperature=r.temperature, remasking=r.remasking if c.arch != "dream" else None,
                    top_p=r.top_p, top_k=r.top_k, dream=c.arch == "dream", suppress=suppress,
                    generators=generators, wants_max_prob=wants_max_prob)


class Decoder:
    """One decode of a batch of prompts, advanced one model call at a time::

        dec = Decoder(model, ids, config)
        while dec.step():      # one model call (opening the next block when needed)
            ...                # dec.state.x holds the canvas so far
        out = dec.result()

    ``policy`` / ``reuse`` replace the objects the configuration would build
    (tests and benchmarks pass instrumented ones).
    """

    def __init__(self, model: DiffusionLM, ids: list[list[int]], config: DecodeConfig, *,
                 policy: Policy | None = None, reuse: DareReuse | None = None, tokenizer=None):
        c, shape = model.config, config.shape
        self.model, self.config, self.tokenizer = model, config, tokenizer
        B = len(ids)
        generators = [torch.Generator(device="cpu").manual_seed(shape.seed) for _ in range(B)]
        self.policy, self.storage, self.reuse, self.rule = decode_parts(
            model, ids, config, generators, policy=policy, reuse=reuse)
        # a wrapping policy that does not say (bench's call counter) leaves its
        # inner policy scoring itself
        self.sampling = make_sampling(model, config, generators,
                                      wants_max_prob=getattr(self.policy, "wants_max_prob", False))
        x, valid = _canvas(model, ids, shape.gen_length)
        self.state = DecodeState(model=model, x=x, cache=self.storage.new_cache(model, valid),
                                 gen_start=x.shape[1] - shape.gen_length,
                                 block_length=shape.block_length,
                                 active=torch.ones(B, dtype=torch.bool, device=model.device))
        self.block_limit = shape.blocks_to_decode
        self.blocks_decoded = 0
        self.flops = 0.0
        self.eos_filled = torch.zeros(B, dtype=torch.long)
        self.layer_times = LayerTimes([], []) if config.time_layers else None
        self.wall_s = 0.0

    @torch.no_grad()
    def step(self) -> bool:
        """Run the next model call; False (and no call) once the decode is finished."""
        t0 = time.perf_counter()
        try:
            if not self.ready():
                return False
            self._call()
            return True
        finally:
            self.wall_s += time.perf_counter() - t0

    def _open_next_block(self) -> bool:
        s = self.state
        if self.blocks_decoded >= self.block_limit or (self.blocks_decoded and not bool(s.active.any())):
            return False
        s.block_start = s.gen_start + self.blocks_decoded * s.block_length
        s.block_end = s.block_start + s.block_length
        s.step = 0
        self.blocks_decoded += 1
        self.storage.begin_block(s.cache, s.block_start, s.block_end)
        self.rule.start_block(s.block_candidates())
        return True

    def _call(self) -> None:
        call = self.begin_call()
        logits = self.model.step(self.state.x, call.plan, self.state.cache,
                                 return_probs=self.policy.wants_probs, reuse=self.reuse,
                                 layer_timer=call.timer)
        self.end_call(call, logits)

    def begin_call(self) -> "PendingCall":
        """The policy's plan for the next call (the block must be open and have
        candidates: ``step`` sees to it); the model call itself is the caller's.
        A server batching several decoders into one model call runs
        ``begin_call`` on each, one model call, then ``end_call`` on each."""
        s, first = self.state, self.state.step == 0
        plan = self.policy.on_block_start(s) if first else self.policy.plan(s)
        if self.reuse is not None:
            self.reuse.begin_call(refresh=first)
        timer = LayerTimer(self.model.device) if self.layer_times is not None else None
        return PendingCall(plan, first, timer)

    def end_call(self, call: "PendingCall", logits: torch.Tensor) -> None:
        """Commit tokens from the call's ``[B, P, V]`` logits and advance the state."""
        s, plan = self.state, call.plan
        if call.timer is not None:
            self.layer_times.seconds.append(call.timer.seconds)
            self.layer_times.block_start.append(call.first)
        s.last_plan, s.last_logits, s.last_scores = plan, logits, None
        s.nfe += 1
        s.recomputed.append(plan.n_tokens)
        self.flops += step_flops(self.model, plan, s.x.shape[1])
        commit = commit_tokens(s, plan, logits, self.rule, self.sampling)
        self.policy.on_step_end(s, commit)
        s.step += 1
        if self.config.shape.stop_at_eos:
            self.eos_filled += finish_rows_at_eos(s).cpu()

    def ready(self) -> bool:
        """Open blocks until the current one has candidates; False once the decode is
        finished (then no call is due)."""
        s = self.state
        while not (self.blocks_decoded and bool(s.block_candidates().any())):
            if not self._open_next_block():
                return False
        return True

    def result(self) -> GenerateOutput:
        """The generated region, per-row sequences (up to EOS), text and stats."""
        s, c = self.state, self.model.config
        tokens = s.x[:, s.gen_start:].cpu()
        sequences = [up_to_eos(row, c.eos_id) for row in tokens.tolist()]
        n_gen = sum(generated_count(q, c.mask_id) for q in sequences)
        wall = self.wall_s
        stats = DecodeStats(
            nfe=s.nfe, wall_s=wall, generated_tokens=n_gen,
            tokens_per_s=n_gen / wall if wall > 0 else float("nan"),
            tokens_recomputed=sum(s.recomputed) * c.n_layers, recomputed_per_step=list(s.recomputed),
            n_layers=c.n_layers,
            model_flops=self.flops - (self.reuse.flops_saved if self.reuse is not None else 0.0),
            eos_filled=self.eos_filled.tolist(), cache=self.policy.name, reveal=self.rule.name,
            blocks_decoded=self.blocks_decoded, blocks=self.config.shape.num_blocks,
            dare=self.reuse.stats() if self.reuse is not None else None,
            kv_quant=self.storage.stats(s.cache), layer_times=self.layer_times)
        text = [self.tokenizer.decode(q) for q in sequences] if self.tokenizer is not None else None
        return GenerateOutput(tokens=tokens, sequences=sequences, text=text, stats=stats)


def resolve_config(config: DecodeConfig | dict | None, options: dict, policy: Policy | None = None,
                   reuse: DareReuse | None = None) -> DecodeConfig:
    """The DecodeConfig of a ``generate`` call: ``config`` (an object, or a partial
    dict of its fields) with generate's keyword spelling (``options``) on top. A
    policy object stands for the cache section and a reuse object for the reuse
    section; naming another method there as well is an error."""
    if config is None or isinstance(config, dict):
        config = merge(DecodeConfig(), config or {})
    elif not isinstance(config, DecodeConfig):
        raise DecodeError(f"config must be a DecodeConfig or a dict of its fields, "
                          f"got {type(config).__name__}")
    own = policy.cache_config() if policy is not None else None
    if own is not None:
        if config.cache not in (CacheConfig(), own):
            raise DecodeError(f"a policy object ({policy.name!r}) replaces the configuration's "
                              f"cache section, which names {config.cache.to_dict()}: give one")
        config = config.replace(cache=own)
    config = config_from_generate_kwargs(config, **options)
    if own is not None and config.cache != own:
        raise DecodeError(f"give a cache method or a policy object ({policy.name!r}), not both")
    if reuse is not None and config.reuse.method != "none":
        raise DecodeError("give a reuse method or a DareReuse object, not both")
    return config


@torch.no_grad()
def generate(model: DiffusionLM, tokenizer_or_ids, config: DecodeConfig | dict | None = None, *,
             prompt=None, messages=None, policy: Policy | None = None,
             reuse: DareReuse | None = None, **options) -> GenerateOutput:
    """Decode ``config.shape.gen_length`` tokens after each prompt.

    Args:
        tokenizer_or_ids: a tokenizer (then pass ``prompt=`` text(s) or chat
            ``messages=``; instruct checkpoints get their chat template), or
            token ids: one list, a list of lists (a batch) or a tensor.
        config: what to run, a :class:`dllm_ops.config.DecodeConfig` (or a
            partial dict of it, as its JSON): the shape (gen/block length,
            steps, seed, EOS stop), the reveal rule, the cache method (none /
            prefix / dual / d2cache), per-layer reuse (DARE-KV / DARE-O) and
            storage (full, or packed KIVI / dLLM-KVQ). Each field's meaning is
            in dllm_ops/config.py.
        policy: a ``dllm_ops.policies.Policy`` object instead of the
            configuration's cache method (an instrumented or new policy).
        reuse: a ``dllm_ops.dare.DareReuse`` object instead of the
            configuration's reuse (to keep its per-call log).
        **options: generate's keyword spelling (``cache="dual"``,
            ``gen_length=64``, ``d2cache=dict(rollout_p=0.2)``, ``dare="kv"``,
            ``dare_opts=dict(rho=0.5)``, ``kv_quant=dict(bits=4, method="kivi")``,
            ``sigma=3``): a thin mapping onto the configuration's fields
            (``dllm_ops.config.config_from_generate_kwargs``), applied on top
            of ``config``.

    Every row draws from its own generator seeded with ``shape.seed``, so a
    row of a batch decodes exactly as it would alone. ``stats`` is a
    :class:`dllm_ops.stats.DecodeStats`.
    """
    if isinstance(options.get("dare"), DareReuse):   # generate's older spelling of `reuse=`
        reuse = options.pop("dare")
    config = resolve_config(config, options, policy, reuse)
    ids, tok = prompt_ids(tokenizer_or_ids, prompt, messages)
    decoder = Decoder(model, ids, config, policy=policy, reuse=reuse, tokenizer=tok)
    while decoder.step():
        pass
    return decoder.result()
