"""dLLM-KVQ policy selection: the gates, the bit cap, the metrics, and the
calibrate CLI end to end (resume, refusal of a foreign or corrupt trace file,
a table that decoding accepts)."""
import json

import pytest

pytest.importorskip("scipy")
pytest.importorskip("safetensors")
import torch

import dllm_ops
from dllm_ops.calibrate.__main__ import main as calibrate_main
from dllm_ops.calibrate.select import (BASELINE, CANDIDATES, K_BITS_CAP, MIN_RECORDS, _metrics, choose,
                                       policy_k_bits)
from dllm_ops.models import load
from dllm_ops.quant.policy_table import LayerPolicy, PolicyTable
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


def test_metrics_of_identical_runs_are_perfect():
    torch.manual_seed(0)
    z = torch.randn(3, 10)
    p = torch.softmax(torch.randn(4, 12), -1)
    m = _metrics(z, z, p, p)
    assert m["score_dist"] == 0 and abs(m["attn_kl"]) < 1e-9 and m["top1"] == 1 and m["topk"] == 1
    z2 = z + 5.0  # a constant shift of the logits is not a change of scores
    assert _metrics(z2, z, p, p)["score_dist"] < 1e-5


@pytest.mark.slow
def test_calibrate_cli_end_to_end(tmp_path):
    ckpt = tmp_path / "tiny"
    make_checkpoint(str(ckpt), "llada", seed=7)
    out = tmp_path / "policy.json"
    args = ["--model", str(ckpt), "--cache", "dual", "--bits", "4", "--out", str(out), "--n", "2",
            "--steps-per-block", "2", "--rounds", "2"]
    assert calibrate_main(args) == 0
    table = PolicyTable.load(str(out))
    assert table.cache == "dual" and table.bits == 4 and len(table.layers) == 2
    assert all(policy_k_bits(4, l.p) <= K_BITS_CAP[4] for l in table.layers)
    trace = json.loads((tmp_path / "policy.json.trace.json").read_text())
    assert len(trace["samples"]) == 2
    # a rerun resumes from the trace file and gives the same table
    first = out.read_text()
    assert calibrate_main(args) == 0
    assert out.read_text() == first
    # decoding accepts it
    model = load(str(ckpt), dtype=torch.float32)
    dllm_ops.generate(model, [5, 9, 11], gen_length=16, block_length=8, unmask="threshold",
                      cache="dual", kv_quant=dict(bits=4, method="kvq", policy=str(out)))
    # a trace made with other settings is refused, not mixed
    with pytest.raises(SystemExit, match="other settings.*seed"):
        calibrate_main(args + ["--seed", "1"])
    (tmp_path / "policy.json.trace.json").write_text('{"format": "dllm-trace/1", "samp')
    with pytest.raises(ValueError, match="not valid JSON"):
        calibrate_main(args)
    assert out.read_text() == first   # the table was not touched


def test_fingerprint_is_the_same_in_fp32_and_bf16(tmp_path):
    from dllm_ops.quant.policy_table import model_fingerprint
    make_checkpoint(str(tmp_path), "dream", seed=2)
    a = model_fingerprint(load(str(tmp_path), dtype=torch.float32))
    b = model_fingerprint(load(str(tmp_path), dtype=torch.bfloat16))
    assert a == b
    make_checkpoint(str(tmp_path), "dream", seed=3)
    assert model_fingerprint(load(str(tmp_path), dtype=torch.float32)) != a


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
