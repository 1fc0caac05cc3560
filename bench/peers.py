"""`python -m bench peers`: the reference decode loops and ours, side by side.

  python -m bench peers --fast-dllm PATH --d2cache PATH [--peer-python PY] [--rounds N]
                        [--modes none prefix dual d2cache] [--json FILE] [--csv FILE]

Given local checkouts of the reference code (fetched by the user: NVlabs/Fast-dLLM
at 24cc59e, Kamichanw/d2Cache at 72feb60; ``--fast-dllm`` / ``--d2cache``, or the
environment's DLLM_PEERS_FAST_DLLM / DLLM_PEERS_D2CACHE) and a Python that has
their dependencies (``--peer-python``, default this one; bench/peers-requirements.txt
lists what their imports need), it

1. writes a random, seeded checkpoint in the LLaDA layout (default d_model 1024,
   8 heads, 4 layers, MLP 2816, vocab 32000, bf16) that both the reference
   modeling code and ``dllm_ops.load`` read;
2. per mode, runs the reference loop and ours alternately, each in a process of
   its own (the reference with ``--peer-python``, ours with this Python), on
   the same prompt tokens, on the CPU with a fixed thread count, same settings:
   ``none`` = Fast-dLLM ``generate``, ``prefix`` = ``generate_with_prefix_cache``,
   ``dual`` = ``generate_with_dual_cache`` (blocks of ``--block-length``, 16),
   ``d2cache`` = d²Cache's ``vanilla_generate`` with its ``d2Cache`` as one block
   of the generated length (k 32, p 0.1, σ 10), all with threshold 0.9;
3. prints mode | reference wall s | ours wall s | speed-up | NFE of each side |
   tokens equal (``--json`` / ``--csv`` write the rows).

Each child process loads the model, decodes once untimed (``--warmup full``,
the default: it also checks that the decode is deterministic in the process),
then times one decode. Rounds alternate which side runs first; the table shows
each side's median wall over rounds.

The reference code runs unmodified from the checkout. d²Cache's documented bugs
(shared/reference/d2cache.md; docs/bench/peers.md) are fixed at run time in its
child process by wrapping functions (``D2CACHE_FIXES``, listed in the output);
no file of the checkout is edited.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# What the benchmark was written against (the user fetches these).
PEERS = {
    "fast-dllm": dict(repo="NVlabs/Fast-dLLM", commit="24cc59e", flag="--fast-dllm",
                      env="DLLM_PEERS_FAST_DLLM",
                      files=("llada/generate.py", "llada/model/modeling_llada.py")),
    "d2cache": dict(repo="Kamichanw/d2Cache", commit="72feb60", flag="--d2cache",
                    env="DLLM_PEERS_D2CACHE",
                    files=("src/generation/vanilla.py", "src/cache/d2cache.py",
                           "src/models/llada/modeling_llada.py")),
}
MODES = ("none", "prefix", "dual", "d2cache")
MODE_PEER = {"none": "fast-dllm", "prefix": "fast-dllm", "dual": "fast-dllm", "d2cache": "d2cache"}
FAST_DLLM_FN = {"none": "generate", "prefix": "generate_with_prefix_cache",
                "dual": "generate_with_dual_cache"}

# d²Cache's bugs (shared/reference/d2cache.md), each fixed in the reference's
# child process by wrapping a function; the key is what `--d2cache-fixes` names.
D2CACHE_FIXES = {
    "conf-cache": "bug 1 (src/cache/d2cache.py on_step_end): the confidence-cache update "
                  "`x[m][v] = c` with `a & b == c` is a no-op, so stage 1 ranks by the first "
                  "call's confidence; fixed: before each on_step_end, the fresh confidence of "
                  "every masked token the call recomputed is written into _conf_cache",
    "fresh-logits": "bug 2 (src/generation/vanilla.py generate_step): "
                    "`transfer_index_mask[idx].logical_and_(valid)` edits a copy, so masked tokens "
                    "the call did not recompute (zero logits, confidence ~1/V) stay candidates; "
                    "fixed: vanilla's confidence_unmasking (the reveal) is wrapped to AND its "
                    "transfer_index_mask with the call's recomputed rows, as that line intends",
    "block-mask": "bug 3 (src/generation/utils.py check_can_generate): `eligible_mask &= ...` "
                  "mutates the caller's block_mask, so on_step_end's stage-1 window is built from "
                  "the count of masks left, not the block; fixed: vanilla's check_can_generate "
                  "gets a copy of the mask",
    "stage2-paper": "not a bug, the paper's text (and dllm_ops): stage 2's attention-rollout "
                    "nucleus picks among prompt and decoded tokens only (the code also lets "
                    "masked tokens in); applied by wrapping src/cache/d2cache.py's nucleus_select "
                    "so that the tokens still masked after the call are excluded",
}
# Diagnostics, off unless named in --d2cache-fixes: not fixes, changes of the
# reference's numerics that show where a token difference comes from.
D2CACHE_DIAGNOSTICS = {
    "rollout-fp32": "diagnostic, not a fix: d2Cache.accumulate_attn_rollout runs in float32 "
                    "(the reference accumulates the T x T rollout product in the model dtype, bf16; "
                    "dllm_ops in float64), to see whether a token difference starts at a stage-2 "
                    "nucleus cut-off",
}
# Run-time adaptations that are no bug fixes (the reference code would run as
# is on a GPU machine; these make it run here, the same way on both sides).
ADAPTATIONS = [
    "both references: the checkout's own modules are imported from the checkout (sys.path), "
    "the model class built from the checkout's modeling code with from_pretrained on the "
    "written folder (no trust_remote_code, no hub), moved to the CPU (model.device is then "
    "the CPU: Fast-dLLM's loops and d²Cache's vanilla_generate put their tensors on "
    "model.device, so nothing hard-codes .cuda() on these paths)",
    "d²Cache: attn_implementation='eager' (its cache asserts on attention weights), "
    "MASK_TOKEN_ID set in the environment (its Frame.apply_delta reads it), no attention "
    "mask (one unpadded prompt; pad_token_id=None), d2Cache(inflate_w=0) as its gen_args.py "
    "sets with cache=d2cache",
    "d²Cache: src/generation/utils.py's get_token_freq (a token-frequency table used only by "
    "the PC sampler's debias, off here) returns None below LLaDA's vocab of 126464: it "
    "scatters real LLaDA ids into a vocab-sized tensor and fails on a smaller vocab",
    "NFE of d²Cache is counted by a forward pre-hook on the model (vanilla_generate returns "
    "no count); Fast-dLLM's loops return theirs",
]


class PeersError(ValueError):
    """A bad argument of `bench peers` (one line)."""


# --------------------------------------------------------------------------
# checkpoint


def shape_config(args) -> dict:
    """``dllm_ops.models.ModelConfig`` fields of the random LLaDA-layout checkpoint."""
    d, h, v = args.d_model, args.heads, args.vocab
    if d % h:
        raise PeersError(f"--d-model {d} is not a multiple of --heads {h}")
    if v < 8:
        raise PeersError(f"--vocab {v}: need at least 8 ids (mask, EOS, BOS at the top)")
    return dict(arch="llada", vocab_size=v, hidden_size=d, n_layers=args.layers, n_heads=h,
                n_kv_heads=h, head_dim=d // h, intermediate_size=args.mlp, rms_eps=1e-5,
                rope_theta=500000.0, max_seq_len=max(4096, args.prompt_length + args.gen_length),
                qkv_bias=False, mask_id=v - 1, eos_id=v - 2, pad_id=v - 2, bos_id=v - 3)


# config.json keys the reference LLaDA modeling code reads with defaults that
# are not LLaDA's (OLMo's: dropouts 0.1, rope off, ...): written explicitly.
REFERENCE_CONFIG_KEYS = dict(
    attention_dropout=0.0, residual_dropout=0.0, embedding_dropout=0.0, flash_attention=False,
    alibi=False, rope_full_precision=True, attention_layer_norm=False, input_emb_norm=False,
    layer_norm_with_affine=True, bias_for_layer_norm=False, scale_logits=False,
    multi_query_attention=None, init_device="cpu", torch_dtype="bfloat16", use_cache=False,
)


def write_checkpoint(path: str, config_fields: dict, seed: int = 0, dtype: str = "bf16"):
    """A random, seeded checkpoint of ``config_fields`` in the LLaDA layout (config.json +
    model.safetensors, as ``dllm_ops.models.save`` writes it) with the keys the reference
    LLaDA modeling code also needs; returns the model written."""
    import torch

    from bench.decode import random_model
    from dllm_ops.models import ModelConfig, save

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    model = random_model(ModelConfig(**config_fields), dt, seed)
    save(model.eval(), path)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(REFERENCE_CONFIG_KEYS)
    cfg["torch_dtype"] = {"bf16": "bfloat16", "fp32": "float32"}[dtype]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return model


def prompt_tokens(n: int, vocab: int, special: set[int], seed: int) -> list[int]:
    """``n`` seeded random ids below ``vocab``, none of them special."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        t = rng.randrange(vocab)
        if t not in special:
            out.append(t)
    return out


