"""dLLM-KVQ policy selection: per layer, the (score, p) that best preserves
behaviour on TRACE trajectories (the dLLM-KVQ paper, "K-Cache Policy Selection",
"Policy Diagnostics and Selection"; docs/design.md, "dLLM-KVQ").

Records are (sample, block, step, layer) for every later step of every block
of every calibration trajectory (the block-start step reuses nothing). For a
record, the reference is the full recompute of that step's state; the
baseline is the reused cache with every layer quantized at p = 0 (KIVI K and
V); a candidate (score, p) for layer l replaces layer l's K policy and leaves
the others at the baseline, so records of a layer measure that layer's
choice in the deployed setting (all layers quantized). Metrics, each turned
into an improvement over the baseline (baseline - candidate for the first
two, candidate - baseline for the last two):

- centered score distance: L2 distance between the mean-removed logit
  vectors of candidate and reference, averaged over the block's masked
  positions (those whose logits the cached call produces);
- attention KL: KL(reference || candidate) of layer l's head-averaged
  attention rows of the block's queries, averaged over queries;
- top-1 key agreement: share of those queries whose most-attended key agrees;
- top-K key recall: share of the reference's top-K keys (K = 8) among the
  candidate's top-K, averaged over queries.

A candidate's loss is ``-mean(weighted gain) + lambda * (B - bits)`` with
weights 1.0 / 0.001 / 0.10 / 0.05, ``lambda = BIT_PENALTY`` per bit and
``B = bits + p (16 - bits) / G`` its effective K bits (protected tokens cost
16 bits instead of ``bits``; scale/min overhead is the same for every
candidate and is left out, as the paper's 4.77 / 4.60 figures under a 4.9 cap
require). It is eligible when its mean weighted gain is positive, it has at
least ``MIN_RECORDS`` records, it wins on score distance in at least half of
them (win-rate gate 0.5) and ``B`` is within the cap: 4.9 at 4 bits (p <= 2),
2.9 at 2 bits (our choice: the same ~0.9-bit headroom, also p <= 2). The
eligible candidate with the lowest loss is chosen; with none, p = 0.
"""
from __future__ import annotations

import torch

from ..plan import KVCache, StepPlan, mask_to_idx
from ..quant.cache import QuantKVCache
from ..quant.policy_table import BUDGETS, SCORES, LayerPolicy
from .trace import Schedule, states

WEIGHTS = dict(score_dist=1.0, attn_kl=0.001, top1=0.10, topk=0.05)
WIN_RATE = 0.5
K_BITS_CAP = {4: 4.9, 2: 2.9}
BIT_PENALTY = 0.02
TOPK = 8
MIN_RECORDS = 8
BASELINE = LayerPolicy("qerror", 0)
CANDIDATES = [LayerPolicy(s, p) for s in SCORES for p in BUDGETS if p > 0]


def policy_k_bits(bits: int, p: int, group: int = 32, value_bits: int = 16) -> float:
    """Effective K bits of a layer policy: ``bits + p (value_bits - bits) / group``."""
    return bits + p * (value_bits - bits) / group


def _fresh_run(T: int, bs: int, be: int, cache: str) -> torch.Tensor:
    run = torch.zeros(1, T, dtype=torch.bool)
    run[0, bs:(be if cache == "dual" else T)] = True
    return run


@torch.no_grad()
def _run_block(model, x0, xts, bs, be, cache, bits, group, layers, logit_pos):
    """Decode the block's later states over a cache built at ``x0`` (quantized
    per ``layers``, or full precision when ``layers`` is None for the
    reference, which recomputes every token): per step ``(logits [P, V],
    probs per layer [Qb, T])`` of the block's queries."""
    c = model.config
    T = x0.shape[0]
    out = []
    if layers is None:
        full = StepPlan.full(1, T, model.device)
        for xt in xts:
            kv = model.new_cache(torch.ones(1, T, dtype=torch.bool, device=model.device))
            plan = StepPlan(full.idx, logit_pos)
            logits = model.step(xt[None].to(model.device), plan, kv, return_probs=True)
            out.append((logits[0].float(), [p[0, bs:be] for p in kv.probs]))
        return out
    valid = torch.ones(1, T, dtype=torch.bool, device=model.device)
    qc = QuantKVCache(n_layers=c.n_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, key_valid=valid,
                      dtype=model.dtype, device=model.device, mode=cache, bits=bits, group=group,
                      layers=layers)
    qc.begin_block(bs, be)
    model.step(x0[None].to(model.device), StepPlan.full(1, T, model.device), qc)
    run = mask_to_idx(_fresh_run(T, bs, be, cache)).to(model.device)
    for xt in xts:
        logits = model.step(xt[None].to(model.device), StepPlan(run, logit_pos), qc, return_probs=True)
        out.append((logits[0].float(), [p[0, : be - bs] for p in qc.probs]))
    return out


