"""Quantized cache reuse (KIVI / dLLM-KVQ) in prefix and dual decoding.

The decode must equal ref_kvq.ref_generate_kvq -- an independent float64 loop
that replaces the reused region by its QDQ image after each block-start
forward -- token for token; the packed cache must dequantize to exactly that
QDQ image; its attention must equal float64 attention over it; and bad
input must be refused with a clear error. Every test with a model runs on
every device (model_device, conftest.py).
"""
import json

import pytest

pytest.importorskip("safetensors")
pytest.importorskip("transformers")
import torch

import dllm_ops
from dllm_ops.errors import ConfigError
from dllm_ops.models import load
from dllm_ops.plan import KVCache, StepPlan
from dllm_ops.policies import make_policy
from dllm_ops.quant.cache import QuantKVCache
from dllm_ops.quant.policy_table import PolicyTable, make_table
from ref_kvq import forward, qdq_k, qdq_v, importance_of, ref_generate_kvq
from ref_model import load_original
from tiny_ckpt import make_checkpoint


@pytest.fixture(scope="module")
def llada(model_device, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("kvq_llada"))
    make_checkpoint(path, "llada", seed=3)
    return load(path, dtype=torch.float32, device=model_device), load_original(path)


@pytest.fixture(scope="module")
def dream(model_device, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("kvq_dream"))
    make_checkpoint(path, "dream", seed=4)
    return load(path, dtype=torch.float32, device=model_device), load_original(path)


PROMPTS = [[5, 9, 11, 30, 7, 8, 12, 40, 41, 6, 9, 10, 22, 50, 51, 17, 5, 33, 34],
           [12, 40, 41, 6, 9, 10, 22]]
# Per-layer (score, p) of the 2-layer tiny models: every score type is used.
KVQ_LAYERS = [("attention", 2), ("product", 1)]
KVQ_LAYERS_B = [("qerror", 4), ("attention", 1)]


def _decode_kw(model, cache):
    kw = dict(gen_length=16, block_length=8, stop_at_eos=False, cache=cache)
    if model.config.arch == "dream":
        kw.update(alg="confidence_threshold", threshold=0.5)
    else:
        kw.update(unmask="threshold", threshold=0.5)
    return kw


def _kv_quant(model, cache, method, bits, layers, group):
    if method == "kivi":
        return dict(bits=bits, method="kivi", group=group)
    return dict(bits=bits, method="kvq", group=group,
                policy=make_table(model, "tiny", cache, bits, layers, group=group))


def _ref(original, model, prompt, cache, method, bits, layers, group, **kw):
    ref_kw = dict(mask_id=model.config.mask_id, gen_length=16, block_length=8, cache=cache,
                  bits=bits, group=group, layers=None if method == "kivi" else layers)
    if model.config.arch == "dream":
        ref_kw.update(alg=kw.get("alg", "confidence_threshold"), threshold=kw.get("threshold", 0.5),
                      steps=kw.get("steps"))
    else:
        ref_kw.update(unmask=kw.get("unmask", "threshold"), threshold=kw.get("threshold", 0.5),
                      steps=kw.get("steps"))
    return ref_generate_kvq(original, prompt, **ref_kw)


@pytest.mark.parametrize("arch", ["llada", "dream"])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("method,layers,bits", [("kivi", None, 2), ("kivi", None, 4),
                                               ("kvq", KVQ_LAYERS, 2), ("kvq", KVQ_LAYERS_B, 4)],
                         ids=["kivi2", "kivi4", "kvq2", "kvq4"])
def test_quantized_decode_equals_qdq_reference(request, model_device, arch, cache, method, layers, bits):
    model, original = request.getfixturevalue(arch)
    group = 8  # several groups (and protected tokens) in the short prefixes
    kvq = _kv_quant(model, cache, method, bits, layers, group)
    for prompt in PROMPTS:
        out = dllm_ops.generate(model, prompt, kv_quant=kvq, **_decode_kw(model, cache))
        want = _ref(original, model, prompt, cache, method, bits, layers, group)
        assert out.tokens[0].tolist() == want, f"prompt {prompt}"
        assert out.stats["kv_quant"] == f"{method}{bits}"


