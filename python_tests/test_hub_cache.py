"""Hugging Face Hub ids in dllm_ops.load and the entry points, from the local
cache only: a real cache layout (models--org--name/{blobs, refs, snapshots},
snapshot files symlinked into blobs as huggingface_hub writes them) is built
in a temporary folder from the shipped tiny checkpoints and loaded by id with
the network blocked."""
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

pytest.importorskip("safetensors")
pytest.importorskip("transformers")
pytest.importorskip("huggingface_hub")
import torch

import dllm_ops
from dllm_ops.models import CHECKPOINTS_DIR, CheckpointError, load, resolve_checkpoint
from dllm_ops.tasks import problems

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = "tiny-org/tiny-dllm"
# Two commits of REPO: main holds tiny-llada, the branch `dream` holds tiny-dream.
C_LLADA = hashlib.sha1(b"tiny-llada commit").hexdigest()
C_DREAM = hashlib.sha1(b"tiny-dream commit").hexdigest()


def add_snapshot(cache, repo_id: str, src: str, commit: str, refs=(), skip=()) -> str:
    """Put the files of folder ``src`` into ``cache`` as huggingface_hub stores
    a downloaded snapshot of ``repo_id`` at ``commit``: content-addressed blobs,
    relative symlinks from snapshots/<commit>/..., and refs/<ref> holding the hash."""
    repo = os.path.join(str(cache), "models--" + repo_id.replace("/", "--"))
    blobs, snap = os.path.join(repo, "blobs"), os.path.join(repo, "snapshots", commit)
    os.makedirs(blobs, exist_ok=True)
    for root, _, files in os.walk(src):
        for f in files:
            rel = os.path.relpath(os.path.join(root, f), src)
            if rel in skip:
                continue
            data = open(os.path.join(root, f), "rb").read()
            blob = os.path.join(blobs, hashlib.sha256(data).hexdigest())
            if not os.path.exists(blob):
                open(blob, "wb").write(data)
            link = os.path.join(snap, rel)
            os.makedirs(os.path.dirname(link), exist_ok=True)
            os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    for ref in refs:
        os.makedirs(os.path.dirname(os.path.join(repo, "refs", ref)), exist_ok=True)
        with open(os.path.join(repo, "refs", ref), "w") as fh:
            fh.write(commit)          # no newline, as huggingface_hub writes it
    return snap


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    c = tmp_path_factory.mktemp("hf") / "hub"
    add_snapshot(c, REPO, os.path.join(CHECKPOINTS_DIR, "tiny-llada"), C_LLADA, refs=["main"])
    add_snapshot(c, REPO, os.path.join(CHECKPOINTS_DIR, "tiny-dream"), C_DREAM,
                 refs=["dream", "tags/v-dream"])
    return c


