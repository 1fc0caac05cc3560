"""dLLM-KVQ policy selection: the gates, the bit cap, the metrics and gains on
hand-computed cases, the records of a tiny model against float64 forwards over
the reference QDQ cache (on every device), and the calibrate CLI end to end
(resume, refusal of a foreign or corrupt trace file, a table that decoding
accepts)."""
import math
import json
import re

import pytest

pytest.importorskip("scipy")
pytest.importorskip("safetensors")
import torch

import dllm_ops
from dllm_ops.calibrate.__main__ import main as calibrate_main
from dllm_ops.calibrate.select import (BASELINE, CANDIDATES, K_BITS_CAP, MIN_RECORDS, _gain, _metrics,
                                       block_cases, choose, collect, policy_k_bits)
from dllm_ops.calibrate.trace import Schedule
from dllm_ops.models import load
from dllm_ops.quant.policy_table import LayerPolicy, PolicyTable
from ref_kvq import forward, quantize_reused
from ref_model import load_original
from tiny_ckpt import make_checkpoint


def test_effective_k_bits_and_caps():
    assert policy_k_bits(4, 0) == 4.0
    assert policy_k_bits(4, 2) == 4.75 <= K_BITS_CAP[4] < policy_k_bits(4, 4)
    assert policy_k_bits(2, 2) == 2.875 <= K_BITS_CAP[2] < policy_k_bits(2, 4)


def _records(n_layers, spec):
    """spec: {(layer, LayerPolicy): (gains, score_dist_gains)}; others negative."""
    rec = {(l, a): [(-1.0, -1.0)] * MIN_RECORDS for l in range(n_layers) for a in CANDIDATES}
    for key, (g, d) in spec.items():
        rec[key] = list(zip(g, d))
    return rec


