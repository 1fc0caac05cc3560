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

import pytest

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
