"""Benchmarks of the `select` family."""
import torch
import torch.nn.functional as F

import dllm_ops
from dllm_ops import reference

from .registry import Case, register, tensor_bytes


def _cosine_inputs(shape):
    def make(device, dtype):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
        y = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
        return x, y
    return make


def _eager_fp32(x, y):
    # What a user writes without this library: upcast, then torch's cosine.
    return 1 - F.cosine_similarity(x.float(), y.float(), dim=-1)


for _shape in [(32, 512, 4096), (1, 768, 4096)]:
    register(Case(
        op="cosine_drift", shape="x".join(map(str, _shape)), make=_cosine_inputs(_shape),
        run=dllm_ops.cosine_drift,
        baselines={"reference": reference.cosine_drift, "torch_fp32": _eager_fp32},
        # read x and x_prev, write one float per row
        nbytes=lambda a: tensor_bytes(*a) + a[0].numel() // a[0].shape[-1] * 4,
        dtypes=(torch.bfloat16, torch.float32),
    ))


# ---- token_confidence ---------------------------------------------------------
# [64, 126464] is 64 masked positions of LLaDA's vocabulary (Dream: 152,064).

def _logits(shape, noisy=False):
    def make(device, dtype):
        g = torch.Generator().manual_seed(0)
        x = (3 * torch.randn(*shape, generator=g)).to(device=device, dtype=dtype)
        if not noisy:
            return (x,)
        u = torch.rand(*shape, generator=g, dtype=torch.float64).to(device)
        return x, (-torch.log(-torch.log(u))).float(), u
    return make


def _conf_bytes(a):
    # read the logits (and the noise when sampling), write token + score
    return tensor_bytes(*a[:2]) + a[0].shape[0] * (8 + 4)


def _softmax_f64_max(x):
    # the yardstick: Fast-dLLM's float64 confidence
    return torch.softmax(x.double(), -1).max(-1)


def _softmax_f32_max(x):
    return torch.softmax(x.float(), -1).max(-1)


def _softmax_f64_margin(x):
    top = torch.softmax(x.double(), -1).topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def _softmax_f64_entropy(x):
    # Dream's `entropy` confidence, written as Dream writes it, in float64
    p = torch.softmax(x.double(), -1)
    return (p * torch.log(p + 1e-10)).sum(-1)


def _fastdllm_gumbel_prob(x, g, u, temperature=1.0):
    # LLaDA/Fast-dLLM: x0 = argmax(exp(l) / (-log U)^T) in float64, then
    # p = softmax(l.float64)[x0]
    l64 = x.double()
    x0 = (l64.exp() / (-torch.log(u)) ** temperature).argmax(-1)
    return torch.softmax(l64, -1).gather(-1, x0[:, None])


_V = 126464
for _mode, _baseline in (("prob", _softmax_f64_max), ("margin", _softmax_f64_margin),
                         ("neg_entropy", _softmax_f64_entropy)):
    register(Case(
        op="token_confidence", shape=f"64x{_V} {_mode}", make=_logits((64, _V)),
        run=lambda x, _m=_mode: dllm_ops.token_confidence(x, _m),
        baselines={"softmax_f64": _baseline, "softmax_f32": _softmax_f32_max,
                   "reference": lambda x, _m=_mode: reference.token_confidence(x, _m)},
        nbytes=_conf_bytes, dtypes=(torch.bfloat16, torch.float32)))

register(Case(
    op="token_confidence", shape=f"64x{_V} prob T=1", make=_logits((64, _V), noisy=True),
    run=lambda x, g, u: dllm_ops.token_confidence(x, "prob", 1.0, None, g),
    baselines={"fastdllm_f64": _fastdllm_gumbel_prob,
               "reference": lambda x, g, u: reference.token_confidence(x, "prob", 1.0, None, g)},
    nbytes=_conf_bytes, dtypes=(torch.bfloat16,)))


# ---- select_transfer -------------------------------------------------------------

