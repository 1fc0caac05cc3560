"""``Linear``: nn.Linear whose bf16 inference on the CPU runs on a pre-packed weight.

torch's CPU ``F.linear`` in bf16 hands the product to oneDNN, which re-lays
the weight out into its blocked format on every call. A decode call runs few
token rows (one block, or the rows a cache recomputes), so that per-call
reorder reads and writes the whole weight again and the GEMM runs at about
two thirds of the speed it reaches on a weight packed once
(``torch.ops.mkldnn._reorder_linear_weight``, the format torch's own CPU
inductor freezes weights into). The product is the same oneDNN kernel on the
same blocked weight, so the output is bit for bit ``F.linear``'s: the packed
weight is checked against ``F.linear`` once when it is built, and a mismatch
(a CPU or oneDNN build where the two differ) turns packing off for that
layer instead of changing any number.

On a CPU whose oneDNN has no bf16 GEMM (AVX2 without AVX512-BF16 or AMX:
Zen 2/3, most Intel before Cooper Lake), torch's bf16 ``F.linear`` runs at
about 10 GFLOP/s here (2026-12-04, AMD EPYC Zen 3, one thread; float32 sgemm
on the same rows: 30-74 GFLOP/s). There the copy is the weight widened to
float32 once, and the product is MKL's sgemm on the widened operands, rounded
to bf16 once: the contract of bf16 ``F.linear`` (bf16 operands, float32
accumulation, one rounding) in sgemm's summation order, so its bits can differ
from ``F.linear``'s in the last place (python_tests/test_packed_linear.py
bounds it). The widened copy costs twice the bf16 weight.

The copy is a cache beside the parameter (not in the state dict): it
is rebuilt when the weight changes (a new tensor or an in-place write), used
only without autograd, only for bf16 on the CPU, and
costs one more copy of every packed weight in memory. So that a model that
fits does not stop fitting, the packed copies of all live layers together stay
within :data:`PACK_BUDGET_BYTES` (a quarter of the machine's memory unless
``DLLM_CPU_PACKED_GEMM_BUDGET`` gives bytes): a layer whose copy would not fit
runs on ``F.linear`` (the same numbers, the unpacked speed).
``DLLM_CPU_PACKED_GEMM=0`` in the environment turns both copies off.
"""
from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F
from torch import nn


