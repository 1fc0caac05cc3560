"""The HTTP server (python -m dllm_ops serve, dllm_ops/serve; issue 35).

In-process: the request checks (dllm_ops/serve/protocol.py), the streamed
text's rules (answer_text.py) and the response shapes (responses.py).

Against a real server: ``python -m dllm_ops serve --model tiny-llada`` started
as a subprocess on 127.0.0.1 at a free port, driven by the official ``openai``
client (completions, chat, streaming, usage; answers equal in-process
``generate``) and by raw HTTP (httpx2) for the error bodies, 429, a streamed
request closed early and SIGTERM's drain. Every wait is bounded.
"""
from __future__ import annotations

import json
import time

import pytest

# The server's stack (requirements.txt pins it); an image without it -- the GPU
# machine's, which `make gpu-check` runs this suite on -- skips the file instead
# of failing the whole collection (test_serve_ray.py imports this module).
pytest.importorskip("pydantic")
pytest.importorskip("fastapi")

from dllm_ops.config import DecodeConfig, config_from_settings, region_length
from dllm_ops.errors import ServeError
from dllm_ops.serve.answer_text import AnswerText
from dllm_ops.serve.protocol import (DEFAULT_MAX_TOKENS, ChatCompletionRequest, CompletionRequest,
                                     parse_body, prepare)
from dllm_ops.serve.responses import ResponseShape, Usage, error_body, sse
from dllm_ops.tasks import task_tokenizer

MODEL = "tiny-llada"
CONTEXT = 256          # tiny-llada's max_seq_len
DEFAULTS = config_from_settings({"cache": "dual", "unmask": "threshold", "threshold": 0.9,
                                 "block_length": 16, "gen_length": 16})


@pytest.fixture(scope="module")
def tok():
    return task_tokenizer()


def job_of(body: dict, tok, kind=CompletionRequest, defaults=DEFAULTS, context=CONTEXT):
    return prepare(parse_body(body, kind), tok, defaults, context)


def refused(body: dict, tok, kind=CompletionRequest, **kw) -> ServeError:
    with pytest.raises(ServeError) as info:
        job_of(body, tok, kind, **kw)
    assert info.value.status == 400
    return info.value


# ---- request checks (in-process) ------------------------------------------------------

def test_unknown_fields_are_named(tok):
    e = refused({"model": MODEL, "prompt": "add 1", "foo": 1, "best_of": 2}, tok)
    assert e.param == "foo" and e.code == "unknown_field"
    assert "'foo'" in str(e) and "'best_of'" in str(e)
    e = refused({"model": MODEL, "messages": [{"role": "user", "content": "x", "tone": "y"}]}, tok,
                ChatCompletionRequest)
    assert e.param == "messages.0.tone"


@pytest.mark.parametrize("field,value", [
    ("max_tokens", "5"), ("max_tokens", 5.0), ("max_tokens", True), ("temperature", "hot"),
    ("seed", 1.5), ("stream", "yes"), ("n", "1"), ("stop", 3), ("dllm", "dual"), ("prompt", 7),
    ("model", None)])
def test_wrong_types_are_named(tok, field, value):
    e = refused({"model": MODEL, "prompt": "add 1", field: value}, tok)
    assert e.param == field and e.code == "invalid_type"


