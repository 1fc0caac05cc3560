"""The OpenAI request bodies the server accepts, checked and turned into decodes.

``POST /v1/completions`` and ``POST /v1/chat/completions`` take these fields
(anything else is refused with 400 naming it):

- ``model``: the served model's name (``GET /v1/models``);
- ``prompt`` (completions): a string, or a list of exactly one string;
  ``messages`` (chat): ``[{"role": "system"|"user"|"assistant", "content": str}]``,
  rendered with the tokenizer's chat template (``add_generation_prompt``);
- ``max_tokens`` (default 64; chat also ``max_completion_tokens``): the answer's
  length cap. The model decodes a region of ``max_tokens`` rounded up to whole
  blocks (``shape.block_length``, :func:`dllm_ops.config.region_length`) and
  the answer is cut at ``max_tokens`` tokens (finish_reason ``"length"``);
- ``temperature`` -> ``reveal.temperature``, ``seed`` -> ``shape.seed``
  (the server's defaults when absent);
- ``stop``: a string or up to 4 strings; the text is cut before the first one,
  finish_reason ``"stop"``, and the sequence stops decoding;
- ``n``: 1 only; ``stream``, ``stream_options.include_usage``;
- ``dllm`` (or ``dllm_ops``): a partial decode configuration in
  :meth:`DecodeConfig.to_dict` form (cache method, reuse, storage, reveal
  rule, ...), merged over the server's defaults with
  :func:`dllm_ops.config.merge`. Its ``shape.gen_length`` is refused (the
  region comes from ``max_tokens``), as is a field also given by its OpenAI
  name (``temperature``, ``seed``).

Every refusal is a :class:`dllm_ops.errors.ServeError` (400) carrying the HTTP
status and the OpenAI ``param`` it concerns.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..config import DecodeConfig, merge, region_length
from ..errors import ConfigError, ServeError

DEFAULT_MAX_TOKENS = 64
MAX_STOP_STRINGS = 4


class _Body(BaseModel):
    """JSON types as given (no "5" -> 5 coercion); unknown keys refused."""
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _DecodeRequest(_Body):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    dllm: dict | None = None
    dllm_ops: dict | None = None


class CompletionRequest(_DecodeRequest):
    prompt: str | list[str]


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatCompletionRequest(_DecodeRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


@dataclass(frozen=True)
class DecodeJob:
    """A checked request: what the engine decodes and how the answer is shaped."""
    prompt_ids: list[int]
    config: DecodeConfig
    max_tokens: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def _param(loc: tuple) -> str:
    return ".".join(str(p) for p in loc)


def _common_loc(locs: list[tuple]) -> tuple:
    """The field a value failed on: the common start of its errors' locations (a union
    reports one error per member, under the member's type name)."""
    out = []
    for parts in zip(*locs):
        if any(p != parts[0] for p in parts):
            break
        out.append(parts[0])
    return tuple(out)