def packing_available() -> bool:
    """Whether this torch and CPU pack bf16 linear weights (and the env allows it)."""
    if os.environ.get("DLLM_CPU_PACKED_GEMM", "1") == "0":
        return False
    try:
        return (torch.backends.mkldnn.is_available()
                and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    except (AttributeError, RuntimeError):
        return False


def widening_available() -> bool:
    """Whether bf16 linears run on a float32 weight copy: a CPU torch without
    oneDNN bf16 (see the module doc; the env switch turns it off too)."""
    if os.environ.get("DLLM_CPU_PACKED_GEMM", "1") == "0":
        return False
    return not packing_available()


_AVAILABLE = packing_available()
_WIDEN = widening_available()


def _default_budget() -> int:
    env = os.environ.get("DLLM_CPU_PACKED_GEMM_BUDGET")
    if env is not None:
        return int(env)
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (ValueError, OSError, AttributeError):
        return 4 << 30


#: bytes the packed copies of all live layers may hold together
PACK_BUDGET_BYTES = _default_budget()
_HOLDERS: "weakref.WeakSet[Linear]" = weakref.WeakSet()   # layers holding a packed copy


def packed_bytes() -> int:
    """Bytes the packed copies of all live layers hold now."""
    return sum(m._packed_nbytes for m in list(_HOLDERS))


#: the batch-size hint oneDNN packs for: decode calls run a block's rows
PACK_ROWS = 16


def pack_weight(w: torch.Tensor):
    """``w [N, K]`` bf16 in oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)


def packed_linear(x: torch.Tensor, packed, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` on a weight from :func:`pack_weight`."""
    if x.dim() == 2:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    # The op folds [..., K] to rows itself, in six reshape / view ops a call;
    # two views here do the same.
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return y.view(*x.shape[:-1], y.shape[-1])


def widen_weight(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` bf16 as a contiguous float32 copy (exact: bf16 widens without rounding)."""
    return w.float().contiguous()


def widened_linear(x: torch.Tensor, w32: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """bf16 ``x @ W.T + bias`` on a weight from :func:`widen_weight`: float32
    sgemm of the widened operands, rounded to bf16 once (``x`` may come widened)."""
    b32 = None if bias is None else bias.float()
    return F.linear(x.float(), w32, b32).to(torch.bfloat16)


def is_widened(copy: torch.Tensor) -> bool:
    """Which kind a held weight copy is: :func:`widen_weight`'s float32 copy, or
    (False) oneDNN's packed bf16 one. A layer runs the product of the copy it
    holds, whatever the module flags say now (a copy made before they changed
    stays the kind it was made)."""
    return copy.dtype == torch.float32


def shared_input_linears(linears, x: torch.Tensor) -> list[torch.Tensor]:
    """``[linear(x) for linear in linears]``, the same numbers; where every one of
    them runs on a float32 copy, ``x`` is widened once for all (q/k/v, gate/up)."""
    if not (_AVAILABLE or _WIDEN) or len(linears) < 2 or not all(isinstance(m, Linear) for m in linears):
        return [linear(x) for linear in linears]
    copies = [m.copy_for(x) for m in linears]
    if any(c is None or not is_widened(c) for c in copies):
        return [linear(x) for linear in linears]
    x32 = x.float()
    return [widened_linear(x32, c, m.bias) for m, c in zip(linears, copies)]


def same_as_linear(w: torch.Tensor, packed, bias: torch.Tensor | None) -> bool:
    """Whether the packed product equals ``F.linear`` bit for bit on a fixed probe
    (17 rows: one full row tile of the packing hint and a remainder)."""
    probe = torch.linspace(-2, 2, 17 * w.shape[1], dtype=torch.float32)
    probe = probe.reshape(17, w.shape[1]).to(w.dtype)
    return torch.equal(F.linear(probe, w, bias), packed_linear(probe, packed, bias))


class Linear(nn.Linear):
    """``nn.Linear`` with a packed-weight fast path for bf16 CPU inference (see module doc)."""

    _packed = None
    _packed_key = None
    _packed_nbytes = 0
    _packing_failed = False

    def __getstate__(self):
        # The packed copy is an opaque oneDNN tensor, which cannot be copied or
        # pickled: a copy (copy.deepcopy, pickle) leaves it out and packs anew.
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__
        return {k: v for k, v in state.items() if k not in ("_packed", "_packed_key", "_packed_nbytes")}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.copy_for(x)
        if packed is None:
            return F.linear(x, self.weight, self.bias)
        if is_widened(packed):
            return widened_linear(x, packed, self.bias)
        return packed_linear(x, packed, self.bias)

    def copy_for(self, x: torch.Tensor):
        """The weight copy ``self(x)`` runs on, or None where it runs ``F.linear``."""
        w = self.weight
        if (not (_AVAILABLE or _WIDEN) or self._packing_failed or x.dtype != torch.bfloat16
                or w.dtype != torch.bfloat16 or x.device.type != "cpu"
                or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))):
            return None
        return self._packed_weight()

    def _packed_weight(self):
        w = self.weight
        key = (w.data_ptr(), w._version, tuple(w.shape))
        if self._packed_key != key:
            self._packed, self._packed_key, self._packed_nbytes = None, key, 0
            _HOLDERS.discard(self)
            nbytes = w.numel() * (w.element_size() if _AVAILABLE else 4)
            if packed_bytes() + nbytes > PACK_BUDGET_BYTES:
                return None          # over the budget: F.linear; tried again if the weight changes
            if not _AVAILABLE:       # the float32 copy: exact, nothing to check
                with torch.no_grad():
                    self._packed, self._packed_nbytes = widen_weight(w.detach()), nbytes
                _HOLDERS.add(self)
                return self._packed
            try:
                with torch.no_grad():
                    packed = pack_weight(w.detach())
                    same = same_as_linear(w.detach(), packed, self.bias)
            except (RuntimeError, AttributeError):   # a torch / oneDNN without these ops or shapes
                same = False
            if not same:
                self._packing_failed = True
                return None
            self._packed, self._packed_nbytes = packed, nbytes
            _HOLDERS.add(self)
        return self._packed