# --------------------------------------------------------------------------
# argument checks


def checkout_path(args, peer: str, modes=()) -> str:
    """The checkout of ``peer`` the arguments name, checked (PeersError: one line naming
    the flag and the commit to fetch)."""
    info = PEERS[peer]
    path = getattr(args, peer.replace("-", "_")) or os.environ.get(info["env"])
    fetch = f"fetch {info['repo']} at commit {info['commit']} and pass its folder"
    if not path:
        raise PeersError(f"{info['flag']} is required for mode(s) {' '.join(modes) or '?'} "
                         f"({info['env']} unset): {fetch}")
    if not os.path.isdir(path):
        raise PeersError(f"{info['flag']} {path}: no such folder; {fetch}")
    missing = [f for f in info["files"] if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise PeersError(f"{info['flag']} {path}: not a {info['repo']} checkout (no {missing[0]}); {fetch}")
    return os.path.abspath(path)


def checkout_commit(path: str) -> str | None:
    """HEAD of a git checkout, or None (an archive extract)."""
    try:
        r = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True,
                           timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() or None if r.returncode == 0 else None


def python_path(python: str, flag: str) -> str:
    """``python`` as an absolute path (symlinks kept: a venv's python is one), checked."""
    import shutil

    found = shutil.which(python) if os.sep not in python else (python if os.access(python, os.X_OK) else None)
    if not found:
        raise PeersError(f"{flag} {python}: no such executable")
    return os.path.abspath(found)


def check_args(args) -> dict[str, str]:
    """Validate the arguments; returns {peer: checkout path} for the peers the modes need."""
    for m in args.modes:
        if m not in MODES:
            raise PeersError(f"--modes {m!r}: choose from {', '.join(MODES)}")
    for name in ("prompt_length", "gen_length", "block_length", "threads", "rounds", "layers",
                 "d2cache_k"):
        if getattr(args, name) < 1:
            raise PeersError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.gen_length % args.block_length:
        raise PeersError(f"--gen-length {args.gen_length} is not a multiple of --block-length "
                         f"{args.block_length} (Fast-dLLM asserts it)")
    if not 0 < args.d2cache_p <= 1:
        raise PeersError(f"--d2cache-p {args.d2cache_p}: must be in (0, 1]")
    bad = [f for f in args.d2cache_fixes if f not in D2CACHE_FIXES and f not in D2CACHE_DIAGNOSTICS]
    if bad:
        raise PeersError(f"--d2cache-fixes {bad[0]!r}: choose from "
                         f"{', '.join([*D2CACHE_FIXES, *D2CACHE_DIAGNOSTICS])} (or none)")
    for flag in ("peer_python", "ours_python"):
        setattr(args, flag, python_path(getattr(args, flag), "--" + flag.replace("_", "-")))
    need = [p for p in PEERS if any(MODE_PEER[m] == p for m in args.modes)]
    return {p: checkout_path(args, p, [m for m in args.modes if MODE_PEER[m] == p]) for p in need}


# --------------------------------------------------------------------------
# table


COLUMNS = ["mode", "reference", "ref_wall_s", "ours_wall_s", "speedup", "ref_nfe", "ours_nfe",
           "tokens_equal", "deterministic", "ref_cpu_s", "ours_cpu_s", "cpu_speedup"]


def format_table(rows: list[dict]) -> str:
    """The markdown table: mode | reference wall s | ours wall s | speed-up | NFE
    reference / ours | tokens equal (``-`` where a side is not deterministic)."""
    out = ["| mode | reference code | reference wall s | ours wall s | speed-up | NFE ref / ours "
           "| tokens equal | CPU s ref / ours (speed-up) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["deterministic"]:
            eq = "yes" if r["tokens_equal"] else f"no ({r.get('tokens_differing', '?')} differ)"
        else:
            eq = "- (not deterministic)"
        out.append(f"| {r['mode']} | {r['reference']} | {_walls(r, 'ref')} | {_walls(r, 'ours')} "
                   f"| {r['speedup']:.2f}× | {r['ref_nfe']} / {r['ours_nfe']} | {eq} | {_cpu(r)} |")
    return "\n".join(out)


def _cpu(r: dict) -> str:
    if r.get("ref_cpu_s") is None or r.get("ours_cpu_s") is None:
        return "-"
    return f"{r['ref_cpu_s']:.2f} / {r['ours_cpu_s']:.2f} ({r['cpu_speedup']:.2f}×)"


def _walls(r: dict, side: str) -> str:
    med = f"{r[f'{side}_wall_s']:.2f}"
    runs = r.get(f"{side}_walls") or []
    return med if len(runs) < 2 else f"{med} ({', '.join(f'{w:.2f}' for w in runs)})"


def write_csv(path: str, rows: list[dict]) -> None:
    keys = COLUMNS + [k for k in rows[0] if k not in COLUMNS and not isinstance(rows[0][k], (list, dict))]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


# --------------------------------------------------------------------------
# parent: one child process per side, mode and round


def reference_label(mode: str, args) -> str:
    if mode == "d2cache":
        return (f"d²Cache vanilla_generate + d2Cache, one block of {args.gen_length}, k {args.d2cache_k}, "
                f"p {args.d2cache_p:g}, σ {args.d2cache_sigma:g}")
    return f"Fast-dLLM {FAST_DLLM_FN[mode]}, block {args.block_length}"


def child_spec(args, side: str, mode: str, ckpt: str, prompt: list[int], cfg: dict,
               checkouts: dict) -> dict:
    peer = MODE_PEER[mode]
    return dict(side=side, mode=mode, checkpoint=ckpt, prompt=prompt, gen_length=args.gen_length,
                block_length=args.gen_length if mode == "d2cache" else args.block_length,
                threshold=args.threshold, threads=args.threads, warmup=args.warmup,
                mask_id=cfg["mask_id"], d2cache=dict(k=args.d2cache_k, p=args.d2cache_p,
                                                     sigma=args.d2cache_sigma,
                                                     decode_sigma=args.d2cache_decode_sigma,
                                                     fixes=list(args.d2cache_fixes)),
                checkout=checkouts.get(peer) if side == "ref" else None, peer=peer)


def run_child(python: str, spec: dict, timeout: float, repo_root: str) -> dict:
    """Run ``spec`` in a fresh ``python`` process (this file as a script); its result."""
    with tempfile.TemporaryDirectory(prefix="dllm-peers-") as tmp:
        spec = dict(spec, out=os.path.join(tmp, "result.json"))
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = dict(os.environ)
        n = str(spec["threads"])
        env.update(OMP_NUM_THREADS=n, MKL_NUM_THREADS=n, TOKENIZERS_PARALLELISM="false",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
        if spec["side"] == "ours":
            env["PYTHONPATH"] = repo_root + os.pathsep + env.get("PYTHONPATH", "")
        else:
            env.pop("PYTHONPATH", None)
        cmd = [python, os.path.abspath(__file__), "--child", spec_path]
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                               cwd=spec["checkout"] or repo_root)
        except subprocess.TimeoutExpired:
            raise PeersError(f"{spec['side']} {spec['mode']}: the child ran past --timeout {timeout:g} s") from None
        if r.returncode != 0 or not os.path.exists(spec["out"]):
            tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-6:])
            raise PeersError(f"{spec['side']} {spec['mode']} ({python}) failed with exit {r.returncode}: {tail}")
        with open(spec["out"]) as f:
            return json.load(f)


