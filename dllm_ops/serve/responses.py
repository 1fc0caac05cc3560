"""The OpenAI response bodies: whole answers, stream chunks, usage and errors."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

#: HTTP status -> OpenAI error ``type``
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 408: "timeout_error",
               429: "rate_limit_error", 500: "server_error", 503: "service_unavailable",
               504: "timeout_error"}


def error_body(message: str, *, status: int, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def sse(payload: dict | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


class ResponseShape:
    """A completion's or a chat completion's bodies for one request."""

    def __init__(self, *, chat: bool, request_id: str, model: str, include_usage: bool = False):
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def body(self, text: str, finish_reason: str, usage: Usage) -> dict:
        """The whole (non-streamed) answer."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("chat.completion" if self.chat else "text_completion"),
                "choices": [choice], "usage": usage.to_dict()}

    def chunk(self, text: str | None, finish_reason: str | None = None, *, first: bool = False) -> dict:
        """A stream chunk: a text delta, or the closing one with ``finish_reason``."""
        if self.chat:
            delta = {"role": "assistant"} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: Usage) -> dict:
        """The chunk before ``[DONE]`` under ``stream_options.include_usage``."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage.to_dict()}