def test_topk_and_maskgit_and_group32_equal_reference(llada, dream):
    """Other reveal rules, and the default group of 32 with a prompt of 40 tokens."""
    prompt = [(7 * i + 5) % 50 + 5 for i in range(40)]
    for (model, original), kw in [(llada, dict(unmask="topk", steps=8)),
                                  (dream, dict(alg="maskgit_plus", steps=8))]:
        for cache in ("prefix", "dual"):
            kvq = _kv_quant(model, cache, "kvq", 2, KVQ_LAYERS, 32)
            out = dllm_ops.generate(model, prompt, kv_quant=kvq, gen_length=16, block_length=8,
                                    stop_at_eos=False, cache=cache, **kw)
            want = _ref(original, model, prompt, cache, "kvq", 2, KVQ_LAYERS, 32, **kw)
            assert out.tokens[0].tolist() == want


def test_quantization_changes_the_decode(llada):
    """The reference comparison has power: 2-bit reuse changes some tokens
    against the unquantized reference on these prompts."""
    model, original = llada
    prompts = [[(3 * i + j) % 50 + 5 for i in range(12)] for j in range(6)]
    changed = 0
    for p in prompts:
        q = _ref(original, model, p, "dual", "kivi", 2, None, 8)
        fp = ref_generate_kvq(original, p, mask_id=model.config.mask_id, gen_length=16,
                              block_length=8, cache="dual", bits=None, threshold=0.5)
        changed += q != fp
        if changed:
            break
    assert changed > 0


def _block_start(model, cache, x, bs, be):
    cache.begin_block(bs, be) if isinstance(cache, QuantKVCache) else None
    return model.step(x, StepPlan.full(1, x.shape[1], x.device), cache)


@pytest.mark.parametrize("arch", ["llada", "dream"])
@pytest.mark.parametrize("score,p", [("attention", 2), ("qerror", 1), ("product", 4), ("qerror", 0)])
def test_packed_region_is_the_qdq_image(request, model_device, arch, score, p):
    """After the block-start forward, the dequantized reused region equals the
    reference QDQ of the full-precision K/V bit for bit, the recomputed
    columns are the full-precision ones, and only they stay in full precision."""
    model, original = request.getfixturevalue(arch)
    c = model.config
    prompt = PROMPTS[0]
    T, bs, be = len(prompt) + 16, len(prompt), len(prompt) + 8
    x = torch.tensor([prompt + [c.mask_id] * 16], device=model.device)
    valid = torch.ones(1, T, dtype=torch.bool, device=model.device)
    plain = model.new_cache(valid)
    _block_start(model, plain, x, bs, be)
    for mode in ("prefix", "dual"):
        qc = QuantKVCache(n_layers=c.n_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                          key_valid=valid, dtype=torch.float32, device=model.device, mode=mode, bits=2,
                          group=8, layers=[make_table(model, "t", mode, 2, [(score, p)] * c.n_layers,
                                                      group=8).layers[0]] * c.n_layers)
        _block_start(model, qc, x, bs, be)
        # importance from the float64 reference forward's attention (same tokens)
        _, _, probs = forward(original, x[0].cpu())
        fe = be if mode == "dual" else T
        for li in range(c.n_layers):
            assert qc.k[li].shape[2] == fe - bs  # only the recomputed columns in full precision
            kw, vw = (t.cpu() for t in qc.dequantized(li))
            k, v = plain.k[li][0].cpu(), plain.v[li][0].cpu()    # [H, T, d]
            assert torch.equal(kw[0, :, bs:fe], k[:, bs:fe])
            assert torch.equal(vw[0, :, bs:fe], v[:, bs:fe])
            attn = probs[li][bs:be].mean(0)
            for a, b in [(0, bs)] + ([(be, T)] if mode == "dual" else []):
                imp = importance_of(score, k[:, a:b], attn[a:b], 2, 8, torch.float32) if p else None
                want_k = qdq_k(k[:, a:b], 2, 8, p, imp, torch.float32)
                want_v = qdq_v(v[:, a:b], 2, 8, torch.float32)
                assert torch.equal(kw[0, :, a:b].double(), want_k), (mode, li, a, b)
                assert torch.equal(vw[0, :, a:b].double(), want_v), (mode, li, a, b)


