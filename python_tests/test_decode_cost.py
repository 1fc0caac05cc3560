"""The decode loop costs what a call recomputes, not what its block spans.

Every torch op dispatched outside ``model.step`` is counted (bytes of its input
and output tensors) and charged to the model call it follows: the reveal of
that call, the policy's bookkeeping and the plan of the next call. A call
returns ``[B, P, V]`` logits for the P rows it recomputed; the work around it
must scale with P·V (and the canvas), never with block × V (issue 43: the loop
used to rebuild a ``[B, block, V]`` logits canvas on every call).

The model is tiny with a large-ish vocabulary, so a block × V tensor would
dominate the count; the model's own ops are not counted.
"""
import dataclasses
import statistics
from collections import Counter, defaultdict

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import dllm_ops
from dllm_ops.policies import D2Cache
from tiny_ckpt import random_model, tiny_config

VOCAB = 4096
PROMPT = [5, 9, 11, 30, 7, 8, 12, 40]


def _model(arch: str):
    config = dataclasses.replace(tiny_config(arch, n_layers=2, max_seq_len=512), vocab_size=VOCAB)
    return random_model(config, seed=7)


@pytest.fixture(scope="module")
def llada():
    return _model("llada")


@pytest.fixture(scope="module")
def dream():
    return _model("dream")


@dataclasses.dataclass
class CallCost:
    """Non-model work charged to one model call."""
    rows: int                          # logits rows the call returned (P, summed over the batch)
    bytes: int = 0                     # input + output tensor bytes of every op outside the model
    largest: int = 0                   # elements of the largest tensor any of those ops touched
    largest_op: str = ""
    ops: list = dataclasses.field(default_factory=list)  # (op, elements) of ops touching > rows·V
    counts: Counter = dataclasses.field(default_factory=Counter)  # dispatches per op


class NonModelCost(TorchDispatchMode):
    """Charges every op dispatched outside ``model.step`` to the model call it follows."""

    def __init__(self, model):
        super().__init__()
        self.calls: list[CallCost] = []
        self._in_model = False
        step = model.step

        def counted_step(*args, **kw):
            self._in_model = True
            try:
                logits = step(*args, **kw)
            finally:
                self._in_model = False
            self.calls.append(CallCost(rows=logits.shape[0] * logits.shape[1]))
            return logits

        self.step = counted_step

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self._in_model and self.calls:
            call = self.calls[-1]
            call.counts[str(func)] += 1
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            call.bytes += sum(t.numel() * t.element_size() for t in tensors)
            big = max((t.numel() for t in tensors), default=0)
            if big > call.largest:
                call.largest, call.largest_op = big, str(func)
            if big > max(call.rows, 1) * VOCAB:
                call.ops.append((str(func), big))
        return out


def _decode(model, monkeypatch, prompt=PROMPT, **kw) -> tuple[list[CallCost], dict]:
    """Decode under the counter; the calls after the decode's first (whose plan
    may return logits for the whole region) and the stats."""
    counter = NonModelCost(model)
    with monkeypatch.context() as m:
        m.setattr(model, "step", counter.step)
        with counter:
            out = dllm_ops.generate(model, prompt, stop_at_eos=False, **kw)
    return counter.calls[1:], out.stats


def _by_rows(calls: list[CallCost]) -> dict[int, float]:
    """Median non-model bytes per call, keyed by the logits rows the call returned."""
    groups = defaultdict(list)
    for c in calls:
        groups[c.rows].append(c.bytes)
    return {rows: statistics.median(b) for rows, b in groups.items()}


def _assert_no_block_vocab_op(calls: list[CallCost], what: str) -> None:
    """No op outside the model touches more than the logits the call returned."""
    for i, c in enumerate(calls, start=1):
        assert c.largest <= max(c.rows, 1) * VOCAB, (
            f"{what}: call {i} returned {c.rows} logits rows but {c.largest_op} touched a tensor of "
            f"{c.largest} elements ({c.largest / VOCAB:.0f} x V)")


def _assert_same_cost(small: dict, large: dict, what: str) -> None:
    """At equal logits rows, a call of the long block costs at most 2x the short block's."""
    common = sorted(set(small) & set(large))
    assert common, f"{what}: no call count in common"
    for rows in common:
        assert large[rows] <= 2 * small[rows], (
            f"{what}: calls returning {rows} logits rows touch {large[rows] / 1e6:.2f} MB outside the "
            f"model at the long block against {small[rows] / 1e6:.2f} MB at block 32")


def test_d2cache_one_block_costs_what_block_32_costs(llada, monkeypatch):
    """d²Cache as one block of 256 (its own setting) against blocks of 32, with
    exactly the same tokens recomputed and logits returned per call."""
    # rollout_p tiny: the nucleus is its one-token minimum, so both runs
    # recompute k masks + the revealed tokens + 1 on every call.
    opts = dict(current_k=4, rollout_p=1e-6, sigma=10.0)
    kw = dict(gen_length=256, steps=64, unmask="topk")
    one_block, s_one = _decode(llada, monkeypatch, policy=D2Cache(**opts), block_length=256, **kw)
    blocks, s_blocks = _decode(llada, monkeypatch, policy=D2Cache(**opts), block_length=32, **kw)
    assert s_one["recomputed_per_step"] == s_blocks["recomputed_per_step"]
    assert [c.rows for c in one_block] == [c.rows for c in blocks]
    _assert_same_cost(_by_rows(blocks), _by_rows(one_block), "d2cache")
    _assert_no_block_vocab_op(one_block, "d2cache, one block of 256")
    _assert_no_block_vocab_op(blocks, "d2cache, block 32")
    # Greedy max-probability scores: the confidence cache reuses the reveal's.
    assert all(c.counts["dllm.token_confidence.default"] == 1 for c in one_block + blocks)


