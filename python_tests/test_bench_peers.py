"""`python -m bench peers` (bench/peers.py): the parts that run without the
reference checkouts (checkpoint writer, argument checks, table), and one slow
end-to-end run at a tiny shape when DLLM_PEERS_FAST_DLLM and DLLM_PEERS_D2CACHE
name checkouts (and DLLM_PEERS_PYTHON, optionally, a Python with their
dependencies: bench/peers-requirements.txt)."""
import argparse
import csv
import json
import os
import sys

import pytest
import torch

from bench import peers
from bench.__main__ import main

def _args(**kw):
    p = argparse.ArgumentParser()
    peers.add_parser(p.add_subparsers())
    ns = p.parse_args(["peers"])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_checkpoint_loads_in_dllm_ops_with_the_shape_asked(tmp_path):
    import dllm_ops

    args = _args(d_model=128, heads=4, layers=3, mlp=160, vocab=300)
    cfg = peers.shape_config(args)
    written = peers.write_checkpoint(str(tmp_path), cfg, seed=3)
    model = dllm_ops.load(str(tmp_path), dtype=torch.bfloat16, tokenizer=False)
    c = model.config
    assert (c.arch, c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim, c.n_layers,
            c.intermediate_size, c.vocab_size) == ("llada", 128, 4, 4, 32, 3, 160, 300)
    assert (c.mask_id, c.eos_id, c.bos_id) == (299, 298, 297)
    sd, ref = model.state_dict(), written.state_dict()
    assert sd["layers.0.q.weight"].shape == (128, 128)
    assert sd["layers.2.up.weight"].shape == sd["layers.2.gate.weight"].shape == (160, 128)
    assert sd["layers.2.down.weight"].shape == (128, 160)
    assert sd["lm_head.weight"].shape == (300, 128) and sd["embed.weight"].shape == (300, 128)
    assert all(v.dtype == torch.bfloat16 for v in sd.values())
    assert all(torch.equal(sd[k], ref[k]) for k in ref)
    # LLaDA-layout names and the keys the reference modeling code reads.
    with open(tmp_path / "config.json") as f:
        hf = json.load(f)
    assert hf["model_type"] == "llada" and hf["d_model"] == 128 and hf["mlp_hidden_size"] == 160
    assert hf["attention_dropout"] == hf["residual_dropout"] == hf["embedding_dropout"] == 0.0
    assert hf["rope"] is True and hf["flash_attention"] is False and hf["include_bias"] is False
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.transformer.blocks.2.ff_proj.weight" in names
    assert "model.transformer.wte.weight" in names and "model.transformer.ff_out.weight" in names


def test_checkpoint_is_seeded(tmp_path):
    cfg = peers.shape_config(_args(d_model=32, heads=2, layers=1, mlp=48, vocab=64))
    a = peers.write_checkpoint(str(tmp_path / "a"), cfg, seed=1).state_dict()
    b = peers.write_checkpoint(str(tmp_path / "b"), cfg, seed=1).state_dict()
    c = peers.write_checkpoint(str(tmp_path / "c"), cfg, seed=2).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.q.weight"], c["layers.0.q.weight"])


def test_prompt_tokens_are_seeded_and_avoid_special_ids():
    p = peers.prompt_tokens(500, 10, {9, 8, 7}, seed=0)
    assert len(p) == 500 and set(p) <= set(range(7))
    assert p == peers.prompt_tokens(500, 10, {9, 8, 7}, seed=0) != peers.prompt_tokens(500, 10, {9, 8, 7}, seed=1)