def parse_body(data, kind: type[_DecodeRequest]) -> _DecodeRequest:
    """A decoded JSON body as ``kind``; unknown fields and wrong types -> ServeError."""
    if not isinstance(data, dict):
        raise ServeError(f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        unknown = [_param(err["loc"]) for err in errors if err["type"] == "extra_forbidden"]
        if unknown:
            raise ServeError(f"unknown field(s) {', '.join(repr(u) for u in unknown)}",
                               param=unknown[0], code="unknown_field") from None
        err = errors[0]
        where = _param(_common_loc([x["loc"] for x in errors if x["loc"][:1] == err["loc"][:1]]))
        if err["type"] == "missing":
            raise ServeError(f"{where}: required", param=where, code="missing_field") from None
        raise ServeError(f"{where}: {err['msg']} (got {err.get('input')!r})", param=where,
                           code="invalid_type") from None


def _stop_strings(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise ServeError(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stops)}", param="stop")
    if any(s == "" for s in stops):
        raise ServeError("stop: a stop string must not be empty", param="stop")
    return stops


def _vendor_tree(req: _DecodeRequest) -> tuple[str, dict]:
    if req.dllm is not None and req.dllm_ops is not None:
        raise ServeError("give the decode configuration as 'dllm' or 'dllm_ops', not both",
                           param="dllm_ops")
    name = "dllm_ops" if req.dllm_ops is not None else "dllm"
    return name, dict(req.dllm_ops if req.dllm_ops is not None else req.dllm or {})


def _given_twice(tree: dict, section: str, key: str) -> bool:
    return isinstance(tree.get(section), dict) and key in tree[section]


def decode_config(req: _DecodeRequest, defaults: DecodeConfig, max_tokens: int) -> DecodeConfig:
    """The server defaults, the vendor field merged over them, then ``temperature``,
    ``seed`` and the region for ``max_tokens``; a bad field -> ServeError naming it."""
    name, tree = _vendor_tree(req)
    if _given_twice(tree, "shape", "gen_length"):
        raise ServeError(f"{name}.shape.gen_length: the region comes from max_tokens (rounded up "
                           f"to whole blocks); set max_tokens", param=f"{name}.shape.gen_length")
    for field, section, key in (("temperature", "reveal", "temperature"), ("seed", "shape", "seed")):
        if getattr(req, field) is not None and _given_twice(tree, section, key):
            raise ServeError(f"{field} is given both as {field!r} and as {name}.{section}.{key}",
                               param=field)
    shape = tree.get("shape")
    block = shape.get("block_length", defaults.shape.block_length) \
        if isinstance(shape, dict) else defaults.shape.block_length
    if isinstance(block, int) and not isinstance(block, bool) and block > 0:   # else: merge names it
        tree["shape"] = {**(shape if isinstance(shape, dict) else {}),
                         "gen_length": region_length(max_tokens, block)}
    try:
        config = merge(defaults, tree)
    except ConfigError as e:
        path = _config_field(e)
        raise ServeError(f"{name}: {_bare(e)}", param=f"{name}.{path}" if path else name,
                         code="invalid_config") from None
    for field, section in (("temperature", "reveal"), ("seed", "shape")):
        value = getattr(req, field)
        if value is not None:
            try:
                config = merge(config, {section: {field: value}})
            except ConfigError as e:
                raise ServeError(f"{field}: {_bare(e)}", param=field, code="invalid_config") from None
    return config


def _bare(e: ConfigError) -> str:
    return str(e).removeprefix(f"{ConfigError.api}: ")


def _config_field(e: ConfigError) -> str | None:
    """The configuration path a ConfigError's message starts with (``cache.method = ...``)."""
    m = re.match(r"([A-Za-z_][\w.]*)(?: = |: )", _bare(e))
    return m.group(1) if m else None


def _max_tokens(req: _DecodeRequest) -> tuple[int, str]:
    chat_cap = getattr(req, "max_completion_tokens", None)
    if chat_cap is not None and req.max_tokens is not None:
        raise ServeError("give max_tokens or max_completion_tokens, not both",
                           param="max_completion_tokens")
    if chat_cap is not None:
        return chat_cap, "max_completion_tokens"
    return (DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens), "max_tokens"


def prompt_text(req: _DecodeRequest, tokenizer) -> tuple[str, str]:
    """``(text, param)``: the completion prompt, or the chat rendered by the template."""
    if isinstance(req, ChatCompletionRequest):
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False), "messages"
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise ServeError(f"prompt: one prompt per request (n=1), got a list of {len(prompt)}",
                               param="prompt")
        prompt = prompt[0]
    return prompt, "prompt"


def prepare(req: _DecodeRequest, tokenizer, defaults: DecodeConfig, context_length: int) -> DecodeJob:
    """A parsed request as a :class:`DecodeJob`: every check that needs no model call."""
    if req.n != 1:
        raise ServeError(f"n = {req.n}: only n = 1 is supported", param="n")
    if req.stream_options is not None and not req.stream:
        raise ServeError("stream_options is only allowed with stream: true", param="stream_options")
    stop = _stop_strings(req.stop)
    max_tokens, cap_name = _max_tokens(req)
    if max_tokens < 1:
        raise ServeError(f"{cap_name} = {max_tokens}: must be >= 1", param=cap_name)
    config = decode_config(req, defaults, max_tokens)
    region = config.shape.gen_length
    if region >= context_length:
        raise ServeError(f"{cap_name} = {max_tokens} (a region of {region} tokens in blocks of "
                           f"{config.shape.block_length}) leaves no room for a prompt in the "
                           f"model's context of {context_length}", param=cap_name)
    text, where = prompt_text(req, tokenizer)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ServeError(f"{where}: the prompt is empty", param=where)
    if len(ids) + region > context_length:
        raise ServeError(f"{where}: the prompt ({len(ids)} tokens) + {cap_name} = {max_tokens} "
                           f"rounded up to whole blocks ({region}) exceeds the model's context of "
                           f"{context_length} tokens", param=where, code="context_length_exceeded")
    return DecodeJob(prompt_ids=list(ids), config=config, max_tokens=max_tokens,
                     stop=stop, stream=req.stream,
                     include_usage=bool(req.stream_options and req.stream_options.include_usage))