def run_peers(args, checkouts: dict, log=print) -> tuple[list[dict], dict]:
    """Write the checkpoint, run every mode's two sides for ``args.rounds`` rounds;
    (rows, run metadata)."""
    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = shape_config(args)
    ckpt_dir = args.checkpoint or tempfile.mkdtemp(prefix="dllm-peers-ckpt-")
    try:
        return _run_rounds(args, checkouts, cfg, ckpt_dir, repo_root, log)
    finally:
        if not args.checkpoint:    # ours, in the temp dir (~200 MB at the default shape)
            shutil.rmtree(ckpt_dir, ignore_errors=True)


def _run_rounds(args, checkouts: dict, cfg: dict, ckpt_dir: str, repo_root: str, log):
    t0 = time.perf_counter()
    write_checkpoint(ckpt_dir, cfg, seed=args.seed)
    log(f"checkpoint: {ckpt_dir} (LLaDA layout, d {args.d_model}, {args.heads} heads, "
        f"{args.layers} layers, MLP {args.mlp}, vocab {args.vocab}, bf16, seed {args.seed}; "
        f"{time.perf_counter() - t0:.1f}s)")
    special = {cfg["mask_id"], cfg["eos_id"], cfg["pad_id"], cfg["bos_id"]}
    prompt = prompt_tokens(args.prompt_length, args.vocab, special, args.seed)
    results = {m: {"ref": [], "ours": []} for m in args.modes}
    pythons = {"ref": args.peer_python, "ours": args.ours_python}
    for rnd in range(args.rounds):
        for mode in args.modes:
            order = ("ref", "ours") if rnd % 2 == 0 else ("ours", "ref")
            for side in order:
                spec = child_spec(args, side, mode, ckpt_dir, prompt, cfg, checkouts)
                res = run_child(pythons[side], spec, args.timeout, repo_root)
                results[mode][side].append(res)
                log(f"  round {rnd + 1}/{args.rounds} {mode:<8} {side:<4} wall={res['wall_s']:7.2f}s "
                    f"NFE={res['nfe']}", flush=True)
    rows = [summarize(mode, results[mode], args) for mode in args.modes]
    meta = dict(checkpoint=args.checkpoint or "(temporary, removed)",
                prompt_length=args.prompt_length, gen_length=args.gen_length,
                block_length=args.block_length, threshold=args.threshold, threads=args.threads,
                rounds=args.rounds, seed=args.seed, warmup=args.warmup,
                shape=dict(d_model=args.d_model, heads=args.heads, layers=args.layers, mlp=args.mlp,
                           vocab=args.vocab, dtype="bf16"),
                peer_python=args.peer_python, ours_python=args.ours_python,
                checkouts={p: dict(path=c, commit=checkout_commit(c), expected=PEERS[p]["commit"])
                           for p, c in checkouts.items()},
                d2cache_fixes={k: {**D2CACHE_FIXES, **D2CACHE_DIAGNOSTICS}[k] for k in args.d2cache_fixes}
                if "d2cache" in args.modes else {},
                adaptations=ADAPTATIONS,
                versions={side: results[args.modes[0]][side][0].get("versions") for side in ("ref", "ours")})
    return rows, meta


