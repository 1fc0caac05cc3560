"""Paths no other test takes: empty batches and empty query sets for the
attention ops, and tensors on two devices for every op with several tensors
(the `cuda` cases run under `make gpu-check`, where skips fail)."""
import pytest
import torch

import dllm_ops
from dllm_ops import reference
from dllm_ops.rope import rope_cos_sin
from backends import BACKENDS, device_of, op, require, to

H, H_KV, T, D = 4, 2, 9, 32
EMPTY = [(0, 3), (2, 0), (0, 0)]


def _rnd(g, *shape):
    return torch.randn(*shape, generator=g)


@pytest.mark.parametrize("B,Q", EMPTY, ids=lambda v: str(v))
@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_attention_empty(backend, B, Q):
    g = torch.Generator().manual_seed(0)
    q, kc, vc = _rnd(g, B, Q, H, D), _rnd(g, B, H_KV, T, D), _rnd(g, B, H_KV, T, D)
    valid = torch.ones(B, T, dtype=torch.bool)
    for return_probs in (False, True):
        out, probs = op(backend, "sparse_attention")(*to(backend, q, kc, vc, valid), 0.2, return_probs)
        assert out.shape == (B, Q, H, D) and out.dtype == q.dtype
        assert probs.shape == ((B, Q, T) if return_probs else (0,)) and probs.dtype == torch.float32
        want = reference.sparse_attention(q, kc, vc, valid, 0.2, return_probs)
        assert want[0].shape == out.shape and want[1].shape == probs.shape


@pytest.mark.parametrize("B,Q", EMPTY, ids=lambda v: str(v))
@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_scatter_kv_empty_writes_nothing(backend, B, Q):
    f = op(backend, "rope_scatter_kv")
    g = torch.Generator().manual_seed(1)
    q, k, v = _rnd(g, B, Q, H, D), _rnd(g, B, Q, H_KV, D), _rnd(g, B, Q, H_KV, D)
    kc, vc = _rnd(g, B, H_KV, T, D), _rnd(g, B, H_KV, T, D)
    pos = torch.zeros(B, Q, dtype=torch.long)
    idx = torch.arange(Q).expand(B, Q).contiguous()
    args = to(backend, q, k, v, pos, rope_cos_sin(10000.0, D, 16), kc.clone(), vc.clone(), idx)
    f(*args)
    assert torch.equal(args[5].cpu(), kc) and torch.equal(args[6].cpu(), vc)
    assert torch.equal(args[0].cpu(), q)


@pytest.mark.parametrize("B,Q", EMPTY, ids=lambda v: str(v))
@pytest.mark.parametrize("backend", BACKENDS)
def test_quant_attention_empty(backend, B, Q):
    g = torch.Generator().manual_seed(2)
    q, kc, vc = _rnd(g, B, Q, H, D), _rnd(g, B, H_KV, T, D), _rnd(g, B, H_KV, T, D)
    valid = torch.ones(B, T, dtype=torch.bool)
    pk, pv = dllm_ops.quantize_k(kc, 4, 8), dllm_ops.quantize_v(vc, 4, 8)
    out = op(backend, "quant_attention")(*to(backend, q, *pk.tensors()), 4, 8,
                                         *to(backend, *pv.tensors()), 4, 8, *to(backend, valid), 0.2)
    assert out.shape == (B, Q, H, D) and out.dtype == q.dtype


@pytest.mark.parametrize("B,Q", EMPTY, ids=lambda v: str(v))
def test_empty_shapes_fake_kernels_agree(B, Q):
    """The fake kernels give the CPU kernels' shapes and dtypes on empty inputs.
    (opcheck cannot take them: its copies of a 0-element input fail inside
    torch with "negative dimension -1".)"""
    from torch._subclasses.fake_tensor import FakeTensorMode
    g = torch.Generator().manual_seed(3)
    q, kc, vc = _rnd(g, B, Q, H, D), _rnd(g, B, H_KV, T, D), _rnd(g, B, H_KV, T, D)
    valid = torch.ones(B, T, dtype=torch.bool)
    pk, pv = dllm_ops.quantize_k(kc, 4, 8), dllm_ops.quantize_v(vc, 4, 8)
    calls = [(torch.ops.dllm.sparse_attention, (q, kc, vc, valid, 0.2, True)),
             (torch.ops.dllm.quant_attention, (q, *pk.tensors(), 4, 8, *pv.tensors(), 4, 8, valid, 0.2)),
             (torch.ops.dllm.two_source_attention, (q, *pk.tensors(), 4, 8, *pv.tensors(), 4, 8, valid,
                                                    kc[:, :, :2], vc[:, :, :2], None, 0.2, True))]
    for f, args in calls:
        real = f(*args)
        with FakeTensorMode() as mode:
            fake = f(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
        real, fake = (real,) if isinstance(real, torch.Tensor) else real, \
            (fake,) if isinstance(fake, torch.Tensor) else fake
        assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]


# ---- two devices ----------------------------------------------------------------------