def test_attention_is_one_softmax_over_packed_and_fresh(llada):
    """A later call's attention equals float64 attention over the reference QDQ
    image of the reused regions (ref_kvq, from the full-precision K/V and the
    float64 forward's attention) plus the full-precision block keys (within
    sparse_attention's tolerance)."""
    model, original = llada
    c = model.config
    prompt = PROMPTS[0]
    T, bs, be = len(prompt) + 16, len(prompt), len(prompt) + 8
    x = torch.tensor([prompt + [c.mask_id] * 16], device=model.device)
    valid = torch.ones(1, T, dtype=torch.bool, device=model.device)
    plain = model.new_cache(valid)
    _block_start(model, plain, x, bs, be)
    qc = QuantKVCache(n_layers=c.n_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                      key_valid=valid, dtype=torch.float32, device=model.device, mode="dual", bits=2,
                      group=8, layers=make_table(model, "t", "dual", 2, KVQ_LAYERS, group=8).layers)
    _block_start(model, qc, x, bs, be)
    _, _, probs = forward(original, x[0].cpu())
    q = torch.randn(1, 8, c.n_heads, c.head_dim, generator=torch.Generator().manual_seed(0))
    scale = c.head_dim ** -0.5
    for li, (score, p) in enumerate(KVQ_LAYERS):
        k, v = plain.k[li][0].cpu(), plain.v[li][0].cpu()    # [H, T, d] full precision
        attn = probs[li][bs:be].mean(0)
        k_img, v_img = k.double(), v.double()
        for a, b in [(0, bs), (be, T)]:
            imp = importance_of(score, k[:, a:b], attn[a:b], 2, 8, torch.float32) if p else None
            k_img[:, a:b] = qdq_k(k[:, a:b], 2, 8, p, imp, torch.float32)
            v_img[:, a:b] = qdq_v(v[:, a:b], 2, 8, torch.float32)
        want, wp = dllm_ops.reference.attention_f64(q, k_img[None], v_img[None], valid.cpu(), scale)
        out, got_probs = qc.attend(li, q.to(model.device), scale, return_probs=True)
        torch.testing.assert_close(out.cpu().double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_probs.cpu().double(), wp.mean(1), rtol=1e-5, atol=1e-6)


def test_batch_equals_single(llada):
    model, _ = llada
    prompts = PROMPTS + [[33, 34, 35]]
    for cache in ("prefix", "dual"):
        kvq = _kv_quant(model, cache, "kvq", 2, KVQ_LAYERS, 8)
        kw = _decode_kw(model, cache)
        batch = dllm_ops.generate(model, prompts, kv_quant=kvq, **kw)
        for r, p in enumerate(prompts):
            single = dllm_ops.generate(model, p, kv_quant=kvq, **kw)
            assert batch.tokens[r].tolist() == single.tokens[0].tolist(), (cache, r)


def test_cache_bytes_are_reported_and_smaller(llada):
    model, _ = llada
    prompt = [(5 * i + 1) % 50 + 5 for i in range(96)]
    kw = dict(gen_length=16, block_length=8, unmask="threshold", threshold=0.5, stop_at_eos=False,
              cache="dual")
    s2 = dllm_ops.generate(model, prompt, kv_quant=dict(bits=2, method="kivi"), **kw).stats
    s4 = dllm_ops.generate(model, prompt, kv_quant=dict(bits=4, method="kivi"), **kw).stats
    assert s2["kv_cache_bytes"] < s4["kv_cache_bytes"] < s4["kv_cache_bytes_bf16"]
    # Bits per real element: per slot, fp32 scale and min per group cost 2 * 32 / 32
    # (K, groups of 32 tokens) and 2 * 32 / 16 (V, groups of min(32, head_dim=16)
    # channels), and the pad slots that start each segment on a K group boundary
    # are stored too: block 1 packs the prefix [0, 96) (96 slots) and the suffix
    # [104, 112) (32 slots), block 2 the prefix [0, 104) (128 slots): 208 real
    # tokens in 256 slots.
    pad = 256 / 208
    assert s4["k_bits"] == pytest.approx((4 + 2) * pad) and s4["v_bits"] == pytest.approx((4 + 4) * pad)
    assert s2["k_bits"] == pytest.approx((2 + 2) * pad) and s2["v_bits"] == pytest.approx((2 + 4) * pad)
    # every call after a block start reads the packed region and the block's columns
    assert s4["kv_read_bytes_per_call"] < s4["kv_read_bytes_per_call_bf16"]


# ---- bad input -------------------------------------------------------------------

def _table(model, cache="dual", bits=2, n=None):
    t = make_table(model, "tiny", cache, bits, KVQ_LAYERS).to_json()
    if n is not None:
        t["layers"] = t["layers"][:1] * n
        t["fingerprint"]["n_layers"] = n
    return t