def summarize(mode: str, res: dict, args) -> dict:
    ref, ours = res["ref"], res["ours"]
    rw = statistics.median(r["wall_s"] for r in ref)
    ow = statistics.median(r["wall_s"] for r in ours)
    # Deterministic: every decode of a side (warm-up and timed, every round) gave the same tokens.
    det = all(_same_tokens(side) for side in (ref, ours))
    a, b = ref[0]["tokens"], ours[0]["tokens"]
    differ = sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))
    cpu = {s: statistics.median(r.get("cpu_s", float("nan")) for r in runs) for s, runs in res.items()}
    return dict(mode=mode, reference=reference_label(mode, args), ref_wall_s=rw, ours_wall_s=ow,
                speedup=rw / ow, ref_cpu_s=cpu["ref"], ours_cpu_s=cpu["ours"],
                cpu_speedup=cpu["ref"] / cpu["ours"], ref_nfe=ref[0]["nfe"], ours_nfe=ours[0]["nfe"],
                tokens_equal=differ == 0, deterministic=det, tokens_differing=differ,
                ref_walls=[r["wall_s"] for r in ref], ours_walls=[r["wall_s"] for r in ours],
                nfe_equal=ref[0]["nfe"] == ours[0]["nfe"],
                ref_tokens=a, ours_tokens=b)