def test_missing_and_non_object_bodies(tok):
    assert refused({"model": MODEL}, tok).param == "prompt"
    assert refused({"prompt": "add 1"}, tok).param == "model"
    assert refused({"model": MODEL, "messages": []}, tok, ChatCompletionRequest).param == "messages"
    e = refused({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, tok,
                ChatCompletionRequest)
    assert e.param == "messages.0.role"
    with pytest.raises(ServeError, match="must be a JSON object, got list"):
        parse_body([1, 2], CompletionRequest)


def test_n_stop_stream_options(tok):
    assert refused({"model": MODEL, "prompt": "add 1", "n": 2}, tok).param == "n"
    assert job_of({"model": MODEL, "prompt": "add 1", "n": 1}, tok).stop == ()
    assert refused({"model": MODEL, "prompt": "add 1", "stop": ["1", "2", "3", "4", "5"]}, tok).param == "stop"
    assert refused({"model": MODEL, "prompt": "add 1", "stop": ""}, tok).param == "stop"
    assert job_of({"model": MODEL, "prompt": "add 1", "stop": "9"}, tok).stop == ("9",)
    assert job_of({"model": MODEL, "prompt": "add 1", "stop": ["9", "+"]}, tok).stop == ("9", "+")
    e = refused({"model": MODEL, "prompt": "add 1", "stream_options": {"include_usage": True}}, tok)
    assert e.param == "stream_options"
    job = job_of({"model": MODEL, "prompt": "add 1", "stream": True,
                  "stream_options": {"include_usage": True}}, tok)
    assert job.stream and job.include_usage


def test_prompt_forms(tok):
    job = job_of({"model": MODEL, "prompt": ["<bos> add 7 4 + 9 ="]}, tok)
    assert job.prompt_ids == tok("<bos> add 7 4 + 9 =", add_special_tokens=False)["input_ids"]
    assert refused({"model": MODEL, "prompt": ["add 1", "add 2"]}, tok).param == "prompt"
    assert refused({"model": MODEL, "prompt": ""}, tok).param == "prompt"


def test_chat_uses_the_template(tok):
    from dllm_ops.prompts import prompt_ids
    messages = [{"role": "user", "content": "add 7 4 + 9 ="}]
    job = job_of({"model": MODEL, "messages": messages}, tok, ChatCompletionRequest)
    assert job.prompt_ids == prompt_ids(tok, messages=messages)[0][0]
    assert job.prompt_ids[0] == tok.bos_token_id
    e = refused({"model": MODEL, "messages": messages, "max_tokens": 4, "max_completion_tokens": 4},
                tok, ChatCompletionRequest)
    assert e.param == "max_completion_tokens"
    assert job_of({"model": MODEL, "messages": messages, "max_completion_tokens": 5}, tok,
                  ChatCompletionRequest).max_tokens == 5


def test_max_tokens_sets_the_region_in_whole_blocks(tok):
    job = job_of({"model": MODEL, "prompt": "add 1"}, tok)
    assert job.max_tokens == DEFAULT_MAX_TOKENS
    assert job.config.shape.gen_length == region_length(DEFAULT_MAX_TOKENS, 16)
    job = job_of({"model": MODEL, "prompt": "add 1", "max_tokens": 20}, tok)
    assert (job.max_tokens, job.config.shape.gen_length) == (20, 32)
    job = job_of({"model": MODEL, "prompt": "add 1", "max_tokens": 20,
                  "dllm": {"shape": {"block_length": 8}}}, tok)
    assert (job.config.shape.block_length, job.config.shape.gen_length) == (8, 24)
    # everything else is the server's defaults
    assert job.config.replace(shape=DEFAULTS.shape) == DEFAULTS


def test_max_tokens_and_prompt_length_limits(tok):
    assert refused({"model": MODEL, "prompt": "add 1", "max_tokens": 0}, tok).param == "max_tokens"
    assert refused({"model": MODEL, "prompt": "add 1", "max_tokens": 256}, tok).param == "max_tokens"
    # a 241-token region (rounded to 256) leaves no room; 240 leaves 16 for the prompt
    assert refused({"model": MODEL, "prompt": "add 1", "max_tokens": 241}, tok).param == "max_tokens"
    assert job_of({"model": MODEL, "prompt": "add 1", "max_tokens": 240}, tok).config.shape.gen_length == 240
    e = refused({"model": MODEL, "prompt": " ".join(["1"] * 17), "max_tokens": 240}, tok)
    assert (e.param, e.code) == ("prompt", "context_length_exceeded")
    assert "17 tokens" in str(e) and "240" in str(e)
    e = refused({"model": MODEL, "messages": [{"role": "user", "content": " ".join(["1"] * 200)}],
                 "max_tokens": 64}, tok, ChatCompletionRequest)
    assert e.param == "messages"


def test_vendor_config_merges_over_the_defaults(tok):
    body = {"model": MODEL, "prompt": "add 1", "max_tokens": 16,
            "dllm": {"cache": {"method": "d2cache", "d2cache": {"current_k": 4}},
                     "reveal": {"unmask": "topk"}}}
    config = job_of(body, tok).config
    assert config.cache.method == "d2cache" and config.cache.d2cache.current_k == 4
    assert config.reveal.unmask == "topk" and config.reveal.threshold == DEFAULTS.reveal.threshold
    same = job_of({**body, "dllm": None, "dllm_ops": body["dllm"]}, tok).config
    assert same == config
    # the same JSON as DecodeConfig.to_dict(), whole
    whole = DecodeConfig().replace(reveal=DEFAULTS.reveal).to_dict()
    assert job_of({"model": MODEL, "prompt": "add 1", "max_tokens": 128,
                   "dllm": {k: v for k, v in whole.items() if k != "shape"}}, tok).config \
        == DecodeConfig().replace(reveal=DEFAULTS.reveal, shape=DEFAULTS.shape.replace(gen_length=128))


@pytest.mark.parametrize("dllm,param,text", [
    ({"cache": {"method": "bogus"}}, "dllm.cache.method", "cache.method = 'bogus'"),
    ({"reveal": {"threshold": "high"}}, "dllm.reveal.threshold", "reveal.threshold"),
    ({"reuse": {"method": "kv"}}, "dllm.reuse", "exactly one of rho"),
    ({"storage": {"method": "kivi", "bits": 3}}, "dllm.storage.bits", "storage.bits = 3"),
    ({"cachee": {}}, "dllm", "unknown key(s) ['cachee']"),
    ({"shape": {"block_length": 0}}, "dllm.shape.block_length", "shape.block_length = 0"),
    ({"shape": {"gen_length": 64}}, "dllm.shape.gen_length", "set max_tokens"),
])
def test_bad_vendor_config_names_the_field(tok, dllm, param, text):
    e = refused({"model": MODEL, "prompt": "add 1", "dllm": dllm}, tok)
    assert e.param == param and text in str(e)


def test_temperature_and_seed(tok):
    config = job_of({"model": MODEL, "prompt": "add 1", "temperature": 0.7, "seed": 11}, tok).config
    assert (config.reveal.temperature, config.shape.seed) == (0.7, 11)
    assert job_of({"model": MODEL, "prompt": "add 1", "temperature": 1}, tok).config.reveal.temperature == 1.0
    e = refused({"model": MODEL, "prompt": "add 1", "temperature": -1}, tok)
    assert e.param == "temperature" and "reveal.temperature" in str(e)
    e = refused({"model": MODEL, "prompt": "add 1", "seed": 3, "dllm": {"shape": {"seed": 4}}}, tok)
    assert e.param == "seed"
    e = refused({"model": MODEL, "prompt": "add 1", "dllm": {}, "dllm_ops": {}}, tok)
    assert e.param == "dllm_ops"


# ---- the streamed text's rules (in-process) ---------------------------------------------

class ByteTokenizer:
    """Ids are UTF-8 bytes, decoded as a byte-level tokenizer decodes (U+FFFD for
    an unfinished character)."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def stream_pieces(text: AnswerText, ids: list[int]):
    """Feed every prefix of ``ids`` then the whole answer; the pieces sent."""
    pieces = [text.update(ids[:k]) for k in range(1, len(ids) + 1)]
    return pieces + [text.finish(ids)]


def test_pieces_never_change_and_join_to_the_answer():
    ids = list("héllo wörld · done".encode())
    pieces = stream_pieces(AnswerText(ByteTokenizer()), ids)
    assert "".join(p.text for p in pieces) == "héllo wörld · done"
    assert all("\ufffd" not in p.text for p in pieces)
    assert not any(p.stopped for p in pieces)
    assert pieces[-1].completion_tokens is None


def test_trailing_space_waits_for_the_next_token(tok):
    ids = tok("1 2 3", add_special_tokens=False)["input_ids"]
    text = AnswerText(tok)
    assert [text.update(ids[:k]).text for k in (1, 2, 3)] == ["1", " 2", " 3"]
    assert text.finish(ids).text == ""


@pytest.mark.parametrize("stops", [("wor",), ("xx", "o w"), ("ld", "wo")])
def test_stop_cuts_at_the_first_stop_string(stops):
    ids = list("hello world".encode())
    whole = "hello world"
    cut = min(whole.find(s) for s in stops if s in whole)
    pieces = stream_pieces(AnswerText(ByteTokenizer(), stops), ids)
    stopped = [p for p in pieces if p.stopped]
    assert len(stopped) == 1
    assert "".join(p.text for p in pieces) == whole[:cut]
    # the shortest prefix whose text holds the stop string
    need = min(whole.find(s) + len(s) for s in stops if s in whole)
    assert stopped[0].completion_tokens == need
    # the whole answer at once says the same
    once = AnswerText(ByteTokenizer(), stops).finish(ids)
    assert (once.text, once.stopped, once.completion_tokens) == (whole[:cut], True, need)


def test_a_partial_stop_string_is_held_back_until_it_is_not_one():
    text = AnswerText(ByteTokenizer(), ("lox",))
    sent = [text.update(list(s.encode())).text for s in ("he", "hel", "hell", "hello", "hello!")]
    # "l" and then "lo" could start "lox"; "ll" and "lo!" cannot
    assert sent == ["he", "", "l", "", "lo!"]
    assert text.finish(list(b"hello!")).text == "" and text.done


# ---- response shapes (in-process) ----------------------------------------------------------

def test_response_shapes():
    usage = Usage(5, 3)
    assert usage.to_dict() == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    c = ResponseShape(chat=False, request_id="r1", model=MODEL)
    body = c.body("1 2", "length", usage)
    assert body["object"] == "text_completion" and body["id"] == "cmpl-r1"
    assert body["choices"] == [{"index": 0, "text": "1 2", "logprobs": None, "finish_reason": "length"}]
    chat = ResponseShape(chat=True, request_id="r2", model=MODEL, include_usage=True)
    assert chat.body("x", "stop", usage)["choices"][0]["message"] == {"role": "assistant", "content": "x"}
    first = chat.chunk("a", first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "a"} and first["usage"] is None
    assert chat.chunk(None, "stop")["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                                     "finish_reason": "stop"}
    assert chat.usage_chunk(usage)["choices"] == [] and chat.usage_chunk(usage)["usage"]["total_tokens"] == 8
    assert "usage" not in c.chunk("a")
    assert sse({"a": 1}) == 'data: {"a":1}\n\n'
    assert error_body("bad", status=429, param=None, code="queue_full") == {
        "error": {"message": "bad", "type": "rate_limit_error", "param": None, "code": "queue_full"}}
    assert json.loads(sse(error_body("x", status=400))[6:])["error"]["type"] == "invalid_request_error"


# ---- a real server (subprocess, loopback) -------------------------------------------------

SERVER_FLAGS = ["--dtype", "fp32", "--device", "cpu", "--threads", "1", "--log-level", "warning",
                "--cache", "dual", "--unmask", "threshold", "--threshold", "0.9", "--block-length", "16"]
#: a slow decode: no cache, one token per call, EOS never committed (all max_tokens decode)
SLOW = {"cache": {"method": "none"}, "reveal": {"unmask": "topk", "suppress_eos": True}}
LONG = 224             # tokens of a slow request (14 blocks, one call each token)
WAIT = 60.0            # bound on any one wait for the server


def suite_prompt(i: int) -> str:
    from dllm_ops.tasks import TASKS, problems
    task = list(TASKS)[i % len(TASKS)]
    return problems(task, i // len(TASKS) + 1, seed=0, split="test")[-1].prompt


@pytest.fixture(scope="module")
def server():
    from dllm_ops.serve.spawn import ServerProcess
    with ServerProcess(MODEL, SERVER_FLAGS, ready_timeout=WAIT) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=WAIT, max_retries=0)


@pytest.fixture(scope="module")
def model():
    import torch

    import dllm_ops
    return dllm_ops.load(MODEL, dtype=torch.float32, device="cpu")


def http():
    import httpx2
    return httpx2.Client(timeout=WAIT, trust_env=False)


def server_defaults():
    from dllm_ops.cli import build_parser, decode_config
    return decode_config(build_parser().parse_args(["serve", "--model", MODEL, *SERVER_FLAGS]))


def expected(model, max_tokens: int, dllm: dict | None = None, seed: int | None = None,
             temperature: float | None = None, **prompt):
    """(text, completion tokens, finish_reason) of generate alone, as the server answers."""
    import dllm_ops
    from dllm_ops.config import merge
    tree = {**(dllm or {})}
    block = tree.get("shape", {}).get("block_length", 16)
    tree["shape"] = {**tree.get("shape", {}), "gen_length": region_length(max_tokens, block)}
    if seed is not None:
        tree["shape"]["seed"] = seed
    if temperature is not None:
        tree["reveal"] = {**tree.get("reveal", {}), "temperature": temperature}
    config = merge(server_defaults(), tree)
    out = dllm_ops.generate(model, model.tokenizer, config, **prompt)
    seq = out.sequences[0][:max_tokens]
    return model.tokenizer.decode(seq), len(seq), "length" if len(seq) == max_tokens else "stop"


def metric(url: str, name: str) -> float:
    """One sample's value from /metrics (a series without labels)."""
    with http() as c:
        text = c.get(url + "/metrics").text
    for line in text.splitlines():
        if line.split(" ")[0] == name:
            return float(line.split(" ")[1])
    raise AssertionError(f"{name} not in /metrics:\n{text}")


def wait_for_metric(url: str, name: str, value: float) -> None:
    deadline = time.monotonic() + WAIT
    while metric(url, name) != value:
        assert time.monotonic() < deadline, f"{name} did not reach {value} within {WAIT} s"
        time.sleep(0.02)


def test_serve_flags_parse_as_generate_flags_do():
    import subprocess
    import sys
    config = server_defaults()
    assert (config.cache.method, config.reveal.unmask, config.reveal.threshold, config.shape.block_length) \
        == ("dual", "threshold", 0.9, 16)
    for flags, message in ((["--set", "cache.method=bogus"], "cache.method = 'bogus'"),
                           (["--cache", "dual", "--set", "cache=prefix"], "cache is given both"),
                           (["--gen-length", "64"], "unrecognized arguments: --gen-length")):
        r = subprocess.run([sys.executable, "-m", "dllm_ops", "serve", "--model", MODEL, *flags],
                           capture_output=True, text=True, timeout=WAIT)
        assert r.returncode == 2 and message in r.stderr, r.stderr


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    with http() as c:
        health = c.get(server.url + "/health").json()
        r = c.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "dllm_requests_total" in r.text
    # the engine's series come from its own process, beside the HTTP process's counter
    assert "dllm_model_calls_total" in r.text and "dllm_kv_bytes_in_use" in r.text
    assert health == {"status": "ok", "engine_pid": health["engine_pid"]}
    assert parent_pid(health["engine_pid"]) == server.proc.pid      # the server's child


def parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.parametrize("dllm", [
    None,
    {"cache": {"method": "none"}, "reveal": {"unmask": "topk"}},
    {"cache": {"method": "d2cache", "d2cache": {"current_k": 4, "density_sigma": 3.0}},
     "reveal": {"unmask": "topk"}},
    {"reuse": {"method": "kv", "rho": 0.5}},
    {"cache": {"method": "prefix"}, "storage": {"method": "kivi", "bits": 4}},
], ids=["defaults", "none", "d2cache", "dare-kv", "kivi4"])
def test_completion_equals_generate(client, model, dllm):
    for i, max_tokens in enumerate((20, 48)):
        prompt = suite_prompt(i)
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, seed=5,
                                      extra_body={"dllm": dllm} if dllm else None)
        text, n, finish = expected(model, max_tokens, dllm, seed=5, prompt=prompt)
        assert r.choices[0].text == text
        assert r.choices[0].finish_reason == finish
        prompt_tokens = len(model.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
            (prompt_tokens, n, prompt_tokens + n)
        assert r.object == "text_completion" and r.model == MODEL


def test_chat_equals_generate(client, model):
    messages = [{"role": "user", "content": suite_prompt(1).removeprefix("<bos> ")}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0.0)
    text, n, finish = expected(model, 16, messages=messages)
    assert r.choices[0].message.role == "assistant"
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (text, finish)
    assert r.usage.completion_tokens == n


def test_sampling_follows_the_seed(client, model):
    prompt = suite_prompt(2)
    answers = {seed: client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, seed=seed,
                                               temperature=1.0).choices[0].text for seed in (1, 2)}
    for seed, text in answers.items():
        assert text == expected(model, 32, seed=seed, temperature=1.0, prompt=prompt)[0]


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_deltas_join_to_the_whole_answer(client, chat):
    kw = dict(model=MODEL, max_tokens=48, seed=3, extra_body={"dllm": {"reveal": {"suppress_eos": True}}})
    if chat:
        kw["messages"] = [{"role": "user", "content": suite_prompt(3)}]
        create = client.chat.completions.create
    else:
        kw["prompt"] = suite_prompt(3)
        create = client.completions.create
    whole = create(**kw)
    chunks = list(create(**kw, stream=True, stream_options={"include_usage": True}))
    usage = [c for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0] is chunks[-1] and chunks[-1].choices == []
    assert usage[0].usage == whole.usage
    choices = [c.choices[0] for c in chunks[:-1]]
    assert [ch.finish_reason for ch in choices] == [None] * (len(choices) - 1) + ["length"]
    deltas = [(ch.delta.content if chat else ch.text) or "" for ch in choices]
    assert sum(1 for d in deltas if d) >= 3        # one at least per block of 16 tokens
    assert "".join(deltas) == (whole.choices[0].message.content if chat else whole.choices[0].text)
    if chat:
        assert choices[0].delta.role == "assistant"


