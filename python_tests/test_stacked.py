"""Stacked decodes (dllm_ops/serve/stacked.py): a cohort's requests as rows of one state.

What must hold: each row answers, with the same counts, what ``generate``
answers for it alone (float32 and bf16, both tiny models, every cache method
and reveal rule that stacks), while rows join and leave at different calls of
different blocks; the stacked part's logits are the single decode's bit for
bit; the cohort rule sends everything else to its own Decoder; the slab's
slots and bytes follow the rows; a fault in a cohort fails that cohort only.
"""
import pytest

pytest.importorskip("prometheus_client")
import torch

from dllm_ops import ops
from dllm_ops.config import DecodeConfig
from dllm_ops.decode import Decoder, generate
from dllm_ops.models import load
from dllm_ops.plan import KVCache
from dllm_ops.serve import Engine, Failed, Finished, Request
from dllm_ops.serve.fused import RowCall, fused_step
from dllm_ops.serve.stacked import SlabCache, StackedDecodes, canvas_width, cohort_key
from dllm_ops.tasks import problems
from backends import require

pytestmark = pytest.mark.models

# prompts of 24, 18, 46 and 18 tokens from the suite the tiny models solve
PROMPTS = [list(p.prompt_ids) for t in ("add", "scan", "sub", "lag2") for p in problems(t, 3, seed=7)]

#: what stacks, per architecture: (cache method, reveal section[, calls per block]); top-k
#: with 3 calls per block of 8 commits 3, 3, then 2 tokens: each row's quota is its step's
STACKING = {
    "llada": [("dual", dict(unmask="threshold", threshold=0.9)), ("prefix", dict(unmask="topk"), 3),
              ("none", dict(unmask="factor", factor=1.0)),
              ("dual", dict(unmask="topk", temperature=5.0)),    # Gumbel draws per row (the tiny
              # models are so sure of their answers that only a high temperature varies them)
              ("prefix", dict(unmask="threshold", threshold=0.8, remasking="random"))],  # uniform draws
    "dream": [("dual", dict(alg="confidence_threshold", threshold=0.9)),
              ("prefix", dict(alg="confidence_threshold", threshold=0.7, temperature=3.0, top_p=0.95,
                              top_k=12)),
              ("dual", dict()),                                               # Dream's default: entropy
              ("prefix", dict(alg="maskgit_plus", alg_temp=2.0), 3)],         # positions drawn per row
}


@pytest.fixture(scope="module")
def models():
    return {}


def model_for(models, name, dtype=torch.float32, device="cpu"):
    key = (name, dtype, device)
    if key not in models:
        models[key] = load(f"tiny-{name}", dtype=dtype, device=device)
    return models[key]


def config(method, reveal, gen_length=16, block_length=8, steps_per_block=None):
    steps = None if steps_per_block is None else steps_per_block * gen_length // block_length
    return DecodeConfig.from_dict(dict(shape=dict(gen_length=gen_length, block_length=block_length, steps=steps),
                                       cache=dict(method=method), reveal=reveal))