def _same_tokens(runs: list[dict]) -> bool:
    seqs = [r["tokens"] for r in runs] + [r["warm_tokens"] for r in runs if r.get("warm_tokens")]
    return all(s == seqs[0] for s in seqs)


def cmd_peers(args) -> int:
    try:
        checkouts = check_args(args)
    except PeersError as e:
        print(f"python -m bench peers: error: {e}", file=sys.stderr)
        return 2
    for p, c in checkouts.items():
        commit = checkout_commit(c)
        want = PEERS[p]["commit"]
        state = ("commit unknown (not a git checkout)" if commit is None
                 else f"at {commit[:12]}" + ("" if commit.startswith(want) else f", NOT the documented {want}"))
        print(f"{PEERS[p]['repo']}: {c} ({state})")
    print(f"prompt {args.prompt_length}, gen {args.gen_length}, block {args.block_length} "
          f"(d2cache: one block of {args.gen_length}), threshold {args.threshold}, CPU, "
          f"{args.threads} threads, {args.rounds} round(s), warm-up {args.warmup}; "
          f"reference python {args.peer_python}, ours {args.ours_python}")
    try:
        rows, meta = run_peers(args, checkouts)
    except PeersError as e:
        print(f"python -m bench peers: error: {e}", file=sys.stderr)
        return 1
    print()
    print(format_table(rows))
    det = [r["mode"] for r in rows if r["deterministic"]]
    print(f"\nwall: median over rounds of one timed decode per process (after a {args.warmup} "
          f"warm-up decode); speed-up = reference / ours; CPU s: the process's CPU time over the "
          f"same decode (all its threads: about wall × the threads kept busy). Deterministic (every decode of both "
          f"sides gave the same tokens): {', '.join(det) or 'none'}.")
    if meta["d2cache_fixes"]:
        print("d²Cache run-time fixes (its files unmodified):")
        for k, v in meta["d2cache_fixes"].items():
            print(f"  - {k}: {v}")
    print("run-time adaptations:")
    for a in ADAPTATIONS:
        print(f"  - {a}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, meta=meta), f, indent=1)
    if args.csv:
        write_csv(args.csv, rows)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("peers", help="the reference loops (Fast-dLLM, d²Cache) against ours, same checkpoint")
    p.add_argument("--fast-dllm", help="Fast-dLLM checkout (NVlabs/Fast-dLLM 24cc59e; "
                                       "default $DLLM_PEERS_FAST_DLLM)")
    p.add_argument("--d2cache", help="d²Cache checkout (Kamichanw/d2Cache 72feb60; default $DLLM_PEERS_D2CACHE)")
    p.add_argument("--peer-python", default=sys.executable,
                   help="Python with the references' dependencies (default this one; "
                        "bench/peers-requirements.txt)")
    p.add_argument("--ours-python", default=sys.executable, help="Python with dllm_ops built (default this one)")
    p.add_argument("--modes", nargs="+", default=list(MODES), help="of none prefix dual d2cache (default all)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of every mode, both sides (default 1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-length", type=int, default=128)
    p.add_argument("--gen-length", type=int, default=64)
    p.add_argument("--block-length", type=int, default=16, help="block of none / prefix / dual (default 16)")
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--mlp", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seed", type=int, default=0, help="weights and prompt")
    p.add_argument("--d2cache-k", type=int, default=32)
    p.add_argument("--d2cache-p", type=float, default=0.1)
    p.add_argument("--d2cache-sigma", type=float, default=10.0, help="stage-1 certainty density σ")
    p.add_argument("--d2cache-decode-sigma", type=float, default=10.0,
                   help="certainty-prior decoding σ of the d2cache row (d²Cache's gen_args.py sets "
                        "10 with its cache; 0: off), both sides")
    p.add_argument("--d2cache-fixes", nargs="*", default=list(D2CACHE_FIXES),
                   help=f"run-time fixes applied to d²Cache (default all: {', '.join(D2CACHE_FIXES)}; "
                        f"the diagnostic {', '.join(D2CACHE_DIAGNOSTICS)} only when named)")
    p.add_argument("--warmup", default="full", choices=["full", "none"],
                   help="untimed decode in each child before the timed one (default full)")
    p.add_argument("--checkpoint", help="folder to write the checkpoint in (default a temporary one)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per child process")
    p.add_argument("--json", help="write rows and run metadata to this JSON file")
    p.add_argument("--csv", help="write the rows to this CSV file")
    p.set_defaults(func=cmd_peers)


