"""The server's engine (dllm_ops/serve): continuous batching over resumable decoders.

The acceptance test is batch invariance: a request decoded by the engine while
others join and leave mid-decode (different prompt lengths, cache methods,
DARE, packed storage, block and region lengths in the same calls) answers
exactly what ``generate`` gives for it alone, token for token (float32, CPU,
the shipped tiny models). The engine is driven by ``tick()`` with the
submissions placed between ticks, so every schedule here is deterministic;
one test runs the real thread.
"""
import threading

import pytest

pytest.importorskip("prometheus_client")
import torch

from dllm_ops.config import DecodeConfig
from dllm_ops.decode import Decoder, generate
from dllm_ops.errors import ConfigError, DecodeError, ServeError
from dllm_ops.models import load
from dllm_ops.plan import KVCache
from dllm_ops.policies import DualCache
from dllm_ops.quant.cache import QuantKVCache
from dllm_ops.serve import (Engine, EngineStopped, Failed, Finished, Progress, QueueFull, Request,
                            ServerMetrics)
from dllm_ops.serve.admission import sequence_kv_bytes
from dllm_ops.serve.fused import RowCall, fused_step
from dllm_ops.serve.stacked import canvas_width
from dllm_ops.quant.storage import make_storage
from dllm_ops.tasks import problems
from backends import require

pytestmark = pytest.mark.models

#: every method the issue names, plus DARE-O; each a partial DecodeConfig. Top-k
#: reveals (one or two tokens per call) where a threshold would finish the tiny
#: models' answers in one or two calls: every decode here spans several calls.
METHODS = {
    "none": dict(cache=dict(method="none")),
    "dual": dict(cache=dict(method="dual"), reveal=dict(unmask="threshold", threshold=0.9)),
    "d2cache": dict(cache=dict(method="d2cache", d2cache=dict(current_k=4))),
    "dare-kv": dict(cache=dict(method="dual"), reuse=dict(method="kv", rho=0.5),
                    reveal=dict(unmask="threshold")),
    "kivi4": dict(cache=dict(method="dual"), storage=dict(method="kivi", bits=4),
                  reveal=dict(unmask="threshold")),
    "dare-o": dict(cache=dict(method="prefix"), reuse=dict(method="o", tau=0.05),
                   shape=dict(steps=8)),
}
# Prompts of three lengths (24, 18, 46 tokens) from the task suite the tiny models solve,
# so answers are real: they end at an EOS ("stop") or run into max_tokens ("length").
PROMPTS = [list(p.prompt_ids) for t in ("add", "scan", "sub", "lag2") for p in problems(t, 3, seed=5)]


@pytest.fixture(scope="module")
def llada():
    return load("tiny-llada", dtype=torch.float32)


@pytest.fixture(scope="module")
def dream():
    return load("tiny-dream", dtype=torch.float32)