def test_stop_string_cuts_and_ends_the_answer(client, model):
    prompt = suite_prompt(4)
    kw = dict(model=MODEL, prompt=prompt, max_tokens=48, extra_body={"dllm": {"reveal": {"suppress_eos": True}}})
    full = client.completions.create(**kw).choices[0].text
    words = full.split(" ")
    stop = " ".join(words[5:7])
    cut = full.find(stop)
    r = client.completions.create(**kw, stop=[stop, "no such text"])
    assert r.choices[0].text == full[:cut] and r.choices[0].finish_reason == "stop"
    tok = model.tokenizer
    assert r.usage.completion_tokens == len(tok(full[:cut] + stop, add_special_tokens=False)["input_ids"])
    streamed = list(client.completions.create(**kw, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == full[:cut]
    assert streamed[-1].choices[0].finish_reason == "stop"


def error_of(r) -> dict:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("body,param,code", [
    (b'{"model": "tiny-llada", "prompt": "1 2",', None, "invalid_json"),
    ({"model": MODEL, "prompt": "1 2", "logit_bias": {}}, "logit_bias", "unknown_field"),
    ({"model": MODEL, "prompt": "1 2", "n": 2}, "n", None),
    ({"model": MODEL, "prompt": "1 2", "max_tokens": "8"}, "max_tokens", "invalid_type"),
    ({"model": MODEL, "prompt": "1 2", "max_tokens": 0}, "max_tokens", None),
    ({"model": MODEL, "prompt": "1 2", "max_tokens": 1000}, "max_tokens", None),
    ({"model": MODEL, "prompt": " ".join(["1"] * 250), "max_tokens": 8}, "prompt", "context_length_exceeded"),
    ({"model": MODEL, "prompt": "1 2", "dllm": {"cache": {"method": "fast"}}}, "dllm.cache.method",
     "invalid_config"),
    ({"model": MODEL, "prompt": "1 2", "dllm": {"cache": {"method": "none"},
                                                 "storage": {"method": "kivi", "bits": 4}}},
     "dllm.storage.method", "invalid_config"),
    ({"model": MODEL, "prompt": "1 2 <mask>"}, None, "invalid_request"),
])
def test_bad_requests_get_400_bodies(server, body, param, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with http() as c:
        r = c.post(server.url + "/v1/completions", content=content,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = error_of(r)
    assert err["type"] == "invalid_request_error" and err["param"] == param
    if code is not None:
        assert err["code"] == code
    if param:
        assert param.split(".")[-1] in err["message"]


def test_openai_client_sees_the_error(client):
    import openai
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="1 2", n=2)
    assert info.value.status_code == 400 and info.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="1 2")
    with http() as c:
        assert c.get(client.base_url.__str__().rstrip("/") + "/nothing").status_code == 404


@pytest.fixture(scope="module")
def one_slot_server():
    """One running sequence and one waiting at most."""
    from dllm_ops.serve.spawn import ServerProcess
    flags = SERVER_FLAGS + ["--max-running", "1", "--max-queue", "1"]
    with ServerProcess(MODEL, flags, ready_timeout=WAIT) as s:
        yield s


def slow_body(stream: bool = False) -> dict:
    return {"model": MODEL, "prompt": suite_prompt(0), "max_tokens": LONG, "stream": stream, "dllm": SLOW}


def test_a_full_queue_answers_429(one_slot_server):
    import threading
    url = one_slot_server.url + "/v1/completions"
    n = 6
    barrier = threading.Barrier(n - 1)
    responses = [None] * n

    def send(i):
        with http() as c:
            if i:
                barrier.wait(WAIT)
            responses[i] = c.post(url, json=slow_body())

    # One request is running before the others arrive at once: then exactly one of
    # those waits in the queue (its one slot) and the rest are refused. (Arriving
    # together with the first, a second can find the queue still holding the first.)
    first = threading.Thread(target=send, args=(0,))
    first.start()
    wait_for_metric(one_slot_server.url, "dllm_running_sequences", 1)
    threads = [threading.Thread(target=send, args=(i,)) for i in range(1, n)]
    for t in threads:
        t.start()
    for t in [first, *threads]:
        t.join(2 * WAIT)
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) == 2 and codes.count(429) == n - 2, codes
    full = next(r for r in responses if r.status_code == 429)
    assert int(full.headers["retry-after"]) >= 1
    err = error_of(full)
    assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
    assert all(r.json()["usage"]["completion_tokens"] == LONG for r in responses if r.status_code == 200)


def test_client_disconnect_frees_the_slot(one_slot_server):
    url = one_slot_server.url
    calls = metric(url, "dllm_model_calls_total")
    with http() as c:
        with c.stream("POST", url + "/v1/completions", json=slow_body(stream=True)) as r:
            assert r.status_code == 200
            lines = r.iter_lines()   # held: dropping the iterator would close the stream
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["text"]
            wait_for_metric(url, "dllm_running_sequences", 1)   # the gauge is set after the call
        # the stream is closed here, long before its 224 tokens (about 2 s of decoding)
    wait_for_metric(url, "dllm_running_sequences", 0)
    assert metric(url, "dllm_model_calls_total") - calls < LONG    # it stopped early
    with http() as c:
        text = c.get(url + "/metrics").text
    assert 'dllm_requests_total{status="499"} 1.0' in text
    with http() as c:   # the one slot serves the next request
        r = c.post(url + "/v1/completions", json={"model": MODEL, "prompt": "1 2", "max_tokens": 4})
    assert r.status_code == 200


def test_sigterm_drains_and_exits_0():
    from dllm_ops.serve.spawn import ServerProcess
    server = ServerProcess(MODEL, SERVER_FLAGS + ["--drain-timeout", "60"], ready_timeout=WAIT)
    try:
        with http() as c:
            with c.stream("POST", server.url + "/v1/completions", json=slow_body(stream=True)) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                server.proc.send_signal(__import__("signal").SIGTERM)
                rest = [line for line in lines if line.startswith("data: ")]
        chunks = [json.loads(x[6:]) for x in [first, *rest[:-1]]]
        assert rest[-1] == "data: [DONE]"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        text = "".join(ch["choices"][0]["text"] for ch in chunks)
        assert len(text.split(" ")) == LONG        # the whole answer, after SIGTERM
        assert server.proc.wait(WAIT) == 0
    finally:
        server.kill()


def test_a_dead_engine_process_fails_its_requests_and_health():
    """SIGKILL the engine process mid-answer: that answer ends with a 500 error
    event, /health and new requests answer 503, and SIGTERM still exits 0."""
    import os
    import signal

    from dllm_ops.serve.spawn import ServerProcess
    server = ServerProcess(MODEL, SERVER_FLAGS, ready_timeout=WAIT)
    try:
        with http() as c:
            pid = c.get(server.url + "/health").json()["engine_pid"]
            with c.stream("POST", server.url + "/v1/completions", json=slow_body(stream=True)) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                os.kill(pid, signal.SIGKILL)
                rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
            err = json.loads(rest[-2][6:])["error"]
            assert err["code"] == "decode_failed" and "the engine process exited" in err["message"]
            health = c.get(server.url + "/health")
            assert health.status_code == 503 and health.json() == {"status": "engine_failed"}
            refused = c.post(server.url + "/v1/completions",
                             json={"model": MODEL, "prompt": "1 2", "max_tokens": 4})
            assert refused.status_code == 503
            assert "the engine is not running" in error_of(refused)["message"]
        assert server.terminate(WAIT) == 0
    finally:
        server.kill()


def test_engine_thread_serves_the_same_answers(model):
    """``--engine-thread``: one process, the same answers."""
    from dllm_ops.serve.spawn import ServerProcess
    openai = pytest.importorskip("openai")
    with ServerProcess(MODEL, SERVER_FLAGS + ["--engine-thread"], ready_timeout=WAIT) as s:
        with http() as c:
            assert c.get(s.url + "/health").json() == {"status": "ok"}
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", timeout=WAIT, max_retries=0)
        prompt = suite_prompt(1)
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32)
        assert out.choices[0].text == expected(model, 32, prompt=prompt)[0]