@pytest.mark.parametrize("case,msg", [
    (dict(cache="none", kv_quant=dict(bits=4, method="kivi")),
     r"storage.method = 'kivi': must be 'full' with cache.method 'none'"),
    (dict(kv_quant=dict(bits=3, method="kivi")), r"storage.bits = 3: must be one of \[2, 4\]"),
    (dict(kv_quant=dict(bits=8, method="kivi")), r"storage.bits = 8: must be one of \[2, 4\]"),
    (dict(kv_quant=dict(bits=4, method="gptq")), r"storage.method = 'gptq': must be one of"),
    (dict(kv_quant=dict(bits=4, method="kvq")), r"storage.table = None: must be a policy table"),
    (dict(kv_quant=dict(bits=4, method="kivi", group=24)), r"storage.group = 24: must be one of"),
    (dict(kv_quant=dict(bits=4, method="kivi", residual=4)), r"kv_quant: unknown key\(s\) \['residual'\]"),
    (dict(kv_quant=4), "kv_quant = 4: must be an object"),
])
def test_bad_kv_quant(llada, case, msg):
    """A bad storage setting is refused by the configuration, naming the field and value."""
    model, _ = llada
    kw = dict(gen_length=16, block_length=8, unmask="threshold", cache="dual")
    kw.update(case)
    with pytest.raises(ConfigError, match=msg) as e:
        dllm_ops.generate(model, PROMPTS[1], **kw)
    assert str(e.value).startswith("dllm_ops config:")


def test_bad_policy_tables(llada, dream, tmp_path):
    model, _ = llada
    kw = dict(gen_length=16, block_length=8, unmask="threshold", cache="dual")

    def fails(policy, msg, bits=2, **over):
        with pytest.raises(ValueError, match=msg) as e:
            dllm_ops.generate(model, PROMPTS[1], kv_quant=dict(bits=bits, method="kvq", policy=policy),
                              **dict(kw, **over))
        assert str(e.value).startswith("dllm_ops.generate:")

    fails(_table(dream[0]), "another model")                       # Dream's table for LLaDA
    other = make_table(model, "tiny", "dual", 2, KVQ_LAYERS).to_json()
    other["fingerprint"]["weights_sha256"] = "0" * 64             # a retrained model
    fails(other, "another model.*weights_sha256")
    fails(_table(model, n=3), "3 layers, the model has 2")        # layer count
    fails(_table(model, cache="prefix"), "cache='prefix', decoding uses cache='dual'")
    fails(_table(model, bits=4), "bits=4, decoding uses bits=2")
    partial = _table(model)
    del partial["layers"]
    fails(partial, "missing field 'layers'")
    short = _table(model)
    short["layers"] = short["layers"][:1]
    fails(short, "partial table")
    bad = _table(model)
    bad["layers"][0]["p"] = 3
    fails(bad, "layer 0")
    path = tmp_path / "policy.json"
    text = json.dumps(_table(model))
    path.write_text(text[: len(text) // 2])                        # a truncated file
    fails(str(path), "not valid JSON")
    fails(str(tmp_path / "missing.json"), "no such file")
    path.write_text(text)
    ok = dllm_ops.generate(model, PROMPTS[1], kv_quant=dict(bits=2, method="kvq", policy=str(path)), **kw)
    assert PolicyTable.load(str(path)).layers[0].score == "attention" and ok.tokens.shape[1] == 16
    with pytest.raises(ConfigError, match=r"storage.table = .*: must be null with 'kivi'"):
        dllm_ops.generate(model, PROMPTS[1], kv_quant=dict(bits=2, method="kivi", policy=str(path)), **kw)


def test_plan_that_recomputes_reused_tokens_is_refused(llada):
    """Only prefix/dual-shaped plans run on a packed cache: a vanilla plan
    (every token) after the block start would write into the packed region."""
    model, _ = llada

    class EveryToken(type(make_policy("dual"))):
        def plan(self, state):
            return state.plan_for(state.valid_and_active())

    with pytest.raises(ValueError, match="packed reused region"):
        dllm_ops.generate(model, PROMPTS[1], policy=EveryToken(), gen_length=16, block_length=8,
                          unmask="topk", steps=16, kv_quant=dict(bits=2, method="kivi"))