def config(method: str, gen_length: int = 16, block_length: int = 8) -> DecodeConfig:
    tree = {k: dict(v) for k, v in METHODS[method].items()}
    steps = tree.pop("shape", {}).get("steps")        # per 16 tokens of region
    shape = dict(gen_length=gen_length, block_length=block_length,
                 steps=None if steps is None else steps * gen_length // 16)
    return DecodeConfig.from_dict({"shape": shape, **tree})


def alone(model, ids, cfg, max_tokens):
    """What the request must answer: generate on its prompt alone, cut at EOS and max_tokens."""
    seq = generate(model, [ids], cfg).sequences[0]     # up to (excluding) the first EOS
    if len(seq) < max_tokens:
        return seq, "stop"
    return seq[:max_tokens], "length"


class Events:
    """A request's events, checked against the contract as they arrive."""

    def __init__(self):
        self.events = []

    def __call__(self, ev):
        assert not self.events or not isinstance(self.events[-1], (Finished, Failed)), \
            f"an event after the final one: {ev}"
        self.events.append(ev)

    @property
    def final(self):
        return self.events[-1] if self.events and isinstance(self.events[-1], (Finished, Failed)) else None

    def streamed(self) -> list[int]:
        out = []
        for ev in self.events:
            if isinstance(ev, Progress):
                assert list(ev.token_ids) == out + list(ev.new_token_ids) and ev.new_token_ids
                out += ev.new_token_ids
        return out


def run_until_idle(engine, limit=500):
    for _ in range(limit):
        if not engine.tick() and not engine.queued:
            return
    raise AssertionError("the engine did not finish within the tick limit")


def check_answers(model, submitted, min_calls=1):
    """Every finished request equals generate alone; its stream adds up to its answer."""
    for name, (ids, cfg, max_tokens, events) in submitted.items():
        fin = events.final
        assert isinstance(fin, Finished), (name, fin)
        want, reason = alone(model, ids, cfg, max_tokens)
        assert list(fin.token_ids) == want, name
        assert fin.finish_reason == reason, name
        assert events.streamed() == want, name
        assert fin.completion_tokens == len(want) and fin.prompt_tokens == len(ids)
        assert fin.stats.nfe >= min_calls, name


# ---- batch invariance ------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llada", "dream", "llada-bf16", "dream-bf16"])
def test_batch_invariance_with_requests_joining_and_leaving(arch, request):
    """Six methods, three prompt lengths, two block and two region lengths, joining
    at different calls; one request is cancelled mid-decode and one finishes
    early: every other answer is generate's alone, token for token. In float32
    (MKL's sgemm) and in bf16 (the linears on packed oneDNN weights where the
    CPU has oneDNN bf16, else on float32 weight copies through sgemm:
    dllm_ops/models/packed_linear.py)."""
    name, _, bf16 = arch.partition("-")
    model = load(f"tiny-{name}", dtype=torch.bfloat16) if bf16 else request.getfixturevalue(name)
    requests_joining_and_leaving(model)


@pytest.mark.parametrize("arch", ["llada", "dream", "llada-bf16", "dream-bf16"])
def test_batch_invariance_with_requests_joining_and_leaving_on_cuda(arch):
    """The same schedule with the model on the GPU (`make gpu-check`): a row's
    answer must not depend on the rows it shares cuBLAS GEMMs with either."""
    require("cuda")
    name, _, bf16 = arch.partition("-")
    model = load(f"tiny-{name}", dtype=torch.bfloat16 if bf16 else torch.float32, device="cuda")
    requests_joining_and_leaving(model)


def requests_joining_and_leaving(model) -> None:
    """Six methods join at different calls, one is cancelled mid-decode, one
    finishes early; every other answer must be generate's alone."""
    engine = Engine(model, max_running=16)
    submitted = {}

    def submit(name, prompt, cfg, max_tokens):
        events = Events()
        handle = engine.submit(Request(PROMPTS[prompt], cfg, max_tokens), events)
        submitted[name] = (PROMPTS[prompt], cfg, max_tokens, events)
        return handle

    anchor = submit("none", 0, config("none"), 16)                # one token per call: 16 calls
    submit("dual", 3, config("dual", gen_length=24), 20)
    for _ in range(2):
        engine.tick()
    submit("d2cache", 6, config("d2cache"), 16)                  # join after two calls
    submit("dare-kv", 9, config("dare-kv", block_length=4), 16)
    doomed = submit("doomed", 1, config("dual"), 16)
    engine.tick()
    assert not doomed.done() and submitted["doomed"][3].streamed()   # mid-decode
    doomed.cancel()
    submit("kivi4", 4, config("kivi4"), 5)                        # a short answer: leaves early
    submit("dare-o", 7, config("dare-o", gen_length=24), 24)
    engine.tick()
    assert doomed.outcome == Failed(499, "the request was cancelled")
    assert not anchor.done()                                      # all of it happened mid-decode
    run_until_idle(engine)
    del submitted["doomed"]
    check_answers(model, submitted, min_calls=2)       # every decode spanned several calls
    assert engine.running == 0 and engine.kv_bytes_reserved == 0 and engine.kv_bytes_in_use() == 0


def test_every_configuration_shares_one_call(llada):
    """Requests of six methods are all rows of the first call (nothing is grouped)."""
    engine = Engine(llada)
    for i, method in enumerate(METHODS):
        engine.submit(Request(PROMPTS[i], config(method), 16), Events())
    timed = config("dual").replace(time_layers=True)     # layer timers run inside the shared call
    handle = engine.submit(Request(PROMPTS[0], timed, 16), Events())
    assert engine.tick()
    m = engine.metrics
    assert m.value("dllm_model_calls_total") == 1
    assert m.value("dllm_model_call_rows_sum") == len(METHODS) + 1 == engine.running
    run_until_idle(engine)
    times = handle.outcome.stats.layer_times
    assert len(times.seconds) == handle.outcome.stats.nfe and all(len(t) == 4 for t in times.seconds)


def test_fused_logits_are_bitwise_the_single_calls(llada, dream):
    """The fused forward's logits per decoder equal model.step on that decoder alone,
    bit for bit, at every call (the token-wise parts are batched, attention per row)."""
    for model in (llada, dream):
        methods = list(METHODS)
        fused = [Decoder(model, [PROMPTS[i]], config(m)) for i, m in enumerate(methods)]
        single = [Decoder(model, [PROMPTS[i]], config(m)) for i, m in enumerate(methods)]
        calls = 0
        while True:
            live = [(f, s) for f, s in zip(fused, single) if f.ready()]
            if not live:
                break
            pending = [f.begin_call() for f, _ in live]
            outs = fused_step(model, [RowCall.of(f, c) for (f, _), c in zip(live, pending)])
            for (f, s), call, out in zip(live, pending, outs):
                assert s.ready()
                own = s.begin_call()
                want = model.step(s.state.x, own.plan, s.state.cache,
                                  return_probs=s.policy.wants_probs, reuse=s.reuse)
                assert torch.equal(out, want), (model.config.arch, calls)
                s.end_call(own, want)
                f.end_call(call, out)
            calls += 1
        assert calls >= 8


# ---- admission: slots, KV budget, queue -------------------------------------------------

def test_abort_frees_the_slot_and_the_kv_bytes(llada):
    engine = Engine(llada, max_running=1)
    first = engine.submit(Request(PROMPTS[0], config("dual"), 16), Events())
    second = engine.submit(Request(PROMPTS[1], config("dual"), 16), Events())
    engine.tick()
    m = engine.metrics
    assert m.value("dllm_running_sequences") == 1 and m.value("dllm_queue_depth") == 1
    in_use = m.value("dllm_kv_bytes_in_use")
    # a stacked row holds one slot of its cohort's canvas width
    slot = KVCache.full_nbytes(4, 1, 4, canvas_width(llada, len(PROMPTS[0]) + 16), 32, torch.float32)
    assert in_use == slot == m.value("dllm_kv_bytes_reserved")
    first.cancel()
    engine.tick()                                  # the abort frees the slot: the second joins
    assert first.outcome == Failed(499, "the request was cancelled")
    assert m.value("dllm_running_sequences") == 1 and m.value("dllm_queue_depth") == 0
    assert m.value("dllm_kv_bytes_in_use") == KVCache.full_nbytes(
        4, 1, 4, canvas_width(llada, len(PROMPTS[1]) + 16), 32, torch.float32)
    second.cancel()
    engine.tick()
    assert m.value("dllm_running_sequences") == 0
    assert m.value("dllm_kv_bytes_in_use") == 0 and m.value("dllm_kv_bytes_reserved") == 0


def test_kv_budget_admits_more_quantized_sequences(llada):
    """Under one budget (8 full-precision sequences), 4-bit and 2-bit caches admit
    more: as many as their peak bytes fit, first come first served."""
    ids = PROMPTS[6]
    shape = dict(gen_length=64, block_length=8)     # top-k, one token per call
    configs = {name: DecodeConfig.from_dict(dict(shape=shape, cache=dict(method="dual"), storage=st))
               for name, st in (("full", dict(method="full")), ("kivi4", dict(method="kivi", bits=4)),
                                ("kivi2", dict(method="kivi", bits=2)))}
    peak = {name: sequence_kv_bytes(llada, cfg, make_storage(llada, cfg.storage, "dual"), len(ids))
            for name, cfg in configs.items()}
    assert peak["full"] == KVCache.full_nbytes(4, 1, 4, len(ids) + 64, 32, torch.float32)
    # full precision stacks: each row holds a slot of its cohort's canvas width
    width = canvas_width(llada, len(ids) + 64)
    assert width > len(ids) + 64
    peak["full"] = KVCache.full_nbytes(4, 1, 4, width, 32, torch.float32)
    budget = 8 * peak["full"]
    admitted = {}
    for name, cfg in configs.items():
        engine = Engine(llada, max_running=64, kv_budget=budget)
        for _ in range(48):
            engine.submit(Request(ids, cfg, 64), Events())
        engine.tick()
        admitted[name] = engine.metrics.value("dllm_running_sequences")
        assert admitted[name] == budget // peak[name] == engine.kv_bytes_reserved // peak[name] < 48
        assert engine.metrics.value("dllm_queue_depth") == 48 - admitted[name]
        for _ in range(3):                         # what they hold stays within what was reserved
            engine.tick()
            assert 0 < engine.kv_bytes_in_use() <= engine.kv_bytes_reserved <= budget
    assert admitted["kivi2"] > admitted["kivi4"] > admitted["full"] == 8, admitted


def test_packed_peak_bytes_bound_what_the_cache_holds(llada, monkeypatch):
    """QuantKVCache.peak_nbytes is exactly the largest size the cache reaches during
    a decode (sampled at every attention, where a block start holds a full layer)."""
    seen = []
    attend = QuantKVCache.attend

    def spy(self, layer, q, scale, return_probs=False):
        seen.append((self, self.nbytes()))
        return attend(self, layer, q, scale, return_probs)

    monkeypatch.setattr(QuantKVCache, "attend", spy)
    for mode in ("dual", "prefix"):
        seen.clear()
        cfg = DecodeConfig.from_dict(dict(shape=dict(gen_length=32, block_length=8),
                                          cache=dict(method=mode), storage=dict(method="kivi", bits=4)))
        generate(llada, [PROMPTS[6]], cfg)
        cache = seen[0][0]
        bound = cache.peak_nbytes(len(PROMPTS[6]), 8, 4)
        peak = max(n for _, n in seen)
        assert peak == bound, mode      # the last layer's block-start write is the peak


def test_a_request_larger_than_the_whole_budget_is_refused(llada):
    engine = Engine(llada, kv_budget=10_000)
    with pytest.raises(ServeError, match=r"more than the server's whole KV budget of 10000 bytes") as e:
        engine.submit(Request(PROMPTS[0], config("dual"), 16), Events())
    assert e.value.status == 400 and engine.queued == 0


def test_queue_full_raises_queue_full(llada):
    engine = Engine(llada, max_running=1, max_queue=2)
    for i in range(2):
        engine.submit(Request(PROMPTS[i], config("dual"), 16), Events())
    with pytest.raises(QueueFull, match=r"the wait queue is full \(2 requests\)") as e:
        engine.submit(Request(PROMPTS[2], config("dual"), 16), Events())
    assert e.value.status == 429 and e.value.retry_after >= 1
    assert engine.metrics.value("dllm_queue_depth") == 2


@pytest.mark.parametrize("change,error,match", [
    (dict(prompt=list(range(5, 41)) * 7), DecodeError, "exceeds the model's maximum of 256"),
    (dict(prompt=[5, 3, 7]), DecodeError, "contains the mask id 3"),
    (dict(max_tokens=17), ServeError, "max_tokens = 17 exceeds shape.gen_length = 16"),
    (dict(max_tokens=0), ServeError, "max_tokens = 0: must be an integer >= 1"),
    (dict(reveal=dict(top_p=0.9)), DecodeError, "top_p are Dream sampling options"),
    (dict(reveal=dict(unmask="topk"), shape=dict(steps=3)), DecodeError,
     r"steps \(3\) must be a positive multiple of the number of blocks \(2\)"),
    (dict(shape=dict(max_blocks=1)), ServeError, "decodes only 8 tokens, fewer than max_tokens"),
    (dict(timeout_s=0), ServeError, "timeout_s = 0"),
])
def test_bad_requests_are_refused_at_submit(llada, change, error, match):
    base = config("dual").to_dict()
    for section in ("reveal", "shape"):
        base[section].update(change.get(section, {}))
    req = Request(change.get("prompt", PROMPTS[0]), DecodeConfig.from_dict(base),
                  change.get("max_tokens", 16), timeout_s=change.get("timeout_s"))
    engine = Engine(llada)
    with pytest.raises(error, match=match):
        engine.submit(req, Events())
    assert engine.queued == 0


def test_engine_settings_are_checked(llada):
    with pytest.raises(ServeError, match="max_running = 0"):
        Engine(llada, max_running=0)
    with pytest.raises(ServeError, match="kv_budget = -1"):
        Engine(llada, kv_budget=-1)
    with pytest.raises(ConfigError):
        config("dual", gen_length=12)      # not a multiple of the block: the config refuses it


# ---- faults, timeouts, shutdown ---------------------------------------------------------

class FailsOnCall(DualCache):
    """A dual cache whose plan raises on the given call of the decode."""

    def __init__(self, fail_at: int):
        super().__init__()
        self.calls, self.fail_at = 0, fail_at

    def on_block_start(self, state):
        return self._count(super().on_block_start(state))

    def plan(self, state):
        return self._count(super().plan(state))

    def _count(self, plan):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("policy fault on purpose")
        return plan


class FaultyEngine(Engine):
    """Builds the decoder of request "bad" with an instrumented policy or reuse rule."""

    def __init__(self, model, policy=None, reuse=None, **kw):
        super().__init__(model, **kw)
        self.policy, self.reuse = policy, reuse

    def cohort_of(self, request):
        return None if request.request_id == "bad" else super().cohort_of(request)

    def build_decoder(self, request):
        if request.request_id != "bad":
            return super().build_decoder(request)
        return Decoder(self.model, [request.prompt_ids], request.config, policy=self.policy,
                       reuse=self.reuse)


class RaisingReuse:
    """A reuse rule whose attention branch raises in layer 2 of the decode's 3rd call,
    after its layers 0-1 ran inside the shared forward."""

    def __init__(self):
        self.calls = 0

    def begin_call(self, refresh):
        self.calls += 1

    def attention_branch(self, model, li, layer, a, call):
        from dllm_ops.models.transformer import full_attention
        if self.calls == 3 and li == 2:
            raise RuntimeError("attention fault on purpose")
        return full_attention(model, li, layer, a, call)


@pytest.mark.parametrize("fault", ["policy", "attention", "own attention", "batched mlp",
                                   "batched projection"])
def test_a_fault_fails_only_its_request(llada, fault, monkeypatch):
    """A request whose plan raises on its 2nd call, or whose attention branch
    (a DARE-style rule's, or the K/V write and attention of a row whose
    projections ran batched) raises mid-forward, fails with 500; the others
    decode on and still equal generate alone. When a batched token-wise part
    (an MLP, a q/k/v or output projection) raises, each row runs it alone: no
    row fails (here none raises alone) and the answers stay exact."""
    kw = dict(policy=FailsOnCall(2)) if fault == "policy" else \
        dict(reuse=RaisingReuse()) if fault == "attention" else {}
    engine = FaultyEngine(llada, **kw)
    raised = []
    if fault == "own attention":
        from dllm_ops.serve import fused
        write_and_attend, seen = fused.write_and_attend, []

        def fails_for_bad(model, li, q, k, v, call):
            bad_seq = [s for s in engine._running if s.request.request_id == "bad"]
            if bad_seq and call.cache is bad_seq[0].decoder.state.cache and li == 2:
                seen.append(li)
                if len(seen) == 3:
                    raise RuntimeError("own attention fault on purpose")
            return write_and_attend(model, li, q, k, v, call)
        monkeypatch.setattr(fused, "write_and_attend", fails_for_bad)
    if fault.startswith("batched"):
        from dllm_ops.serve import fused
        init, current = fused._PackedTokens.__init__, {}

        def remember(self, parts):           # the fused call in progress
            init(self, parts)
            current["call"] = self
        monkeypatch.setattr(fused._PackedTokens, "__init__", remember)
    if fault == "batched projection":
        token_linear = fused.token_linear
        # q/k/v raise in layers 0-1, the output projection in layers 2-3
        refused = {id(l.q) for l in llada.layers[:2]} | {id(l.o) for l in llada.layers[2:]}

        def refuses_several_rows(linear, x):
            call = current.get("call")
            if (call is not None and len(call.alive()) > 1 and x.shape[0] == call.rows
                    and id(linear) in refused):
                raised.append(x.shape[0])
                raise RuntimeError("batched projection fault on purpose")
            return token_linear(linear, x)
        monkeypatch.setattr(fused, "token_linear", refuses_several_rows)
        token_linears = fused.token_linears          # q, k and v share one call

        def refuses_several_rows_together(linears, x):
            call = current.get("call")
            if (call is not None and len(call.alive()) > 1 and x.shape[0] == call.rows
                    and any(id(linear) in refused for linear in linears)):
                raised.append(x.shape[0])
                raise RuntimeError("batched projection fault on purpose")
            return token_linears(linears, x)
        monkeypatch.setattr(fused, "token_linears", refuses_several_rows_together)
    if fault == "batched mlp":
        from dllm_ops.models.transformer import Block
        mlp = Block.mlp

        def refuses_several_rows(self, x):
            call = current.get("call")
            if call is not None and len(call.alive()) > 1 and x.shape[1] == call.rows:
                raised.append(x.shape[1])
                raise RuntimeError("batched MLP fault on purpose")
            return mlp(self, x)
        monkeypatch.setattr(Block, "mlp", refuses_several_rows)
    # top-k: one token per call, so the bad request is still decoding at its 2nd and 3rd calls
    bad_config = DecodeConfig.from_dict(dict(shape=dict(gen_length=16, block_length=8),
                                             cache=dict(method="dual")))
    bad_events = Events()
    bad = engine.submit(Request(PROMPTS[0], bad_config, 16, request_id="bad"), bad_events)
    submitted = {}
    for i, method in enumerate(["dual", "none", "d2cache"]):
        ev = Events()
        engine.submit(Request(PROMPTS[i + 1], config(method), 16), ev)
        submitted[method] = (PROMPTS[i + 1], config(method), 16, ev)
    run_until_idle(engine)
    monkeypatch.undo()
    if fault.startswith("batched"):
        assert len(raised) >= 4                    # the batched part failed in every layer of a call
        submitted["bad"] = (PROMPTS[0], bad_config, 16, bad_events)
    else:
        assert bad.outcome.status == 500
        assert f"{fault} fault on purpose" in bad.outcome.message
    check_answers(llada, submitted)


def test_timeout_fails_the_request(llada):
    engine = Engine(llada)
    slow = engine.submit(Request(PROMPTS[0], config("none"), 16, timeout_s=0.05), Events())
    other = engine.submit(Request(PROMPTS[1], config("none"), 16), Events())
    engine.tick()
    threading.Event().wait(0.1)
    engine.tick()
    assert slow.outcome == Failed(504, "the request timed out after 0.05 s (timeout_s)")
    assert engine.running == 1 and not other.done()
    queued = Engine(llada, max_running=1)
    queued.submit(Request(PROMPTS[0], config("none"), 16), Events())
    late = queued.submit(Request(PROMPTS[1], config("none"), 16, timeout_s=0.05), Events())
    queued.tick()
    threading.Event().wait(0.1)
    queued.tick()                                   # it timed out while waiting in the queue
    assert late.outcome.status == 504 and queued.queued == 0


def test_shutdown_drains_running_and_refuses_the_rest(llada):
    engine = Engine(llada, max_running=1)
    running = engine.submit(Request(PROMPTS[0], config("dual"), 16), Events())
    waiting = engine.submit(Request(PROMPTS[1], config("dual"), 16), Events())
    engine.tick()
    assert engine.shutdown(drain_timeout=60) is True
    assert isinstance(running.outcome, Finished)
    assert waiting.outcome.status == 503
    with pytest.raises(EngineStopped) as e:
        engine.submit(Request(PROMPTS[2], config("dual"), 16), Events())
    assert e.value.status == 503
    # a drain that runs out of time aborts what is still running
    hurried = Engine(llada)
    cut = hurried.submit(Request(PROMPTS[0], config("none"), 16), Events())
    hurried.tick()
    assert hurried.shutdown(drain_timeout=0) is False
    assert cut.outcome.status == 503 and "drain timeout" in cut.outcome.message
    assert hurried.running == 0 and hurried.kv_bytes_reserved == 0


def test_threaded_engine_serves_concurrent_submitters(llada):
    """start(): submitters on four threads, events awaited with a bound; every answer
    is generate's alone, and shutdown drains."""
    engine = Engine(llada, max_running=4)
    engine.start()
    submitted, lock, errors = {}, threading.Lock(), []

    def client(t):
        try:
            for j in range(2):
                i = (2 * t + j) % len(PROMPTS)
                method = list(METHODS)[(t + j) % len(METHODS)]
                ev = Events()
                handle = engine.submit(Request(PROMPTS[i], config(method), 16), ev)
                with lock:
                    submitted[f"{t}-{j}-{method}"] = (PROMPTS[i], config(method), 16, ev, handle)
        except Exception as e:   # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    assert not errors
    for name, (*_, handle) in submitted.items():
        assert handle.wait(timeout=60), name
    assert engine.shutdown(drain_timeout=10) is True
    check_answers(llada, {k: v[:4] for k, v in submitted.items()})


# ---- metrics --------------------------------------------------------------------------------

def test_metrics_render_every_series(llada):
    metrics = ServerMetrics()
    engine = Engine(llada, metrics=metrics)
    engine.submit(Request(PROMPTS[0], config("dual"), 16), Events())
    run_until_idle(engine)
    metrics.requests.labels(status="200").inc()      # the HTTP layer's part
    text = metrics.render().decode()
    for series in ("dllm_requests_total{status=\"200\"} 1.0", "dllm_queue_depth 0.0",
                   "dllm_running_sequences 0.0", "dllm_generated_tokens_total",
                   "dllm_model_calls_total", "dllm_model_call_seconds_bucket",
                   "dllm_request_seconds_count 1.0", "dllm_kv_bytes_in_use 0.0"):
        assert series in text, series
    assert metrics.value("dllm_generated_tokens_total") > 0
    assert metrics.value("dllm_model_calls_total") == metrics.value("dllm_model_call_seconds_count") > 1