# ---- the engine process on its own ------------------------------------------------------------

def engine_spec(**engine):
    from dllm_ops.serve.engine_process import EngineSpec
    return EngineSpec(model=MODEL, dtype="fp32", device="cpu", threads=1, engine=engine,
                      log_level="warning")


def test_engine_process_raises_the_engines_own_refusals(model):
    """What ``Engine.submit`` raises in the child is raised in the parent, with
    its class and fields; a load error is raised by ``start``."""
    from dllm_ops.errors import CheckpointError, DllmOpsError
    from dllm_ops.serve.admission import QueueFull, check_request
    from dllm_ops.serve.engine_process import EngineProcess, EngineSpec
    from dllm_ops.serve.requests import Request
    config = server_defaults().replace(shape=server_defaults().shape.replace(gen_length=16))
    with pytest.raises(CheckpointError, match="nowhere"):
        EngineProcess(EngineSpec(model="/nowhere/at/all")).start()
    engine = EngineProcess(engine_spec(max_queue=0))
    assert engine.metric_families() == []          # not started: nothing to read
    engine.start()
    try:
        with pytest.raises(ServeError) as e:
            engine.submit(Request(prompt_ids=[1, 2], config=config, max_tokens=17), print)
        assert (e.value.param, e.value.status) == ("max_tokens", 400)
        out_of_vocab = Request(prompt_ids=[model.config.vocab_size + 5], config=config, max_tokens=16)
        with pytest.raises(DllmOpsError) as e:     # the decode's own check, its own class
            engine.submit(out_of_vocab, print)
        with pytest.raises(DllmOpsError) as here:
            check_request(model, out_of_vocab, None)
        assert type(e.value) is type(here.value) and str(e.value) == str(here.value)
        assert not isinstance(here.value, ServeError)
        with pytest.raises(QueueFull) as e:        # max_queue 0: every request
            engine.submit(Request(prompt_ids=[1, 2], config=config, max_tokens=16), print)
        assert e.value.status == 429 and e.value.retry_after >= 1
        names = {f.name for f in engine.metric_families()}
        assert "dllm_model_calls" in names and "dllm_queue_depth" in names
    finally:
        assert engine.shutdown(WAIT)
    assert not engine.alive
    with pytest.raises(ServeError, match="not running"):
        engine.submit(Request(prompt_ids=[1, 2], config=config, max_tokens=16), print)