def stacked_schedule(model, method, reveal, steps_per_block=None):
    """Requests of one cohort kind join at calls 0, 1, 2 and 4 (different prompt
    lengths and regions, so rows sit at different calls of different blocks and
    in two widths: the slab widens under a row mid-decode), one is cancelled
    mid-decode (a middle row: the last row moves into its slot); every other
    answer and its counts must be generate's alone."""
    engine = Engine(model, max_running=16)
    added = []
    add = StackedDecodes.add

    def spy(self, owner, prompt_ids, cfg):
        added.append(owner.request.request_id)
        return add(self, owner, prompt_ids, cfg)

    submitted, handles = {}, {}

    def submit(name, prompt, gen_length):
        cfg = config(method, reveal, gen_length=gen_length, steps_per_block=steps_per_block)
        cfg = cfg.replace(shape=cfg.shape.replace(seed=prompt))    # each its own stream when it samples
        events = []
        handles[name] = engine.submit(Request(PROMPTS[prompt], cfg, gen_length, request_id=name),
                                      events.append)
        submitted[name] = (PROMPTS[prompt], cfg)

    StackedDecodes.add = spy
    widths = []
    tick = engine.tick

    def tick_and_look():
        ran = tick()
        assert len(engine._stacks) <= 1
        for st in engine._stacks:
            if not widths or widths[-1] != st.width:
                widths.append(st.width)
        return ran

    engine.tick = tick_and_look
    try:
        submit("b", 0, 16)                 # 24 + 16 columns: a cohort of width 64
        engine.tick()
        submit("a", 7, 32)                 # 46 + 32 columns (width 96): the slab widens under b
        submit("doomed", 3, 32)
        submit("c", 10, 24)
        engine.tick()
        submit("d", 1, 16)
        engine.tick()
        assert not handles["doomed"].done()
        handles["doomed"].cancel()         # a middle row: the last row moves into its slot
        engine.tick()
        submit("e", 4, 40)
        for _ in range(300):
            if not engine.tick() and not engine.queued:
                break
    finally:
        StackedDecodes.add = add
    assert sorted(added) == sorted(submitted)              # every request ran as a row
    assert widths == [64, 96], widths                      # of one cohort, widened once
    assert handles["doomed"].outcome == Failed(499, "the request was cancelled")
    del submitted["doomed"]
    for name, (ids, cfg) in submitted.items():
        fin = handles[name].outcome
        assert isinstance(fin, Finished), (name, fin)
        alone = generate(model, [ids], cfg)
        seq = alone.sequences[0]
        assert list(fin.token_ids) == seq, name
        got, want = fin.stats, alone.stats
        for key in ("nfe", "recomputed_per_step", "model_flops", "eos_filled", "blocks_decoded",
                    "generated_tokens", "tokens_recomputed", "cache", "reveal", "blocks"):
            assert got[key] == want[key], (name, key, got[key], want[key])
    assert engine.running == 0 and engine.kv_bytes_in_use() == 0 and engine.kv_bytes_reserved == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch,case", [(a, i) for a, cases in STACKING.items() for i in range(len(cases))])
def test_stacked_rows_answer_what_generate_answers_alone(models, arch, case, dtype):
    stacked_schedule(model_for(models, arch, dtype), *STACKING[arch][case])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", list(STACKING))
def test_stacked_rows_answer_what_generate_answers_alone_on_cuda(models, arch, dtype):
    """The same schedule on the GPU (`make gpu-check`), every stacking kind of the model."""
    require("cuda")
    for case in STACKING[arch]:
        stacked_schedule(model_for(models, arch, dtype, "cuda"), *case)


@pytest.mark.parametrize("arch", list(STACKING))
def test_stacked_logits_are_bitwise_the_single_calls(models, arch):
    """At every call, each row's logits in the stacked part of a fused call equal
    ``model.step`` of that request's own Decoder, bit for bit; so do those of a
    single decoder's part after it in the same call (its tokens follow the
    cohort's real tokens in the packing)."""
    model = model_for(models, arch)
    method, reveal = STACKING[arch][0][:2]
    prompts = [PROMPTS[0], PROMPTS[6], PROMPTS[3]]          # 24, 46, 18 tokens
    cfgs = [config(method, reveal, gen_length=g) for g in (16, 32, 16)]
    widths = {canvas_width(model, len(p) + c.shape.gen_length) for p, c in zip(prompts, cfgs)}
    stack = StackedDecodes(model, cfgs[0], width=max(widths))
    singles = []
    for i, (p, c) in enumerate(zip(prompts, cfgs)):
        stack.add(i, p, c)
        singles.append(Decoder(model, [p], c))
    after, after_alone = (Decoder(model, [PROMPTS[7]], cfgs[1]) for _ in range(2))
    calls = 0
    while True:
        over = stack.ready()
        for owner in over:
            stack.remove(owner)
        if not stack.rows:
            break
        call = stack.begin_call()
        parts = [call]
        if after.ready():
            pending = after.begin_call()
            parts.append(RowCall.of(after, pending))
        outs = fused_step(model, parts)
        out = outs[0]
        assert not any(isinstance(o, Exception) for o in outs), outs
        if len(parts) == 2:
            assert after_alone.ready()
            own = after_alone.begin_call()
            want = model.step(after_alone.state.x, own.plan, after_alone.state.cache)
            assert torch.equal(outs[1], want), (arch, calls, "the part after the cohort")
            after_alone.end_call(own, want)
            after.end_call(pending, outs[1])
        for r, row in enumerate(stack.rows):
            dec = singles[row.owner]
            assert dec.ready()
            own = dec.begin_call()
            want = model.step(dec.state.x, own.plan, dec.state.cache)
            P = want.shape[1]
            assert torch.equal(out[r, :P], want[0]), (arch, calls, row.owner)
            assert not out[r, P:].any()                     # the part's padding rows
            dec.end_call(own, want)
        stack.end_call(call, out)
        calls += 1
    assert calls >= 4
    assert all(not d.ready() for d in singles)