def test_d2cache_scores_once_when_the_confidence_differs(llada, monkeypatch):
    """With EOS suppressed the reveal's scores are not d²Cache's confidence
    (which only drops the mask token); the loop's one pass yields both
    (dllm.token_confidence_max_prob, issue 37), so each call still scores once."""
    calls, _ = _decode(llada, monkeypatch, cache="d2cache", d2cache=dict(current_k=4), gen_length=64,
                       block_length=64, steps=32, unmask="topk", suppress_eos=True)
    assert all(c.counts["dllm.token_confidence_max_prob.default"] == 1 for c in calls)
    assert all(c.counts["dllm.token_confidence.default"] == 0 for c in calls)


@pytest.mark.parametrize("cache", ["dual", "prefix", "none"])
def test_block_cache_call_costs_its_logits_rows(llada, monkeypatch, cache):
    """Fast-dLLM's caches and vanilla: a call returning P rows costs the same at
    block 128 as at block 32 (one token per call: every P from 32 down to 1 occurs in both)."""
    kw = dict(gen_length=128, steps=128, unmask="topk", cache=cache)
    long_block, _ = _decode(llada, monkeypatch, block_length=128, **kw)
    short_block, _ = _decode(llada, monkeypatch, block_length=32, **kw)
    _assert_same_cost(_by_rows(short_block), _by_rows(long_block), cache)
    _assert_no_block_vocab_op(long_block, f"{cache}, block 128")


CASES = [
    ("llada", dict(cache="dual", unmask="threshold", threshold=0.5)),
    ("llada", dict(cache="dual", unmask="factor", factor=1.0)),
    ("llada", dict(cache="prefix", unmask="topk", sigma=3.0, remasking="random")),
    ("llada", dict(cache="d2cache", d2cache=dict(current_k=4), unmask="threshold", threshold=0.5,
                   sigma=3.0, suppress_eos=True)),
    ("dream", dict(cache="none", alg="entropy")),
    ("dream", dict(cache="none", alg="confidence_threshold", threshold=0.5)),
    ("dream", dict(cache="dual", alg="topk_margin", top_p=0.9, top_k=50)),
    ("dream", dict(cache="d2cache", d2cache=dict(current_k=4), alg="maskgit_plus")),
]


@pytest.mark.parametrize("arch,kw", CASES, ids=[f"{a}-{k['cache']}-{k.get('unmask', k.get('alg'))}"
                                               for a, k in CASES])
def test_every_rule_and_loop_touches_only_returned_rows(request, monkeypatch, arch, kw):
    """Greedy decoding under every reveal rule, cache and Dream loop: no op
    outside the model touches more than the call's own logits rows."""
    model = request.getfixturevalue(arch)
    calls, _ = _decode(model, monkeypatch, gen_length=64, block_length=64, steps=32, **kw)
    _assert_no_block_vocab_op(calls, f"{arch} {kw}")


def test_sampling_draws_the_stream_but_scores_returned_rows(llada, monkeypatch):
    """Sampled decoding keeps each row's random stream (a ``(block, V)`` float64
    uniform per call): the draw and the gather of the returned rows from it are
    the only ops outside the model that see more than those rows."""
    calls, _ = _decode(llada, monkeypatch, gen_length=64, block_length=64, steps=32, unmask="topk",
                       cache="dual", temperature=0.8, seed=3)
    allowed = {"aten.rand.generator", "aten.index_select.default"}
    assert all(any(op == "aten.rand.generator" for op, _ in c.ops) for c in calls)  # the stream is drawn
    for i, c in enumerate(calls, start=1):
        beyond = {op for op, _ in c.ops} - allowed
        assert not beyond, f"call {i} ({c.rows} logits rows): {sorted(beyond)} touched more than them"


SCORE_CASES = [
    ("llada", dict(unmask="topk")),                                   # reuses the reveal's scores
    ("llada", dict(unmask="topk", suppress_eos=True)),                # EOS suppressed too
    ("llada", dict(unmask="topk", temperature=0.7, seed=2)),          # sampled token's probability
    ("dream", dict(alg="maskgit_plus", top_p=0.9)),                   # filtered distribution
    ("dream", dict(alg="maskgit_plus", temperature=0.5, seed=2)),
]


@pytest.mark.parametrize("arch,kw", SCORE_CASES, ids=[f"{a}-{sorted(k)}" for a, k in SCORE_CASES])
def test_d2cache_confidence_is_max_prob_whether_reused_or_not(request, arch, kw):
    """d²Cache's cached confidence is the max probability with only the mask token
    suppressed, whether it reused the reveal's scores or had to score the rows itself."""
    model = request.getfixturevalue(arch)
    shift = 1 if model.config.logit_shift else 0
    checked = []

    class Check(D2Cache):
        def on_step_end(self, state, commit):
            super().on_step_end(state, commit)
            rows, logits = state.last_plan.logits_idx, state.last_logits.double().clone()
            logits[..., state.mask_id] = float("-inf")
            want = logits.softmax(-1).amax(-1)
            b, p = (rows >= 0).nonzero(as_tuple=True)
            got = self._conf[b, rows[b, p] + shift].double()
            assert torch.allclose(got, want[b, p], rtol=0, atol=1e-5)
            checked.append(len(b))

    dllm_ops.generate(model, PROMPT, policy=Check(current_k=4), gen_length=32, block_length=32, steps=16,
                      stop_at_eos=False, **kw)
    assert len(checked) > 1 and sum(checked) > 32