def test_portable_error_keeps_what_pickles():
    from dllm_ops.errors import ConfigError
    from dllm_ops.serve.admission import QueueFull
    from dllm_ops.serve.engine_process import portable_error

    class NeedsAField(ServeError):
        def __init__(self, message, *, field):
            super().__init__(message, param=field, code="odd", status=409)

    kept = portable_error(QueueFull("full", retry_after=7.0))
    assert isinstance(kept, QueueFull) and kept.retry_after == 7.0
    assert isinstance(portable_error(ConfigError("bad")), ConfigError)
    rebuilt = portable_error(NeedsAField("odd one", field="x"))
    assert type(rebuilt) is ServeError and (rebuilt.param, rebuilt.code, rebuilt.status) == ("x", "odd", 409)
    assert str(rebuilt).endswith("odd one")
    bug = portable_error(type("Local", (RuntimeError,), {})("boom"))
    assert type(bug) is ServeError and bug.status == 500 and "Local: boom" in str(bug)


# ---- the app in-process over a real engine (faults, timeouts, draining) --------------------

def call_app(app, *requests):
    """``(method, path, json body)`` requests sent at once to the ASGI app; their responses."""
    import asyncio

    import httpx2

    async def go():
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://app",
                                      timeout=WAIT) as c:
            return await asyncio.gather(*(c.request(m, p, json=b) for m, p, b in requests))
    return asyncio.run(go())