def _metrics(z, z_ref, p, p_ref) -> dict:
    zc = z - z.mean(-1, keepdim=True)
    zr = z_ref - z_ref.mean(-1, keepdim=True)
    eps = 1e-12
    kl = (p_ref * ((p_ref + eps).log() - (p + eps).log())).sum(-1).mean()
    k = min(TOPK, p.shape[-1])
    top_a = p.topk(k, -1).indices
    top_r = p_ref.topk(k, -1).indices
    recall = (top_a[..., :, None] == top_r[..., None, :]).any(-1).float().mean()
    return dict(score_dist=float((zc - zr).norm(dim=-1).mean()) if z.shape[0] else 0.0,
                attn_kl=float(kl), top1=float((p.argmax(-1) == p_ref.argmax(-1)).float().mean()),
                topk=float(recall))


def _gain(m: dict, base: dict) -> tuple[float, float]:
    """(weighted improvement over the baseline, score-distance improvement)."""
    d = dict(score_dist=base["score_dist"] - m["score_dist"], attn_kl=base["attn_kl"] - m["attn_kl"],
             top1=m["top1"] - base["top1"], topk=m["topk"] - base["topk"])
    return sum(WEIGHTS[k] * v for k, v in d.items()), d["score_dist"]


def block_cases(trajectory: dict, mask_id: int, block_length: int, steps_per_block: int,
                dream: bool):
    """Per block of a TRACE trajectory: ``(x0, [x_t, ...], block_start, block_end)``
    (canvases of the prompt plus the answer region)."""
    prompt, answer, a = trajectory["prompt"], trajectory["answer"], trajectory["assignment"]
    sched = Schedule(len(answer), block_length, steps_per_block, first_at_block_start=dream)
    xs = states(prompt, answer, a, mask_id, sched)
    L, S = len(prompt), steps_per_block
    for b in range(sched.n_blocks):
        yield xs[b * S], list(xs[b * S + 1:(b + 1) * S]), L + b * block_length, L + (b + 1) * block_length


def collect(model, trajectories, cache: str, bits: int, block_length: int, steps_per_block: int,
            group: int = 32, progress=None) -> dict:
    """Records: ``{(layer, candidate): [(gain, score_dist_gain), ...]}``."""
    c = model.config
    L = c.n_layers
    shift = 1 if c.logit_shift else 0
    records: dict = {(l, a): [] for l in range(L) for a in CANDIDATES}
    for tr in trajectories:
        for x0, xts, bs, be in block_cases(tr, c.mask_id, block_length, steps_per_block, c.logit_shift):
            if not xts:
                continue
            T = x0.shape[0]
            # logits of the block's positions whose source position the cached call runs
            pos = torch.arange(bs, be) - shift
            pos = pos[pos >= bs][None].to(model.device)
            masked = [(xt[pos[0].cpu() + shift] == c.mask_id) for xt in xts]
            ref = _run_block(model, x0, xts, bs, be, cache, bits, group, None, pos)
            base = _run_block(model, x0, xts, bs, be, cache, bits, group, [BASELINE] * L, pos)
            base_m = [[_metrics(zb[m], zr[m], pb[l], pr[l]) for l in range(L)]
                      for (zb, pb), (zr, pr), m in zip(base, ref, masked)]
            for l in range(L):
                for a in CANDIDATES:
                    layers = [BASELINE] * L
                    layers[l] = a
                    got = _run_block(model, x0, xts, bs, be, cache, bits, group, layers, pos)
                    for t, ((z, p), (zr, pr), m) in enumerate(zip(got, ref, masked)):
                        records[(l, a)].append(_gain(_metrics(z[m], zr[m], p[l], pr[l]), base_m[t][l]))
                    if progress is not None:
                        progress.update(1)
    return records


def choose(records: dict, n_layers: int, bits: int, group: int = 32) -> tuple[list[LayerPolicy], list]:
    """Per layer, the eligible candidate of lowest loss (else p = 0), plus a
    report of every candidate's statistics."""
    cap = K_BITS_CAP[bits]
    chosen, report = [], []
    for l in range(n_layers):
        best, best_loss = BASELINE, None
        for a in CANDIDATES:
            rec = records[(l, a)]
            n = len(rec)
            gain = sum(g for g, _ in rec) / n if n else 0.0
            win = sum(1 for _, d in rec if d > 0) / n if n else 0.0
            kb = policy_k_bits(bits, a.p, group)
            loss = -gain + BIT_PENALTY * (kb - bits)
            ok = n >= MIN_RECORDS and gain > 0 and win >= WIN_RATE and kb <= cap
            report.append(dict(layer=l, score=a.score, p=a.p, records=n, gain=gain, win_rate=win,
                               k_bits=kb, loss=loss, eligible=ok))
            if ok and (best_loss is None or loss < best_loss):
                best, best_loss = a, loss
        chosen.append(best)
    return chosen, report