@pytest.mark.parametrize("argv, flag, commit", [
    ([], "--fast-dllm", "24cc59e"),                                    # not given, env unset
    (["--fast-dllm", "/nonexistent/fast"], "--fast-dllm", "24cc59e"),  # no such folder
    (["--modes", "d2cache"], "--d2cache", "72feb60"),
    (["--modes", "d2cache", "--d2cache", "/nonexistent/d2"], "--d2cache", "72feb60"),
])
def test_missing_checkout_is_one_line_naming_the_flag_and_commit(argv, flag, commit, monkeypatch, capsys):
    monkeypatch.delenv("DLLM_PEERS_FAST_DLLM", raising=False)
    monkeypatch.delenv("DLLM_PEERS_D2CACHE", raising=False)
    assert main(["peers", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("python -m bench peers: error:"), err
    assert flag in err and commit in err, err


def test_folder_that_is_not_the_checkout_is_refused(tmp_path, capsys):
    (tmp_path / "llada").mkdir()
    assert main(["peers", "--fast-dllm", str(tmp_path), "--modes", "none"]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a NVlabs/Fast-dLLM checkout (no llada/generate.py)" in err and "24cc59e" in err


def _fake_checkout(root, peer):
    for f in peers.PEERS[peer]["files"]:
        path = root / f
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    return str(root)


@pytest.mark.parametrize("argv, says", [
    (["--modes", "vanilla"], "--modes 'vanilla'"),
    (["--gen-length", "64", "--block-length", "24"], "not a multiple of --block-length 24"),
    (["--rounds", "0"], "--rounds 0"),
    (["--d2cache-p", "0"], "--d2cache-p 0"),
    (["--d2cache-fixes", "all"], "--d2cache-fixes 'all'"),
    (["--peer-python", "/nonexistent/python"], "--peer-python /nonexistent/python: no such executable"),
    (["--d-model", "100", "--heads", "8"], None),   # caught when the checkpoint is shaped
])
def test_argument_checks(argv, says, tmp_path, capsys):
    fast = _fake_checkout(tmp_path / "f", "fast-dllm")
    d2 = _fake_checkout(tmp_path / "d", "d2cache")
    p = argparse.ArgumentParser()
    peers.add_parser(p.add_subparsers())
    args = p.parse_args(["peers", "--fast-dllm", fast, "--d2cache", d2, *argv])
    if says is None:
        with pytest.raises(peers.PeersError, match="not a multiple of --heads"):
            peers.shape_config(args)
        return
    with pytest.raises(peers.PeersError) as e:
        peers.check_args(args)
    assert says in str(e.value)
    assert main(["peers", "--fast-dllm", fast, "--d2cache", d2, *argv]) == 2
    assert says in capsys.readouterr().err


def test_check_args_returns_the_checkouts_the_modes_need(tmp_path):
    fast = _fake_checkout(tmp_path / "f", "fast-dllm")
    args = _args(fast_dllm=fast, d2cache=None, modes=["none", "dual"])
    assert peers.check_args(args) == {"fast-dllm": fast}
    assert os.path.isabs(args.peer_python) and os.path.isabs(args.ours_python)


ROWS = [
    dict(mode="dual", reference="Fast-dLLM generate_with_dual_cache, block 16", ref_wall_s=2.9612,
         ours_wall_s=1.48, speedup=2.9612 / 1.48, ref_nfe=68, ours_nfe=68, tokens_equal=True,
         deterministic=True, tokens_differing=0, ref_walls=[2.9612], ours_walls=[1.48],
         ref_cpu_s=5.6, ours_cpu_s=2.8, cpu_speedup=2.0),
    dict(mode="d2cache", reference="d²Cache", ref_wall_s=3.0, ours_wall_s=1.5, speedup=2.0,
         ref_nfe=64, ours_nfe=65, tokens_equal=False, deterministic=True, tokens_differing=3,
         ref_walls=[3.1, 2.9], ours_walls=[1.5, 1.5]),
    dict(mode="none", reference="Fast-dLLM generate", ref_wall_s=1.0, ours_wall_s=1.0, speedup=1.0,
         ref_nfe=64, ours_nfe=64, tokens_equal=False, deterministic=False, tokens_differing=1,
         ref_walls=[1.0], ours_walls=[1.0]),
]


def test_format_table():
    lines = peers.format_table(ROWS).splitlines()
    assert lines[0] == ("| mode | reference code | reference wall s | ours wall s | speed-up "
                        "| NFE ref / ours | tokens equal | CPU s ref / ours (speed-up) |")
    assert lines[2] == ("| dual | Fast-dLLM generate_with_dual_cache, block 16 | 2.96 | 1.48 | 2.00× | 68 / 68 "
                        "| yes | 5.60 / 2.80 (2.00×) |")
    # several rounds: the median, then every round's wall
    assert lines[3] == ("| d2cache | d²Cache | 3.00 (3.10, 2.90) | 1.50 (1.50, 1.50) | 2.00× | 64 / 65 "
                        "| no (3 differ) | - |")
    assert "| - (not deterministic) |" in lines[4]


def test_csv_and_json_rows(tmp_path):
    path = tmp_path / "rows.csv"
    peers.write_csv(str(path), ROWS)
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert [r["mode"] for r in rows] == ["dual", "d2cache", "none"]
    assert list(rows[0])[:len(peers.COLUMNS)] == peers.COLUMNS
    assert rows[1]["tokens_equal"] == "False" and float(rows[0]["speedup"]) == pytest.approx(2.0008, abs=1e-3)


def test_fixes_and_adaptations_are_listed():
    assert set(peers.D2CACHE_FIXES) == {"conf-cache", "fresh-logits", "block-mask", "stage2-paper"}
    assert all(len(v) > 40 for v in peers.D2CACHE_FIXES.values())
    assert peers.ADAPTATIONS


def test_registered_as_a_bench_subcommand(capsys):
    with pytest.raises(SystemExit):
        main(["peers", "--help"])
    out = capsys.readouterr().out
    assert "--fast-dllm" in out and "--peer-python" in out and "--d2cache-fixes" in out


@pytest.mark.slow
@pytest.mark.skipif(not (os.environ.get("DLLM_PEERS_FAST_DLLM") and os.environ.get("DLLM_PEERS_D2CACHE")),
                    reason="DLLM_PEERS_FAST_DLLM and DLLM_PEERS_D2CACHE name no checkouts")
def test_end_to_end_tiny(tmp_path, capsys):
    """Every mode at a tiny shape: both sides run, deterministic (greedy), same
    NFE; Fast-dLLM's modes give our tokens here. d²Cache's may differ: its
    stage-2 nucleus cut-off is taken on a rollout the reference accumulates in
    bf16 (ours in float64), so a near-tie can pick another token to recompute
    (docs/bench/peers.md)."""
    out = tmp_path / "peers.json"
    argv = ["peers", "--peer-python", os.environ.get("DLLM_PEERS_PYTHON", sys.executable),
            "--d-model", "64", "--heads", "4", "--layers", "2", "--mlp", "96", "--vocab", "256",
            "--prompt-length", "16", "--gen-length", "16", "--block-length", "8", "--d2cache-k", "4",
            "--checkpoint", str(tmp_path / "ckpt"), "--json", str(out), "--csv", str(tmp_path / "p.csv")]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "| mode | reference code |" in text and "bug 1" in text
    with open(out) as f:
        res = json.load(f)
    assert [r["mode"] for r in res["rows"]] == ["none", "prefix", "dual", "d2cache"]
    for r in res["rows"]:
        assert r["deterministic"], r["mode"]
        assert r["ref_nfe"] == r["ours_nfe"], (r["mode"], r["ref_nfe"], r["ours_nfe"])
        assert r["tokens_equal"] or r["mode"] == "d2cache", (r["mode"], r["tokens_differing"])
    assert set(res["meta"]["d2cache_fixes"]) == set(peers.D2CACHE_FIXES)


@pytest.mark.parametrize("fails", [False, True])
def test_the_temporary_checkpoint_is_removed_and_a_named_one_kept(monkeypatch, tmp_path, fails):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    seen = []

    def rounds(args, checkouts, cfg, ckpt_dir, repo_root, log):
        assert os.path.isdir(ckpt_dir)
        seen.append(ckpt_dir)
        if fails:
            raise RuntimeError("a child failed")
        return [], {}

    monkeypatch.setattr(peers, "_run_rounds", rounds)
    args = _args(d_model=64, heads=2, layers=1, mlp=96, vocab=128)
    for named in (None, str(tmp_path / "kept")):
        args.checkpoint = named
        if named:
            os.makedirs(named)
        try:
            peers.run_peers(args, {})
        except RuntimeError:
            assert fails
        assert os.path.isdir(seen[-1]) == bool(named)
    assert os.listdir(tmp_path / "tmp") == []