class PlanFaultOnSub:
    """Builds the decoders of the suite's "sub" prompts with a dual cache whose
    second call's plan raises (a fault inside one sequence's decode)."""

    @staticmethod
    def engine(model, **kw):
        from dllm_ops.decode import Decoder
        from dllm_ops.policies import DualCache
        from dllm_ops.serve import Engine
        sub_id = model.tokenizer.convert_tokens_to_ids("sub")

        class FailingPlan(DualCache):
            calls = 0

            def _second_call_fails(self):
                self.calls += 1
                if self.calls == 2:
                    raise RuntimeError("a plan fault on purpose")

            def on_block_start(self, state):
                self._second_call_fails()
                return super().on_block_start(state)

            def plan(self, state):
                self._second_call_fails()
                return super().plan(state)

        class SubFaultEngine(Engine):
            def cohort_of(self, request):       # the sub prompts run their own Decoder
                return None if sub_id in request.prompt_ids else super().cohort_of(request)

            def build_decoder(self, request):
                if sub_id not in request.prompt_ids:
                    return super().build_decoder(request)
                return Decoder(self.model, [list(request.prompt_ids)], request.config, policy=FailingPlan())

        return SubFaultEngine(model, model.tokenizer, **kw)


def in_process_app(engine, metrics, **kw):
    from dllm_ops.serve.app import create_app
    return create_app(engine, engine.tokenizer, MODEL, server_defaults(), context_length=CONTEXT,
                      metrics=metrics, **kw)