def _transfer_inputs(B, L, rule):
    def make(device, dtype):
        g = torch.Generator().manual_seed(0)
        score = torch.rand(B, L, generator=g).to(device=device, dtype=dtype)
        cand = (torch.rand(B, L, generator=g) < 0.5).to(device)
        k = (cand.sum(1) // 4) if rule == "topk" else None
        return score, cand, rule, k
    return make


def _fastdllm_topk(score, cand, rule, k):
    # Fast-dLLM's per-row torch.topk over -inf-masked confidences
    conf = torch.where(cand, score, torch.full_like(score, float("-inf")))
    out = torch.zeros_like(cand)
    for j in range(conf.shape[0]):
        out[j, torch.topk(conf[j], int(k[j])).indices] = True
    return out


def _transfer_bytes(a):
    return tensor_bytes(a[0], a[1], a[3]) + a[1].numel()  # + the bool output


for _rule in ("topk", "threshold", "factor"):
    _base = {"reference": lambda s, c, r, k: reference.select_transfer(s, c, r, k, 0.9, 1.0)}
    if _rule == "topk":
        _base["fastdllm_loop"] = _fastdllm_topk
    register(Case(
        op="select_transfer", shape=f"8x4096 {_rule}", make=_transfer_inputs(8, 4096, _rule),
        run=lambda s, c, r, k: dllm_ops.select_transfer(s, c, r, k, 0.9, 1.0),
        baselines=_base, nbytes=_transfer_bytes, dtypes=(torch.float32,)))


# ---- drift_select / drift_select_threshold -----------------------------------------

def _drift_inputs(B, T):
    def make(device, dtype):
        g = torch.Generator().manual_seed(0)
        drift = torch.rand(B, T, generator=g).to(device=device, dtype=dtype)
        region = (torch.rand(B, T, generator=g) < 0.75).to(device)
        return drift, region
    return make


def _drift_bytes(a):
    B, T = a[0].shape
    return tensor_bytes(*a) + B * T * (1 + 4) + B * 4  # reuse, recompute_idx (max = T), count


register(Case(
    op="drift_select", shape="8x4096 rho=0.87", make=_drift_inputs(8, 4096),
    run=lambda d, r: dllm_ops.drift_select(d, r, 0.87, 4096),
    baselines={"reference": lambda d, r: reference.drift_select(d, r, 0.87, 4096)},
    nbytes=_drift_bytes, dtypes=(torch.float32,)))

register(Case(
    op="drift_select_threshold", shape="8x4096 tau=0.5", make=_drift_inputs(8, 4096),
    run=lambda d, r: dllm_ops.drift_select_threshold(d, r, 0.5, 4096),
    baselines={"reference": lambda d, r: reference.drift_select_threshold(d, r, 0.5, 4096)},
    nbytes=_drift_bytes, dtypes=(torch.float32,)))


# ---- certainty_density ----------------------------------------------------------------

def _decoded(B, G):
    def make(device, dtype):
        g = torch.Generator().manual_seed(0)
        return ((torch.rand(B, G, generator=g) < 0.5).to(device),)
    return make


def _density_fft_f32(decoded, sigma=10.0):
    # d²Cache's method (float32 FFT convolution over a 6G canvas), written
    # from its math: [ones | region | right pad | zeros] * Gaussian, read at
    # the region, divided by the all-ones response.
    B, G = decoded.shape
    right = decoded[:, -1:].float().expand(B, G)
    signal = torch.cat([torch.ones(B, G, device=decoded.device), decoded.float(), right,
                        torch.zeros(B, 3 * G, device=decoded.device)], dim=1)
    dist = torch.cat([torch.arange(3 * G), torch.arange(-3 * G, 0)]).float().to(decoded.device)
    kernel = torch.fft.fft(torch.exp(-dist ** 2 / (2 * sigma ** 2)))
    conv = torch.fft.ifft(torch.fft.fft(signal) * kernel).real
    norm = torch.fft.ifft(torch.fft.fft(torch.ones(6 * G, device=decoded.device)) * kernel).real
    return conv[:, G:2 * G] / norm[G:2 * G]


for _B, _G in ((8, 512), (1, 4096)):
    _b = {"d2cache_fft": _density_fft_f32}
    if _G <= 1024:
        _b["reference"] = lambda d: reference.certainty_density(d, 10.0)
    register(Case(
        op="certainty_density", shape=f"{_B}x{_G} sigma=10", make=_decoded(_B, _G),
        run=lambda d: dllm_ops.certainty_density(d, 10.0),
        baselines=_b, nbytes=lambda a: a[0].numel() * (1 + 4), dtypes=(torch.float32,)))


# ---- certainty_select --------------------------------------------------------------
# d²Cache's stage 1 over a generated region: the one op against the tensor ops
# a decode loop would run for it (the density op, then one stable sort of an
# int64 key: the in-block bit over the score's float bits).

def _stage1_inputs(B, G):
    def make(device, dtype):
        g = torch.Generator().manual_seed(0)
        masked = torch.rand(B, G, generator=g) < 0.6
        return masked.to(device), torch.rand(B, G, generator=g).to(device)
    return make


def _stage1_tensor_ops(masked, conf, b0, b1, L, k, sigma=10.0):
    G = masked.shape[1]
    score = conf * dllm_ops.certainty_density(~masked, sigma)
    kth = (G - (masked.cumsum(1) >= k).sum(1)).clamp_max(G - 1)
    cand = masked[:, b0:] & (torch.arange(b0, G, device=masked.device) < ((kth // L + 1) * L)[:, None])
    key = score[:, b0:].contiguous().view(torch.int32).long()
    key[:, :b1 - b0] += 1 << 31
    top, order = torch.where(cand, key, -1).sort(dim=1, descending=True, stable=True)
    chosen = torch.zeros_like(masked)
    chosen[:, b0:].scatter_(1, order[:, :k], top[:, :k] >= 0)
    return chosen


for _B, _G, _b0, _b1, _L in ((1, 64, 0, 64, 64), (1, 256, 32, 64, 32), (8, 512, 64, 96, 32)):
    _args = (_b0, _b1, _L, 32)
    register(Case(
        op="certainty_select", shape=f"{_B}x{_G} block [{_b0}, {_b1}) k 32",
        make=_stage1_inputs(_B, _G),
        run=lambda m, c, a=_args: dllm_ops.certainty_select(m, c, *a),
        baselines={"tensor_ops": lambda m, c, a=_args: _stage1_tensor_ops(m, c, *a)},
        nbytes=lambda a: a[0].numel() * (1 + 4 + 1), dtypes=(torch.float32,)))


# ---- token_confidence_max_prob -----------------------------------------------------
# A margin reveal with EOS suppressed plus d²Cache's mask-only max probability
# (LLaDA's ids), against the two token_confidence passes it replaces.
_MASK, _EOS = 126336, 126081


def _logits_and_ids(shape):
    base = _logits(shape)

    def make(device, dtype):
        (x,) = base(device, dtype)
        return x, torch.tensor([_MASK, _EOS], device=device), torch.tensor([_MASK], device=device)
    return make


register(Case(
    op="token_confidence_max_prob", shape=f"64x{_V} margin+max_prob",
    make=_logits_and_ids((64, _V)),
    run=lambda x, s, k: dllm_ops.token_confidence_max_prob(x, "margin", 0.0, s, None, k),
    baselines={"two_passes": lambda x, s, k: (dllm_ops.token_confidence(x, "margin", 0.0, s),
                                              dllm_ops.token_confidence(x, "prob", 0.0, k)),
               "reference": lambda x, s, k: reference.token_confidence_max_prob(
                   x, "margin", 0.0, s, None, k)},
    nbytes=lambda a: tensor_bytes(a[0]) + a[0].shape[0] * (8 + 4 + 4),
    dtypes=(torch.bfloat16, torch.float32)))