def _op_inputs():
    """Small valid arguments (CPU) of every op that takes two or more tensors."""
    g = torch.Generator().manual_seed(4)
    B, L = 2, 12
    x = _rnd(g, B, L)
    logits = _rnd(g, 3, 17)
    cand = torch.ones(B, L, dtype=torch.bool)
    q, k, v = _rnd(g, B, 3, H, D), _rnd(g, B, 3, H_KV, D), _rnd(g, B, 3, H_KV, D)
    kc, vc = _rnd(g, B, H_KV, T, D), _rnd(g, B, H_KV, T, D)
    valid = torch.ones(B, T, dtype=torch.bool)
    rows = _rnd(g, B, T, 8)
    idx = torch.tensor([[0, 4, -1], [2, 3, 8]])
    probs = torch.softmax(_rnd(g, 2, B, 3, T), -1)
    row_idx = torch.tensor([[0, 1, 2], [3, 4, 5]]).expand(2, B, 3).contiguous()
    imp = torch.rand(B, T, generator=g)
    pk, pv = dllm_ops.quantize_k(kc, 4, 8, 2, imp), dllm_ops.quantize_v(vc, 4, 8)
    return {
        "cosine_drift": (x, x + 0.1),
        "token_confidence": (logits, "prob", 1.0, torch.tensor([2]), torch.rand(3, 17, generator=g)),
        "token_confidence_max_prob": (logits, "prob", 1.0, torch.tensor([2, 5]),
                                      torch.rand(3, 17, generator=g), torch.tensor([5])),
        "select_transfer": (x, cand, "topk", torch.tensor([1, 2]), 0.9, 1.0),
        "drift_select": (x, cand, 0.5, L),
        "drift_select_threshold": (x, cand, 0.5, L),
        "rope_scatter_kv": (q, k, v, torch.zeros(B, 3, dtype=torch.long), rope_cos_sin(1e4, D, 16),
                            kc.clone(), vc.clone(), torch.tensor([[0, 1, 2], [3, 4, 5]])),
        "sparse_attention": (q, kc, vc, valid, 0.2, True),
        "gather_rows": (rows, idx),
        "scatter_rows": (rows.clone(), _rnd(g, B, 3, 8), idx),
        "rollout_scores": (probs, row_idx, valid),
        "nucleus_select": (x.abs(), cand, 0.5, 1),
        "certainty_select": (cand, x.abs(), 0, L, 4, 3, 10.0),
        "quantize_k": (kc, 4, 8, 2, imp),
        "dequantize_k": (*pk.tensors(), 4, 8, T),
        "dequantize_v": (*pv.tensors(), 4, 8),
        "quant_attention": (q, *pk.tensors(), 4, 8, *pv.tensors(), 4, 8, valid, 0.2),
        "two_source_attention": (q, *pk.tensors(), 4, 8, *pv.tensors(), 4, 8, valid, kc[:, :, :3],
                                 vc[:, :, :3], valid[:, :3], 0.2, True),
        "add_rms_norm_": (_rnd(g, B, 3, 8), _rnd(g, B, 3, 8), _rnd(g, 8), 1e-6),
        "silu_mul": (_rnd(g, B, 5), _rnd(g, B, 5)),
    }


CROSS = sorted(_op_inputs())


def test_every_multi_tensor_op_has_a_cross_device_case():
    from test_schemas import dllm_schemas
    multi = {n for n, s in dllm_schemas().items()
             if sum("Tensor" in str(a.type) for a in s.arguments) >= 2}
    assert multi == set(CROSS)


@pytest.mark.parametrize("name", CROSS)
def test_cross_device_inputs_are_valid_on_cpu(name):
    """The inputs below are valid: only the device makes the cuda case fail."""
    getattr(torch.ops.dllm, name)(*_op_inputs()[name])


@pytest.mark.parametrize("name", CROSS)
def test_cross_device_is_an_error_cuda(name):
    require("cuda")
    args = _op_inputs()[name]
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    for stray in tensors:   # each tensor in turn on the CPU, the others on the GPU
        moved = [a.to(device_of("cuda")) if isinstance(a, torch.Tensor) and i != stray else a
                 for i, a in enumerate(args)]
        with pytest.raises(RuntimeError, match=rf"dllm::{name}: .*(same device|CUDA tensor)"):
            getattr(torch.ops.dllm, name)(*moved)


@pytest.mark.parametrize("B,Q", EMPTY, ids=lambda v: str(v))
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_source_attention_empty(backend, B, Q):
    g = torch.Generator().manual_seed(2)
    q, kc, vc = _rnd(g, B, Q, H, D), _rnd(g, B, H_KV, T, D), _rnd(g, B, H_KV, T, D)
    pk, pv = dllm_ops.quantize_k(kc, 4, 8), dllm_ops.quantize_v(vc, 4, 8)
    out, probs = op(backend, "two_source_attention")(
        *to(backend, q, *pk.tensors()), 4, 8, *to(backend, *pv.tensors()), 4, 8, None,
        *to(backend, kc[:, :, :3], vc[:, :, :3]), None, 0.2, True)
    assert out.shape == (B, Q, H, D) and out.dtype == q.dtype
    assert probs.shape == (B, Q, T + 3) and probs.dtype == torch.float32