def test_a_failed_sequence_gets_500_and_the_others_decode_on(model):
    from dllm_ops.serve import ServerMetrics
    metrics = ServerMetrics()
    engine = PlanFaultOnSub.engine(model, metrics=metrics)
    app = in_process_app(engine, metrics)
    engine.start()
    try:
        sub, other = suite_prompt(2), suite_prompt(0)
        assert sub.split(" ")[1] == "sub" and "sub" not in other
        bad, good = call_app(app, *[("POST", "/v1/completions", {"model": MODEL, "prompt": p,
                                                                 "max_tokens": 48}) for p in (sub, other)])
        assert bad.status_code == 500
        err = error_of(bad)
        assert err["type"] == "server_error" and err["code"] == "decode_failed"
        assert "a plan fault on purpose" in err["message"]
        assert good.status_code == 200 and good.json()["choices"][0]["text"] == expected(model, 48, prompt=other)[0]
        assert metrics.value("dllm_requests_total", status="500") == 1
        assert metrics.value("dllm_requests_total", status="200") == 1
        # draining: new requests and /health get 503
        app.state.serving.draining = True
        health, refused_ = call_app(app, ("GET", "/health", None),
                                    ("POST", "/v1/completions", {"model": MODEL, "prompt": other}))
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        assert refused_.status_code == 503 and error_of(refused_)["code"] == "draining"
    finally:
        assert engine.shutdown(WAIT)