@pytest.fixture
def offline(monkeypatch, cache):
    """HF_HUB_CACHE names the temporary cache and no socket may connect."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))

    def refuse(*a, **k):
        raise AssertionError(f"network access during load: {a}")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    return cache


def _decode(model):
    p = problems("add", 2, seed=3)
    return dllm_ops.generate(model, model.tokenizer, prompt=[q.prompt for q in p], gen_length=16,
                             block_length=8, cache="dual", unmask="threshold", threshold=0.9)


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_hub_id_loads_and_decodes_as_the_folder(offline):
    by_id = load(REPO, dtype=torch.float32)
    direct = load("tiny-llada", dtype=torch.float32)
    assert by_id.config == direct.config and _same_weights(by_id, direct)
    path = resolve_checkpoint(REPO)
    assert path == os.path.join(str(offline), "models--tiny-org--tiny-dllm", "snapshots", C_LLADA)
    assert os.path.islink(os.path.join(path, "model.safetensors"))   # read through the hub's links
    a, b = _decode(by_id), _decode(direct)
    assert a.sequences == b.sequences and a.text == b.text and a.stats["nfe"] == b.stats["nfe"]
    assert by_id.tokenizer.get_vocab() == direct.tokenizer.get_vocab()


def test_hf_home_is_honoured(monkeypatch, tmp_path):
    home = tmp_path / "home"
    add_snapshot(home / "hub", REPO, os.path.join(CHECKPOINTS_DIR, "tiny-dream"), C_DREAM, refs=["main"])
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    assert resolve_checkpoint(REPO) == str(home / "hub" / "models--tiny-org--tiny-dllm" / "snapshots" / C_DREAM)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))   # HF_HUB_CACHE wins over HF_HOME
    with pytest.raises(CheckpointError, match="not in the local cache"):
        resolve_checkpoint(REPO)


@pytest.mark.parametrize("how", ["ref", "tag", "commit", "short-commit", "at-suffix", "at-commit"])
def test_revision_by_ref_and_commit(offline, how):
    kw, name = {}, REPO
    if how == "ref":
        kw["revision"] = "dream"
    elif how == "tag":
        kw["revision"] = "tags/v-dream"
    elif how == "commit":
        kw["revision"] = C_DREAM
    elif how == "short-commit":
        kw["revision"] = C_DREAM[:10]
    elif how == "at-suffix":
        name = f"{REPO}@dream"
    else:
        name = f"{REPO}@{C_DREAM[:12]}"
    model = load(name, dtype=torch.float32, **kw)
    assert model.config.arch == "dream"
    assert _same_weights(model, load("tiny-dream", dtype=torch.float32, tokenizer=False))
    assert load(REPO, dtype=torch.float32, revision=C_LLADA, tokenizer=False).config.arch == "llada"
    assert load(f"{REPO}@main", dtype=torch.float32, tokenizer=False).config.arch == "llada"


def test_uncached_id_is_a_clear_error(offline):
    with pytest.raises(CheckpointError) as e:
        load("GSAI-ML/LLaDA-8B-Instruct")
    msg = str(e.value)
    assert msg.startswith("dllm_ops.load: 'GSAI-ML/LLaDA-8B-Instruct' is neither a checkpoint folder "
                          "nor a shipped model (tiny-llada, tiny-dream)")
    assert "not in the local cache" in msg
    assert os.path.join(str(offline), "models--GSAI-ML--LLaDA-8B-Instruct") in msg
    assert "from HF_HUB_CACHE" in msg
    assert "`hf download GSAI-ML/LLaDA-8B-Instruct`" in msg
    assert "`huggingface-cli download GSAI-ML/LLaDA-8B-Instruct`" in msg
    with pytest.raises(CheckpointError, match=r"`hf download GSAI-ML/LLaDA-8B-Instruct --revision v2`"):
        load("GSAI-ML/LLaDA-8B-Instruct@v2")


def test_uncached_revision_names_what_the_cache_holds(offline):
    with pytest.raises(CheckpointError, match=rf"{REPO}@nope: the local Hugging Face cache .* holds this "
                                              rf"repository but not revision 'nope' \(refs: dream, main, "
                                              rf"tags/v-dream; snapshots: .*{C_DREAM[:12]}.*\); .*"
                                              rf"`hf download {REPO} --revision nope`"):
        load(f"{REPO}@nope")
    with pytest.raises(CheckpointError, match=r"names revision 'dream' but revision='main' was given too"):
        load(f"{REPO}@dream", revision="main")
    with pytest.raises(CheckpointError, match=r"nothing after '@'"):
        load(f"{REPO}@")


def test_not_an_id_nor_a_folder(offline, tmp_path):
    for bad in ["./no/such/folder", str(tmp_path / "missing"), "a/b/c"]:
        with pytest.raises(CheckpointError, match=r"is neither a checkpoint folder nor a shipped model "
                                                  r"\(tiny-llada, tiny-dream\), nor a Hugging Face Hub id"):
            load(bad)
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"is a file; a checkpoint is the folder"):
        load(str(f))
    with pytest.raises(CheckpointError, match=r"tiny-llada is a shipped model; it has no revisions"):
        load("tiny-llada", revision="main")
    with pytest.raises(CheckpointError, match=r"this is a local folder, which has none"):
        load(os.path.join(CHECKPOINTS_DIR, "tiny-llada"), revision="main")


def test_partial_snapshot_is_refused(offline, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    add_snapshot(cache, "org/partial", os.path.join(CHECKPOINTS_DIR, "tiny-llada"), C_LLADA,
                 refs=["main"], skip={"config.json"})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with pytest.raises(CheckpointError, match=r"org/partial: the cached snapshot .* has no config.json "
                                              r"\(only part of the repository was downloaded\); .*"
                                              r"`hf download org/partial`"):
        load("org/partial")


def test_resolution_order_folder_then_shipped_then_hub(offline, tmp_path, monkeypatch):
    """A folder with the id's name wins over the cache; a shipped name wins over
    a cached repository of that name."""
    add_snapshot(offline, "tiny-llada", os.path.join(CHECKPOINTS_DIR, "tiny-dream"), C_DREAM, refs=["main"])
    try:
        assert load("tiny-llada", dtype=torch.float32, tokenizer=False).config.arch == "llada"
        monkeypatch.chdir(tmp_path)
        shutil.copytree(os.path.join(CHECKPOINTS_DIR, "tiny-dream"), tmp_path / "tiny-org" / "tiny-dllm")
        assert resolve_checkpoint(REPO) == REPO
        assert load(REPO, dtype=torch.float32, tokenizer=False).config.arch == "dream"
    finally:
        shutil.rmtree(os.path.join(str(offline), "models--tiny-llada"))


def test_cli_generate_by_hub_id(cache):
    """`python -m dllm_ops generate --model org/name` (the server's --model goes
    through the same cli.load_model) in a fresh process with HF_HUB_CACHE set
    and HF_HUB_OFFLINE unset: nothing is fetched, the answer is the folder's."""
    p = problems("add", 1, seed=3)[0]
    args = ["--prompt", p.prompt, "--gen-length", "16", "--block-length", "8", "--cache", "dual",
            "--unmask", "threshold", "--threshold", "0.9", "--json"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HUB_CACHE=str(cache), PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(dllm_ops.__file__)), ROOT]))
    r = subprocess.run([sys.executable, "-m", "dllm_ops", "generate", "--model", f"{REPO}@main"] + args,
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    model = load("tiny-llada", dtype=torch.float32)
    want = dllm_ops.generate(model, model.tokenizer, prompt=p.prompt, gen_length=16, block_length=8,
                             cache="dual", unmask="threshold", threshold=0.9)
    assert got["tokens"] == want.sequences and got["text"] == want.text
    r = subprocess.run([sys.executable, "-m", "dllm_ops", "generate", "--model", "tiny-org/missing"] + args,
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 1 and r.stdout == ""
    assert "not in the local cache" in r.stderr and "`hf download tiny-org/missing`" in r.stderr
    assert "Traceback" not in r.stderr


def test_calibrate_resolves_hub_ids(offline):
    from dllm_ops.calibrate.__main__ import _resolve
    assert _resolve(f"{REPO}@dream") == (f"{REPO}@dream", resolve_checkpoint(REPO, "dream"))
    with pytest.raises(SystemExit, match=r"dllm_ops.calibrate: --model: .*not in the local cache"):
        _resolve("tiny-org/missing")


def test_lm_eval_pretrained_hub_id(offline):
    pytest.importorskip("lm_eval")
    from dllm_ops.lm_eval_model import DllmOpsLM
    lm = DllmOpsLM(pretrained=f"{REPO}@dream", dtype="float32", device="cpu")
    assert lm.model.config.arch == "dream"
    assert _same_weights(lm.model, load("tiny-dream", dtype=torch.float32, tokenizer=False))


def test_lm_eval_revision_key(offline):
    """model_args ``revision=`` picks the Hub id's revision, as ``@rev`` does."""
    pytest.importorskip("lm_eval")
    from dllm_ops.lm_eval_model import DllmOpsLM
    lm = DllmOpsLM(pretrained=REPO, revision="dream", dtype="float32", device="cpu")
    assert lm.model.config.arch == "dream"