# --------------------------------------------------------------------------
# child processes (this file run as a script: no dllm_ops import on the
# reference side)


def _child_main(spec_path: str) -> int:
    import torch

    with open(spec_path) as f:
        spec = json.load(f)
    torch.set_num_threads(spec["threads"])
    runner = {"ours": _ours_decoder, "ref": _fast_dllm_decoder if spec["peer"] == "fast-dllm"
              else _d2cache_decoder}[spec["side"]]
    decode, info = runner(spec)
    warm = None
    if spec["warmup"] == "full":
        warm, _ = decode()
        warm = [int(t) for t in warm]
    c0, t0 = time.process_time(), time.perf_counter()
    tokens, nfe = decode()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    import transformers
    out = dict(wall_s=wall, cpu_s=cpu, nfe=int(nfe), tokens=[int(t) for t in tokens], warm_tokens=warm,
               threads=torch.get_num_threads(),
               versions=dict(python=sys.version.split()[0], torch=torch.__version__,
                             transformers=transformers.__version__), **info)
    with open(spec["out"], "w") as f:
        json.dump(out, f)
    return 0


def _ours_decoder(spec):
    import torch

    import dllm_ops
    from dllm_ops.config import config_from_generate_kwargs, config_from_mode

    model = dllm_ops.load(spec["checkpoint"], dtype=torch.bfloat16, tokenizer=False)
    kw = dict(gen_length=spec["gen_length"], block_length=spec["block_length"], steps=spec["gen_length"],
              unmask="threshold", threshold=spec["threshold"], stop_at_eos=False, seed=0)
    d = spec["d2cache"]
    mode = spec["mode"]
    if mode == "d2cache":
        if d["decode_sigma"]:
            kw["sigma"] = d["decode_sigma"]
        mode = f"d2cache:k={d['k']},p={d['p']!r},sigma={d['sigma']!r}"
    config = config_from_mode(mode, config_from_generate_kwargs(**kw))

    def decode():
        out = dllm_ops.generate(model, [spec["prompt"]], config)
        return out.tokens[0].tolist(), out.stats["nfe"]
    return decode, dict(config=str(config.to_dict()))