def test_a_request_past_its_timeout_gets_504(model):
    from dllm_ops.serve import Engine, ServerMetrics
    metrics = ServerMetrics()
    engine = Engine(model, model.tokenizer, metrics=metrics)
    app = in_process_app(engine, metrics, request_timeout=0.2)
    engine.start()
    try:
        t0 = time.monotonic()
        (r,) = call_app(app, ("POST", "/v1/completions", slow_body()))
        assert r.status_code == 504 and time.monotonic() - t0 < 2.0   # the decode takes about 2 s
        assert error_of(r)["type"] == "timeout_error" and "timed out" in error_of(r)["message"]
        (ok,) = call_app(app, ("POST", "/v1/completions", {"model": MODEL, "prompt": "1 2", "max_tokens": 4}))
        assert ok.status_code == 200
    finally:
        engine.shutdown(WAIT)


# ---- serve --ray: the checks before Ray starts (the replicas: test_serve_ray.py) ----------

@pytest.mark.parametrize("flags,text", [
    (["--replicas", "0"], "--replicas must be at least 1"),
    (["--gpus-per-replica", "-1"], "must not be negative"),
    (["--gpus-per-replica", "1", "--device", "cpu"], "GPUs they never use"),
], ids=["zero-replicas", "negative-gpus", "gpus-on-cpu"])
def test_bad_replica_flags_are_refused_before_ray_starts(flags, text, capsys, monkeypatch):
    import sys

    from dllm_ops.cli import main
    monkeypatch.setitem(sys.modules, "ray", None)    # Ray must not even be imported
    assert main(["serve", "--model", MODEL, "--ray", *flags]) == 1
    err = capsys.readouterr().err
    assert text in err and len(err.strip().splitlines()) == 1


def test_ray_missing_says_how_to_install_it(capsys, monkeypatch):
    import sys

    from dllm_ops.cli import main
    monkeypatch.setitem(sys.modules, "ray", None)
    assert main(["serve", "--model", MODEL, "--ray", "--replicas", "2"]) == 1
    err = capsys.readouterr().err
    assert "pip install '.[ray]'" in err and len(err.strip().splitlines()) == 1