def test_choose_applies_gain_win_rate_records_and_cap():
    n = MIN_RECORDS
    att2, att4, q1, prod1 = (LayerPolicy("attention", 2), LayerPolicy("attention", 4),
                             LayerPolicy("qerror", 1), LayerPolicy("product", 1))
    rec = _records(4, {
        (0, att4): ([9.0] * n, [1.0] * n),                      # best gain, over the 4-bit cap
        (0, att2): ([0.5] * n, [1.0] * (n // 2) + [-1.0] * (n - n // 2)),  # win rate exactly 0.5
        (0, q1): ([0.6] * n, [-1.0] * n),                       # win rate 0: gated out
        (1, prod1): ([2.0] * (n - 1), [1.0] * (n - 1)),         # too few records
        (2, q1): ([0.02] * n, [1.0] * n),                       # beats att2 only after the bit penalty
        (2, att2): ([0.025] * n, [1.0] * n),
    })
    layers, report = choose(rec, 4, bits=4)
    assert layers[0] == att2
    assert layers[1] == BASELINE and layers[3] == BASELINE
    assert layers[2] == q1   # 0.025 - 0.02*0.75 = 0.010 < 0.02 - 0.02*0.375 = 0.0125
    assert {(r["layer"], r["score"], r["p"]) for r in report if r["eligible"]} == \
        {(0, "attention", 2), (2, "qerror", 1), (2, "attention", 2)}
    # at 2 bits the same records: p = 4 (3.75 bits) is over the 2.9 cap as well
    assert choose(rec, 4, bits=2)[0][0] == att2


def test_metrics_of_a_hand_computed_case():
    """Two positions' logits, two queries' attention over 10 keys (top-8 recall
    needs more than 8 keys), every metric worked out by hand."""
    z = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    z_ref = torch.tensor([[1.0, 2.0, 5.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    # row 0 centered: [-1, 0, 1] against [-5/3, -2/3, 7/3], distance |[2/3, 2/3, -4/3]| = sqrt(24)/3;
    # row 1 identical: the mean over positions is sqrt(24)/6
    desc = torch.arange(10, 0, -1, dtype=torch.float64)          # 10, 9, ..., 1
    p_ref = torch.stack([desc, desc.flip(0)]) / 55
    # query 0: keys 6, 7 (ref weights 4, 3) swapped with keys 8, 9 (2, 1): top-8 keeps
    # 6 of the reference's 8, the top key agrees; query 1: the two largest swapped,
    # same top-8 set, the top key differs
    p = torch.stack([torch.tensor([10, 9, 8, 7, 6, 5, 2, 1, 4, 3.0], dtype=torch.float64),
                     torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 10, 9.0], dtype=torch.float64)]) / 55
    m = _metrics(z, z_ref, p, p_ref)
    assert m["score_dist"] == pytest.approx(math.sqrt(24) / 6, rel=1e-12)
    # KL row 0: (4 ln 2 + 3 ln 3 + 2 ln 1/2 + ln 1/3) / 55 = 2 ln 6 / 55; row 1: ln(10/9) / 55
    assert m["attn_kl"] == pytest.approx((2 * math.log(6) + math.log(10 / 9)) / 110, rel=1e-9)
    assert m["top1"] == 0.5
    assert m["topk"] == (6 / 8 + 8 / 8) / 2
    # a constant shift of the logits is not a change of scores
    assert _metrics(z_ref + 5.0, z_ref, p, p)["score_dist"] == pytest.approx(0.0, abs=1e-12)


def test_gain_is_the_improvement_over_the_baseline_and_selects_p_above_zero():
    """Records made by _gain from metrics, MIN_RECORDS of them: a candidate that
    improves on the baseline in every metric is chosen (p = 2) over one that is
    worse, and a layer whose candidates are all worse keeps p = 0."""
    base = dict(score_dist=1.5, attn_kl=1.0, top1=0.5, topk=0.5)
    better = dict(score_dist=1.0, attn_kl=0.5, top1=0.75, topk=0.5)
    worse = dict(score_dist=2.0, attn_kl=1.5, top1=0.25, topk=0.25)
    # 1.0 * 0.5 + 0.001 * 0.5 + 0.10 * 0.25 + 0.05 * 0 and the score-distance gain 0.5
    assert _gain(better, base) == pytest.approx((0.5255, 0.5), rel=1e-12)
    assert _gain(worse, base) == pytest.approx((-0.5 - 0.0005 - 0.025 - 0.0125, -0.5), rel=1e-12)
    att2 = LayerPolicy("attention", 2)
    rec = {(l, a): [_gain(worse, base)] * MIN_RECORDS for l in range(2) for a in CANDIDATES}
    rec[(0, att2)] = [_gain(better, base)] * MIN_RECORDS
    layers, report = choose(rec, 2, bits=4)
    assert layers == [att2, BASELINE]
    assert [(r["layer"], r["score"], r["p"]) for r in report if r["eligible"]] == [(0, "attention", 2)]


@pytest.mark.slow
def test_calibrate_cli_end_to_end(tmp_path, capsys):
    ckpt = tmp_path / "tiny"
    make_checkpoint(str(ckpt), "llada", seed=7)
    out = tmp_path / "policy.json"
    args = ["--model", str(ckpt), "--cache", "dual", "--bits", "4", "--out", str(out), "--n", "2",
            "--steps-per-block", "2", "--rounds", "2"]
    assert calibrate_main(args) == 0
    table = PolicyTable.load(str(out))
    assert table.cache == "dual" and table.bits == 4 and len(table.layers) == 2
    trace = json.loads((tmp_path / "policy.json.trace.json").read_text())
    assert len(trace["samples"]) == 2
    # 2 samples with 2 steps per block give one record per block, fewer than
    # MIN_RECORDS: no candidate is eligible and every layer keeps p = 0
    # (test_gain_is_the_improvement_over_the_baseline_and_selects_p_above_zero
    # and test_collect_records_are_score_gains_over_the_qdq_baseline cover p > 0)
    n_blocks = sum(len(s["answer"]) // 16 for s in trace["samples"])
    assert n_blocks < MIN_RECORDS
    assert {r["records"] for r in table.meta["candidates"]} == {n_blocks}
    assert table.layers == [BASELINE, BASELINE]
    # a rerun resumes from the trace file and gives the same table
    first = out.read_text()
    assert calibrate_main(args) == 0
    assert out.read_text() == first
    # decoding accepts it
    model = load(str(ckpt), dtype=torch.float32)
    dllm_ops.generate(model, [5, 9, 11], gen_length=16, block_length=8, unmask="threshold",
                      cache="dual", kv_quant=dict(bits=4, method="kvq", policy=str(out)))
    # a trace made with other settings is refused, not mixed
    # (one-line errors, exit status 1: dllm_ops/calibrate/__main__.py)
    capsys.readouterr()
    assert calibrate_main(args + ["--seed", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dllm_ops.calibrate: error: ") and err.count("\n") == 1
    assert re.search("other settings.*seed", err)
    (tmp_path / "policy.json.trace.json").write_text('{"format": "dllm-trace/1", "samp')
    assert calibrate_main(args) == 1
    assert "not valid JSON" in capsys.readouterr().err
    assert out.read_text() == first   # the table was not touched


@pytest.fixture(scope="module")
def llada(model_device, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("select_llada"))
    make_checkpoint(path, "llada", seed=7)
    return load(path, dtype=torch.float32, device=model_device), load_original(path)


def test_collect_records_are_score_gains_over_the_qdq_baseline(llada):
    """collect() on a tiny model: 2 trajectories x 2 blocks x 2 later steps give
    each (layer, candidate) exactly MIN_RECORDS records, and each record's
    score-distance gain equals the one from float64 forwards over the reference
    QDQ cache (ref_kvq.quantize_reused: the baseline at p = 0 in every layer,
    the candidate in one layer)."""
    model, original = llada
    c = model.config
    sched = Schedule(16, 8, 3)
    pairs = [([5, 9, 11, 30, 7, 8], [12, 40, 41, 6, 9, 10, 22, 50, 51, 17, 5, 33, 2, 2, 2, 2]),
             ([12, 40, 41, 6, 9, 10, 22], [7, 8, 30, 11, 9, 5, 44, 45, 13, 2, 2, 2, 2, 2, 2, 2])]
    trajectories = [dict(prompt=p, answer=a, assignment=sched.initial()) for p, a in pairs]
    records = collect(model, trajectories, "dual", 2, 8, 3, group=8)
    assert {len(r) for r in records.values()} == {MIN_RECORDS}

    def centered_distance(z, z_ref, rows):
        zc, zr = z[rows] - z[rows].mean(-1, keepdim=True), z_ref[rows] - z_ref[rows].mean(-1, keepdim=True)
        return float((zc - zr).norm(dim=-1).mean())

    layer, cand = 1, LayerPolicy("attention", 2)
    plain = [("qerror", 0)] * c.n_layers
    with_cand = list(plain)
    with_cand[layer] = (cand.score, cand.p)
    want = []
    for tr in trajectories:
        for x0, xts, bs, be in block_cases(tr, c.mask_id, 8, 3, False):
            T = x0.shape[0]
            _, kv, probs = forward(original, x0)
            base_kv = quantize_reused(kv, probs, bs, be, T, "dual", 2, 8, plain, torch.float32)
            cand_kv = quantize_reused(kv, probs, bs, be, T, "dual", 2, 8, with_cand, torch.float32)
            run = torch.zeros(T, dtype=torch.bool)
            run[bs:be] = True
            for xt in xts:
                ref = forward(original, xt)[0][bs:be]
                base = forward(original, xt, run=run, kv=base_kv)[0][bs:be]
                got = forward(original, xt, run=run, kv=cand_kv)[0][bs:be]
                masked = xt[bs:be] == c.mask_id
                want.append(centered_distance(base, ref, masked) - centered_distance(got, ref, masked))
    assert [d for _, d in records[(layer, cand)]] == pytest.approx(want, abs=1e-4)


def test_fingerprint_is_the_same_in_fp32_and_bf16_and_on_every_device(tmp_path, model_device):
    from dllm_ops.quant.policy_table import model_fingerprint
    make_checkpoint(str(tmp_path), "dream", seed=2)
    a = model_fingerprint(load(str(tmp_path), dtype=torch.float32))
    b = model_fingerprint(load(str(tmp_path), dtype=torch.bfloat16, device=model_device))
    assert a == b
    make_checkpoint(str(tmp_path), "dream", seed=3)
    assert model_fingerprint(load(str(tmp_path), dtype=torch.float32, device=model_device)) != a


@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
def test_shipped_tables_fit_the_shipped_models(name):
    """A retrained checkpoint needs new tables: regenerate them with
    `python -m dllm_ops.calibrate --model NAME --cache C --bits B --out
    dllm_ops/checkpoints/NAME/kvq/C-Bbit.json` (README, "dLLM-KVQ")."""
    import os
    path = os.path.join(os.path.dirname(dllm_ops.__file__), "checkpoints", name)
    model = load(path, dtype=torch.bfloat16)
    for cache in ("prefix", "dual"):
        for bits in (4, 2):
            table = PolicyTable.load(os.path.join(path, "kvq", f"{cache}-{bits}bit.json"))
            table.check(model, cache, bits, 32)
            assert all(policy_k_bits(bits, l.p) <= K_BITS_CAP[bits] for l in table.layers)
    # the TRACE trajectories they were selected on: legal assignments of this model's calib pairs
    from dllm_ops.calibrate.trace import Schedule, load_artifact
    from dllm_ops.quant.policy_table import model_fingerprint
    art = load_artifact(os.path.join(path, "kvq", "trace-calib.json"))
    assert art["fingerprint"] == model_fingerprint(model) and art["split"] == "calib"
    for s in art["samples"]:
        sched = Schedule(len(s["answer"]), art["block_length"], art["steps_per_block"],
                         first_at_block_start=art["first_at_block_start"])
        assert sched.legal(s["assignment"])