def _fast_dllm_decoder(spec):
    import torch

    sys.path.insert(0, os.path.join(spec["checkout"], "llada"))
    import generate as fast_dllm  # the checkout's llada/generate.py
    from model.modeling_llada import LLaDAModelLM

    model = LLaDAModelLM.from_pretrained(spec["checkpoint"], torch_dtype=torch.bfloat16).to("cpu").eval()
    fn = getattr(fast_dllm, FAST_DLLM_FN[spec["mode"]])
    prompt = torch.tensor([spec["prompt"]], dtype=torch.long)
    P, G = prompt.shape[1], spec["gen_length"]

    def decode():
        x, nfe = fn(model, prompt, steps=G, gen_length=G, block_length=spec["block_length"],
                    temperature=0.0, remasking="low_confidence", mask_id=spec["mask_id"],
                    threshold=spec["threshold"])
        return x[0, P:].tolist(), nfe
    return decode, dict(function=f"llada/generate.py:{FAST_DLLM_FN[spec['mode']]}")


def _d2cache_decoder(spec):
    import functools

    import torch

    os.environ["MASK_TOKEN_ID"] = str(spec["mask_id"])
    sys.path.insert(0, spec["checkout"])
    import src.cache.d2cache as d2mod
    import src.generation.utils as gen_utils
    import src.generation.vanilla as vanilla
    from src.models import LLaDAModelLM

    model = LLaDAModelLM.from_pretrained(spec["checkpoint"], torch_dtype=torch.bfloat16,
                                         attn_implementation="eager").to("cpu").eval()
    # Its token-frequency table (for the PC sampler's debias only) scatters real
    # LLaDA ids (up to 126k) into a vocab-sized tensor: no table below that vocab.
    freq = gen_utils.get_token_freq
    gen_utils.get_token_freq = lambda family, vocab: freq(family, vocab) if vocab >= 126464 else None
    d = spec["d2cache"]
    live = {}
    fixes = apply_d2cache_fixes(vanilla, d2mod, d["fixes"], live)

    def make_cache(config):
        live["cache"] = d2mod.d2Cache(config, rollout_p=d["p"], current_k=d["k"], sigma=d["sigma"],
                                      inflate_w=0)
        return live["cache"]

    calls = [0]

    def count(*_):
        calls[0] += 1
    model.register_forward_pre_hook(count)
    prompt = torch.tensor([spec["prompt"]], dtype=torch.long)
    G = spec["gen_length"]

    def decode():
        calls[0] = 0
        record = vanilla.vanilla_generate(
            model, prompt, alg="maskgit_plus", block_length=spec["block_length"], gen_length=G,
            num_transfer_tokens=1, temperature=0.0, sigma=d["decode_sigma"] or None,
            mask_token_id=spec["mask_id"], pad_token_id=None, threshold=spec["threshold"],
            cache_cls=make_cache)
        nfe = calls[0]
        return record.frames[-1].generated_tokens.reshape(-1).tolist(), nfe
    return decode, dict(function="src/generation/vanilla.py:vanilla_generate + src/cache/d2cache.py:d2Cache",
                        fixes=fixes)


