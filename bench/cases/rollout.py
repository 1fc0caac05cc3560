"""Benchmarks of the `rollout` family.

rollout_scores against d²Cache's own method (the dense reference: every Ã_l
formed as a T×T float64 matrix and multiplied, O(L·T³)), at the decode-step
shape L=32, B=1, Q=33 for T = 256, 512, 1024 — the rows show how each side
scales with T (the kernel ~linearly, the dense product ~cubically). The dense
product takes seconds at T=1024; the timing helper then measures it only a
couple of times.
"""
import torch

import dllm_ops
from dllm_ops import reference

from .registry import Case, register, tensor_bytes


def _rollout_inputs(L, B, Q, T):
    def make(device, dtype):
        g = torch.Generator().manual_seed(0)
        probs = torch.softmax(3 * torch.randn(L, B, Q, T, generator=g), -1)
        idx = torch.stack([torch.stack([torch.randperm(T, generator=g)[:Q] for _ in range(B)])
                           for _ in range(L)])
        valid = torch.ones(B, T, dtype=torch.bool)
        return probs.to(device=device, dtype=dtype), idx.to(device), valid.to(device)
    return make


for _T in (256, 512, 1024):
    register(Case(
        op="rollout_scores", shape=f"L32xB1xQ33xT{_T}", make=_rollout_inputs(32, 1, 33, _T),
        run=dllm_ops.rollout_scores,
        baselines={"dense_d2cache": reference.rollout_scores},
        # read the rows, their indices and the mask; write g
        nbytes=lambda a: tensor_bytes(*a) + a[2].numel() * 4,
        dtypes=(torch.float32,),
    ))


def _nucleus_inputs(B, T):
    def make(device, dtype):
        g = torch.Generator().manual_seed(0)
        scores = torch.rand(B, T, generator=g) ** 4
        cand = torch.rand(B, T, generator=g) < 0.8
        return scores.to(device=device, dtype=dtype), cand.to(device), 0.1, 1
    return make


register(Case(
    op="nucleus_select", shape="B4xT1024", make=_nucleus_inputs(4, 1024),
    run=dllm_ops.nucleus_select,
    baselines={"reference": reference.nucleus_select},
    nbytes=lambda a: tensor_bytes(*a[:2]) + a[1].numel(),
    dtypes=(torch.float32,),
))