def test_a_fused_call_pads_its_token_rows_once(models, monkeypatch):
    """The fused call's hidden states carry the zero rows every token-row GEMM
    pads to, so no layer's GEMM pads (and slices) its rows again: of the
    call's padding, only the LM head's gathered rows are left."""
    from dllm_ops.models import transformer
    model = model_for(models, "llada")
    cfgs = [config("dual", dict(unmask="threshold"), gen_length=g) for g in (16, 32, 16)]
    stack = StackedDecodes(model, cfgs[0], width=96)
    for i, (p, c) in enumerate(zip([PROMPTS[0], PROMPTS[6], PROMPTS[3]], cfgs)):
        stack.add(i, p, c)
    stack.ready()
    call = stack.begin_call()
    tokens = call.plan.n_tokens
    assert tokens % 16, tokens                  # (block starts: 40 + 78 + 34 columns)
    padded, pad = [], transformer.pad_token_rows

    def spy(x):
        out = pad(x)
        if out[0] is not x:
            padded.append(x.numel() // x.shape[-1])
        return out

    monkeypatch.setattr(transformer, "pad_token_rows", spy)
    fused_step(model, [call])
    assert padded == [call.plan.logits_idx.numel()], (padded, tokens)


def test_what_stacks_and_what_runs_its_own_decoder(models):
    llada, dream = model_for(models, "llada"), model_for(models, "dream")
    base = dict(shape=dict(gen_length=16, block_length=8))
    stacks = dict(cache=dict(method="dual"), reveal=dict(unmask="threshold"))
    key = cohort_key(llada, DecodeConfig.from_dict({**base, **stacks}))
    assert key is not None
    # the region may differ (widths are the engine's choice: test_widths_share_a_cohort_within_the_spread);
    # block length and rule split cohorts
    assert cohort_key(llada, DecodeConfig.from_dict({"shape": dict(gen_length=48, block_length=8), **stacks})) == key
    assert cohort_key(llada, DecodeConfig.from_dict(
        {"shape": dict(gen_length=16, block_length=16), **stacks})) != key
    own = [dict(cache=dict(method="d2cache")),
           dict(cache=dict(method="dual"), reuse=dict(method="kv", rho=0.5)),
           dict(cache=dict(method="dual"), storage=dict(method="kivi", bits=4)),
           dict(cache=dict(method="dual"), reveal=dict(unmask="threshold", prior_sigma=3.0)),
           {**stacks, "time_layers": True}]
    for tree in own:
        assert cohort_key(llada, DecodeConfig.from_dict({**base, **tree})) is None, tree
    # sampling settings are part of the cohort, not a reason to run alone
    sampled = DecodeConfig.from_dict({**base, **stacks, "reveal": dict(unmask="threshold", temperature=0.5)})
    assert cohort_key(llada, sampled) not in (None, key)
    assert cohort_key(llada, sampled.replace(shape=sampled.shape.replace(seed=3))) == \
        cohort_key(llada, sampled)
    dream_own = [dict(cache=dict(method="none"), reveal=dict(alg="confidence_threshold")),
                 dict(cache=dict(method="none"), reveal=dict(alg="entropy"))]
    for tree in dream_own:
        assert cohort_key(dream, DecodeConfig.from_dict({**base, **tree})) is None, tree
    for alg in ("confidence_threshold", "entropy", "maskgit_plus", "topk_margin"):
        assert cohort_key(dream, DecodeConfig.from_dict(
            {**base, "cache": dict(method="dual"), "reveal": dict(alg=alg)})) is not None, alg
    # a width never exceeds the model's length limit, nor cuts a canvas
    assert canvas_width(llada, 250) == 256 and canvas_width(llada, 256) == 256


def test_widths_share_a_cohort_within_the_spread(models):
    """Rows of widths 64 and 96 share one slab (96 columns); one of width 160
    (more than twice 64) starts a cohort of its own, which a later row of 96
    does not join (its joining there would add a 160-column slot, in the first
    only a 96-column one); the engine reserves exactly the slabs' bytes, and
    every answer is generate's alone."""
    model = model_for(models, "llada")
    engine = Engine(model, max_running=16)
    slot = {w: KVCache.full_nbytes(4, 1, 4, w, 32, torch.float32) for w in (64, 96, 128, 160)}
    jobs = [("w64", PROMPTS[0], 16), ("w96", PROMPTS[6], 32), ("w160", PROMPTS[6], 96), ("w96b", PROMPTS[7], 32)]
    handles = {}
    for name, ids, gen in jobs[:3]:
        handles[name] = engine.submit(Request(ids, config("dual", dict(unmask="threshold"), gen), gen,
                                              request_id=name), lambda ev: None)
    engine.tick()
    stacks = sorted(engine._stacks, key=lambda st: st.width)
    assert [(st.width, sorted(r.owner.request.request_id for r in st.rows)) for st in stacks] == \
        [(96, ["w64", "w96"]), (160, ["w160"])]
    assert engine.kv_bytes_reserved == 2 * slot[96] + slot[160]
    assert stacks[0].fits(64) and stacks[0].fits(128) and not stacks[0].fits(160)
    assert stacks[1].fits(96) and not stacks[1].fits(64)
    assert stacks[0].join_nbytes(96) == slot[96] and stacks[1].join_nbytes(96) == slot[160]
    assert stacks[0].join_nbytes(128) == 3 * slot[128] - 2 * slot[96]   # a slot, and the widening
    name, ids, gen = jobs[3]
    handles[name] = engine.submit(Request(ids, config("dual", dict(unmask="threshold"), gen), gen,
                                          request_id=name), lambda ev: None)
    engine.tick()
    assert "w96b" in [r.owner.request.request_id for r in stacks[0].rows] and stacks[0] in engine._stacks
    for _ in range(200):
        if not engine.tick():
            break
    for name, ids, gen in jobs:
        fin = handles[name].outcome
        assert isinstance(fin, Finished), (name, fin)
        want = generate(model, [ids], config("dual", dict(unmask="threshold"), gen)).sequences[0]
        assert list(fin.token_ids) == want[:gen], name
    assert engine.kv_bytes_reserved == 0 and not engine._stacks


def test_a_widening_join_counts_against_the_kv_budget(models):
    """A row that would widen a cohort's slab costs the whole widening: with a
    budget of two 64-column slots and one 96-column one, a 96-wide request
    behind two 64-wide rows waits (joining would take three 96-column slots)
    until they leave, then starts a cohort of its own; what is reserved never
    exceeds the budget."""
    model = model_for(models, "llada")
    slot = {w: KVCache.full_nbytes(4, 1, 4, w, 32, torch.float32) for w in (64, 96)}
    engine = Engine(model, max_running=16, kv_budget=2 * slot[64] + slot[96])
    jobs = [(PROMPTS[0], 16), (PROMPTS[3], 16), (PROMPTS[6], 32)]     # widths 64, 64, 96
    handles = [engine.submit(Request(ids, config("dual", dict(unmask="threshold"), gen), gen), lambda ev: None)
               for ids, gen in jobs]
    engine.tick()
    assert engine.running == 2 and engine.queued == 1 and engine.kv_bytes_reserved == 2 * slot[64]
    for _ in range(100):
        assert engine.kv_bytes_reserved <= engine.kv_budget
        if not engine.tick() and not engine.queued:
            break
    assert all(isinstance(h.outcome, Finished) for h in handles), [h.outcome for h in handles]


def test_masks_to_idx_counts_equals_each_mask_alone():
    """The cohort's plan reads both masks' counts at once; each result is the
    mask's own ``mask_to_idx_counts`` (an empty row and one row included)."""
    from dllm_ops.plan import mask_to_idx_counts, masks_to_idx_counts
    g = torch.Generator().manual_seed(0)
    for rows in (1, 5):
        run = torch.rand(rows, 37, generator=g) < 0.6
        run[-1] = False if rows > 1 else run[-1]
        want = run & (torch.rand(rows, 37, generator=g) < 0.3)
        for (idx, counts), mask in zip(masks_to_idx_counts(run, want), (run, want)):
            alone, alone_counts = mask_to_idx_counts(mask)
            assert torch.equal(idx, alone) and counts == alone_counts == mask.sum(1).tolist()


def test_a_block_without_a_mask_opens_the_next_one(models):
    """ready() opens a row's blocks until one holds a mask, as a Decoder's
    ready() does: a row at its first block finding two blocks without a mask,
    one mid-decode finding its block and the next without (the first round's
    block known from the read every row gets, later ones read per round)."""
    model = model_for(models, "llada")
    cfg = config("dual", dict(unmask="threshold"), gen_length=32)    # 4 blocks of 8
    stack = StackedDecodes(model, cfg, width=96)
    stack.add("fresh", PROMPTS[0], cfg)
    stack.add("mid", PROMPTS[1], cfg)
    (p0, p1), L, token = (len(PROMPTS[0]), len(PROMPTS[1])), 8, PROMPTS[0][0]
    assert stack.ready() == [] and [r.blocks_decoded for r in stack.rows] == [1, 1]
    stack.x[0, p0:p0 + 2 * L] = token            # the fresh row's first two blocks: no mask
    stack.rows[0].blocks_decoded = 0
    stack.x[1, p1:p1 + 2 * L] = token            # the mid row's block and the next: no mask
    assert stack.ready() == []
    assert [(r.blocks_decoded, r.block_start, r.step) for r in stack.rows] == \
        [(3, p0 + 2 * L, 0), (3, p1 + 2 * L, 0)]


def test_slots_follow_the_rows(models):
    """The slab grows a slot when a row joins a full one, keeps a left slot for the
    next row, moves the last row into a hole, and is freed when the cohort empties."""
    model = model_for(models, "llada")
    cfg = config("dual", dict(unmask="threshold"))
    stack = StackedDecodes(model, cfg, width=64)
    slot = KVCache.full_nbytes(4, 1, 4, 64, 32, torch.float32)
    assert stack.row_nbytes() == slot and stack.nbytes() == 0
    for i in range(3):
        stack.add(i, PROMPTS[i], cfg)
    assert stack.nbytes() == 3 * slot and not stack.has_free_slot()
    stack.ready()
    stack.end_call(call := stack.begin_call(), fused_step(model, [call])[0])
    moved = [stack.x[2].clone(), stack.k[1][2].clone(), stack.v[3][2].clone()]
    stack.remove(0)                                        # the last row moves into slot 0
    assert [r.owner for r in stack.rows] == [2, 1] and stack.has_free_slot()
    assert torch.equal(stack.x[0], moved[0]) and torch.equal(stack.k[1][0], moved[1])
    assert torch.equal(stack.v[3][0], moved[2])
    stack.add(3, PROMPTS[3], cfg)                          # takes the idle slot
    assert stack.nbytes() == 3 * slot and stack.index(3) == 2
    stack.ready()
    valid = stack.begin_call().cache.key_valid            # the joining row's own columns only
    assert not valid[2, len(PROMPTS[3]) + 16:].any() and valid[2, :len(PROMPTS[3]) + 16].all()
    # (its K/V slot keeps the left row's values: its first call writes every column it reads)
    for owner in (1, 2, 3):
        stack.remove(owner)
    assert stack.nbytes() == 0 and not stack.rows


def test_rows_joining_between_calls_cost_one_allocation(models, monkeypatch):
    """Rows that join between two calls (a burst of admissions) are counted at
    once (slots, bytes) and written into the slab with one allocation and one
    copy of the rows already there, not one each."""
    model = model_for(models, "llada")
    cfg = config("dual", dict(unmask="threshold"))
    stack = StackedDecodes(model, cfg, width=64)
    sizes, allocate = [], StackedDecodes._allocate

    def spy(self, capacity, width):
        sizes.append((capacity, width))
        return allocate(self, capacity, width)

    monkeypatch.setattr(StackedDecodes, "_allocate", spy)
    slot = KVCache.full_nbytes(4, 1, 4, 64, 32, torch.float32)
    for i in range(5):
        stack.add(i, PROMPTS[i], cfg)
    assert stack.nbytes() == 5 * slot and not stack.has_free_slot() and sizes == []
    stack.ready()
    assert sizes == [(5, 64)]
    assert all(stack.x[i, :len(PROMPTS[i])].tolist() == PROMPTS[i] for i in range(5))
    call = stack.begin_call()
    stack.end_call(call, fused_step(model, [call])[0])
    before = [t.clone() for t in (stack.x[:5], stack.k[2][:5])]
    for i in range(5, 8):
        stack.add(i, PROMPTS[i], cfg)
    stack.ready()
    assert sizes == [(5, 64), (8, 64)] and stack.nbytes() == 8 * slot
    assert torch.equal(stack.x[:5], before[0]) and torch.equal(stack.k[2][:5], before[1])
    assert all(stack.x[i, :len(PROMPTS[i])].tolist() == PROMPTS[i] for i in range(5, 8))


def test_a_fault_in_a_cohort_fails_only_its_rows(models, monkeypatch):
    """A commit that raises for a cohort fails that cohort's requests (500); a
    request of another cohort and one on its own Decoder decode on, exactly."""
    model = model_for(models, "llada")
    engine = Engine(model)
    bad = config("dual", dict(unmask="threshold"))
    other = config("dual", dict(unmask="threshold"), block_length=16)   # another cohort
    own = DecodeConfig.from_dict(dict(shape=dict(gen_length=16, block_length=8), cache=dict(method="dual"),
                                      reveal=dict(unmask="threshold"), storage=dict(method="kivi", bits=4)))
    handles = {name: engine.submit(Request(PROMPTS[i], cfg, 16, request_id=name), lambda e: None)
               for i, (name, cfg) in enumerate([("bad1", bad), ("bad2", bad), ("other", other),
                                                ("own", own)])}
    end_call = StackedDecodes.end_call

    def fails_for_bad(self, call, logits):
        if self.rows[0].owner.request.request_id.startswith("bad"):
            raise RuntimeError("cohort fault on purpose")
        return end_call(self, call, logits)
    monkeypatch.setattr(StackedDecodes, "end_call", fails_for_bad)
    for _ in range(100):
        if not engine.tick():
            break
    for name in ("bad1", "bad2"):
        out = handles[name].outcome
        assert isinstance(out, Failed) and out.status == 500 and "cohort fault on purpose" in out.message
    for name, cfg, i in (("other", other, 2), ("own", own, 3)):
        assert list(handles[name].outcome.token_ids) == generate(model, [PROMPTS[i]], cfg).sequences[0][:16]
    assert engine.running == 0 and engine.kv_bytes_reserved == 0


def test_stacking_off_runs_every_request_on_its_own_decoder(models):
    model = model_for(models, "llada")
    engine = Engine(model, stacking=False)
    cfg = config("dual", dict(unmask="threshold"))
    h = engine.submit(Request(PROMPTS[0], cfg, 16), lambda e: None)
    engine.tick()
    assert not engine._stacks and engine._running[0].decoder is not None
    while engine.tick():
        pass
    assert list(h.outcome.token_ids) == generate(model, [PROMPTS[0]], cfg).sequences[0]


def test_the_budget_counts_whole_slabs_and_reuses_idle_slots(models):
    """Under a budget of three slots, three rows of a cohort run; a cancelled row's
    slot stays reserved and the next row of that cohort takes it, while a
    request of another width waits for bytes; a request whose cohort slot is
    larger than the whole budget (but whose own cache fits) runs its own Decoder."""
    model = model_for(models, "llada")
    cfg = config("dual", dict(unmask="topk"), gen_length=32)          # 32 calls: stays running
    ids = PROMPTS[0]                                                  # 24 + 32 columns: width 64
    slot = KVCache.full_nbytes(4, 1, 4, 64, 32, torch.float32)
    engine = Engine(model, max_running=8, kv_budget=3 * slot)
    handles = [engine.submit(Request(ids, cfg, 32), lambda e: None) for _ in range(4)]
    wide = engine.submit(Request(PROMPTS[6], cfg, 32), lambda e: None)   # 46 + 32: width 96
    engine.tick()
    assert engine.running == 3 and engine.queued == 2 and engine.kv_bytes_reserved == 3 * slot
    handles[1].cancel()
    engine.tick()
    assert engine.running == 3 and engine.kv_bytes_reserved == 3 * slot == engine.kv_bytes_in_use()
    assert not handles[3].done() and engine.queued == 1               # joined the idle slot
    assert not wide.done()                                            # no bytes for a new width
    for h in handles + [wide]:
        h.cancel()
    engine.tick()
    assert engine.running == 0 and engine.kv_bytes_reserved == 0
    # own cache 56 columns, its cohort's slot 64: a budget in between runs it alone
    own = KVCache.full_nbytes(4, 1, 4, len(ids) + 32, 32, torch.float32)
    engine = Engine(model, kv_budget=own)
    h = engine.submit(Request(ids, cfg, 32), lambda e: None)
    engine.tick()
    assert engine._running[0].decoder is not None and not engine._stacks
    while engine.tick():
        pass
    assert list(h.outcome.token_ids) == generate(model, [ids], cfg).sequences[0]


def test_eos_in_a_prompt_or_as_the_padding_does_not_end_a_row():
    """The EOS stop reads each row's own generated region: an EOS inside a longer
    prompt (past a shorter row's region start), or a pad id equal to EOS filling
    the columns past a row's canvas, must not stop the row."""
    import dataclasses
    model = load("tiny-llada", dtype=torch.float32)
    model.config = dataclasses.replace(model.config, pad_id=model.config.eos_id)
    eos = model.config.eos_id
    short = PROMPTS[3]                                        # 18 tokens
    long = list(PROMPTS[0])                                   # 24 tokens, an EOS at column 20
    long[20] = eos
    cfg = config("dual", dict(unmask="topk"), gen_length=16)  # widths: 34 and 40 columns, both 64
    engine = Engine(model)
    handles = [engine.submit(Request(ids, cfg, 16), lambda e: None) for ids in (short, long)]
    for _ in range(100):
        if not engine.tick():
            break
    for h, ids in zip(handles, (short, long)):
        alone = generate(model, [ids], cfg)
        assert list(h.outcome.token_ids) == alone.sequences[0]
        assert h.outcome.stats["nfe"] == alone.stats["nfe"] == 16


def test_metrics_count_stacked_rows_and_cohorts(models):
    model = model_for(models, "llada")
    engine = Engine(model)
    one = config("dual", dict(unmask="topk"))
    other = config("dual", dict(unmask="topk"), block_length=16)            # another cohort
    alone = config("dual", dict(unmask="topk")).replace(reuse=DecodeConfig.from_dict(
        dict(reuse=dict(method="kv", rho=0.5))).reuse)                      # its own Decoder
    for ids, cfg in ((PROMPTS[0], one), (PROMPTS[1], one), (PROMPTS[2], other), (PROMPTS[3], alone)):
        engine.submit(Request(ids, cfg, 16), lambda e: None)
    engine.tick()
    m = engine.metrics
    assert m.value("dllm_running_sequences") == 4
    assert m.value("dllm_stacked_sequences") == 3 and m.value("dllm_cohorts") == 2
    while engine.tick():
        pass
    assert m.value("dllm_stacked_sequences") == 0 and m.value("dllm_cohorts") == 0


@pytest.mark.parametrize("arch", list(STACKING))
def test_slab_attention_gives_each_row_its_own_launchs_bits(models, arch, monkeypatch):
    """The cohort's one attention launch per layer gives each row, call after
    call, the bits of a launch on its own planned queries over its own canvas
    columns (what its Decoder alone runs), and zeros past its queries."""
    model = model_for(models, arch)
    method, reveal = STACKING[arch][0][:2]
    cfgs = [config(method, reveal, gen_length=g) for g in (16, 32, 16)]
    stack = StackedDecodes(model, cfgs[0], width=96)
    for i, p in enumerate([PROMPTS[0], PROMPTS[6], PROMPTS[3]]):
        stack.add(i, p, cfgs[i])
    real, launches = SlabCache.attend, []

    def attend(cache, layer, q, scale, return_probs=False):
        out, probs = real(cache, layer, q, scale, return_probs)
        assert q.shape[:2] == (len(stack.rows), max(cache.queries))
        for r, (n, t) in enumerate(zip(cache.queries, cache.row_lengths)):
            own = ops.sparse_attention(q[r:r + 1, :n], cache.k[layer][r:r + 1, :, :t],
                                       cache.v[layer][r:r + 1, :, :t], cache.key_valid[r:r + 1, :t],
                                       scale)[0]
            assert torch.equal(out[r, :n], own[0]) and not out[r, n:].any(), (layer, r)
        launches.append(sorted(set(cache.queries)))
        return out, probs
    monkeypatch.setattr(SlabCache, "attend", attend)
    while True:
        for owner in stack.ready():
            stack.remove(owner)
        if not stack.rows:
            break
        call = stack.begin_call()
        stack.end_call(call, fused_step(model, [call])[0])
    assert len(launches) >= 3 * model.config.n_layers
    assert any(len(qs) > 1 for qs in launches)   # rows of unequal query counts shared a launch