def apply_d2cache_fixes(vanilla, d2mod, names, live: dict) -> list[str]:
    """Wrap d²Cache's functions (module attributes, in this process only) so the named
    ``D2CACHE_FIXES`` hold; ``live["cache"]`` is the d2Cache instance of the decode running."""
    import torch

    names = [n for n in [*D2CACHE_FIXES, *D2CACHE_DIAGNOSTICS] if n in names]
    if "block-mask" in names:
        check = vanilla.check_can_generate

        def check_can_generate(frame, eligible_mask=None, *a, **kw):
            return check(frame, None if eligible_mask is None else eligible_mask.clone(), *a, **kw)
        vanilla.check_can_generate = check_can_generate

    if "fresh-logits" in names:
        unmask = vanilla.confidence_unmasking

        def confidence_unmasking(scores, transfer_index_mask, *a, **kw):
            cache = live.get("cache")
            if cache is not None and cache.active_q_mask is not None:
                # LLaDA: the generated region is the last G positions; a masked
                # token outside the call's rows has zero logits, not a prediction
                # (and its score, confidence x density, can even be NaN or +inf).
                ran = cache.active_q_mask[:, -transfer_index_mask.shape[1]:]
                transfer_index_mask = transfer_index_mask & ran
            return unmask(scores, transfer_index_mask, *a, **kw)
        vanilla.confidence_unmasking = confidence_unmasking

    if "rollout-fp32" in names:
        accumulate = d2mod.d2Cache.accumulate_attn_rollout

        def accumulate_attn_rollout(self, attn_scores):
            self._attn_rollout = self._attn_rollout.float()
            return accumulate(self, attn_scores.float())
        d2mod.d2Cache.accumulate_attn_rollout = accumulate_attn_rollout

    if "conf-cache" in names or "stage2-paper" in names:
        step_end = d2mod.d2Cache.on_step_end

        def on_step_end(self, block_mask, frame, delta):
            f = frame.as_batch()
            act = self.active_seq_mask
            masked = f.generated_tokens[act] == self.mask_token_id        # before this call's commit
            if "conf-cache" in names and self._conf_cache is not None and self.active_q_mask is not None:
                P = f.prompts.shape[1]
                fresh = self.active_q_mask[:, P:] & masked
                conf = self._conf_cache.clone()
                conf[act] = torch.where(fresh, delta.confidence, conf[act])
                self._conf_cache = conf
            if "stage2-paper" in names:
                left = masked.clone()
                for row, idx in enumerate(delta.as_batch().transfer_index):
                    if idx.numel():
                        left[row, idx.to(left.device)] = False
                live["still_masked"] = torch.nn.functional.pad(left, (f.prompts.shape[1], 0), value=False)
            try:
                return step_end(self, block_mask, frame, delta)
            finally:
                live.pop("still_masked", None)
        d2mod.d2Cache.on_step_end = on_step_end

    if "stage2-paper" in names:
        nucleus = d2mod.nucleus_select

        def nucleus_select(scores, top_p, min_k=1, mask=None):
            excl = live.get("still_masked")
            if excl is not None and mask is not None:
                mask = mask & ~excl
            return nucleus(scores, top_p, min_k=min_k, mask=mask)
        d2mod.nucleus_select = nucleus_select
    return names


if __name__ == "__main__":
    # Run as a script, this file's folder (bench/) leads sys.path: drop it, so
    # none of its modules shadows one of the reference code's.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        sys.exit(_child_main(sys.argv[2]))
    sys.exit("run it as: python -m bench peers --help")
