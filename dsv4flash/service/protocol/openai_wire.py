"""OpenAI's request and answer shapes for `/v1/completions`, `/v1/chat/completions` and `/v1/models`.

Requests are validated with pydantic against the fields this server implements; any other field is refused
(400 naming it), as is a field that asks for something it does not do (`echo`, penalties, tools), so a request
never silently decodes other than it asked. `top_k`, `stop_token_ids` and `return_tokens_as_token_ids` are the
extra-body fields vLLM's OpenAI server takes too. Errors answer `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from starlette.responses import JSONResponse

MAX_N = 64  # choices per request: each one is a decoded row
MAX_TOP_LOGPROBS = 20  # OpenAI's bound


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class _Sampling(_Strict):
    """The fields both endpoints share."""

    model: StrictStr
    n: StrictInt = 1
    temperature: float | None = None  # None: OpenAI's default, 1
    top_p: float | None = None
    top_k: StrictInt | None = None  # extra body (vLLM's name); -1 or 0: no limit
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: StrictStr | None = None  # accepted, unused
    return_tokens_as_token_ids: StrictBool = False


class CompletionRequest(_Sampling):
    """`POST /v1/completions`: a prompt as text, token ids, or a list of either."""

    prompt: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None


class ChatRequest(_Sampling):
    """`POST /v1/chat/completions`: messages rendered by the served tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None  # None: what the context leaves
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    parallel_tool_calls: Any = None


# Fields that ask for behaviour this server does not implement: (field, the values that mean "not asked").
_UNSUPPORTED = {"echo": (False,), "suffix": (None, ""), "presence_penalty": (None, 0, 0.0),
                "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "tools": (None, []),
                "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
                "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None,)}


def unsupported_field(req: BaseModel) -> str | None:
    """The first field of `req` asking for something this server does not do, else None."""
    for name, idle in _UNSUPPORTED.items():
        if name in type(req).model_fields and getattr(req, name) not in idle:
            return name
    if isinstance(req, CompletionRequest) and req.best_of is not None and req.best_of != req.n:
        return "best_of"
    return None


class OpenAIError(Exception):
    """An answer other than 200 in OpenAI's error shape; `param` names the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, *, retry: bool | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.retry = status, message, param, retry
        self.retry_after_s = retry_after_s  # a 429's Retry-After (None: RETRY_AFTER_S)


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "conflict_error", 410: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error"}
RETRY_AFTER_S = 1  # the Retry-After of a 429: a slot frees when one of the tenant's requests finishes


def error_body(status: int, message: str, param: str | None) -> dict:
    """OpenAI's error object."""
    code = "model_not_found" if status == 404 and param == "model" else None
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}}


def error_response(exc: OpenAIError) -> JSONResponse:
    """The JSON answer of an `OpenAIError` (429 with Retry-After; `retry=False` tells clients not to retry)."""
    headers = {}
    if exc.status == 429:
        headers["retry-after"] = str(max(1, math.ceil(exc.retry_after_s or RETRY_AFTER_S)))
    if exc.retry is not None:
        headers["x-should-retry"] = "true" if exc.retry else "false"
    return JSONResponse(error_body(exc.status, exc.message, exc.param), status_code=exc.status, headers=headers)


def sse(obj) -> bytes:
    """One server-sent event of a JSON object (or the literal `[DONE]`)."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def model_entry(entry: dict, base: str) -> dict:
    """A `/v1/models` row (vLLM's fields: `root` the revision, `parent` the base)."""
    return {"id": entry["id"], "object": "model", "created": entry["created"], "owned_by": entry["owned_by"],
            "root": entry["root"], "parent": None if entry["id"] == base else base}


_BYTE_TOKEN = re.compile(r"<0x([0-9A-F]{2})>")


class TokenText:
    """How answers spell tokens: the served tokenizer's text, or `token_id:<id>` (`return_tokens_as_token_ids`)."""

    def __init__(self, tokenizer, as_ids: bool) -> None:
        self.tokenizer, self.as_ids = tokenizer, as_ids
        self._bytes: dict[int, int | None] = {}

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token(self, tid: int) -> str:
        return f"token_id:{tid}" if self.as_ids else self.tokenizer.decode([tid], skip_special_tokens=False)

    def byte_of(self, tid: int) -> int | None:
        """The byte a byte-fallback token stands for, else None."""
        if tid not in self._bytes:
            m = _BYTE_TOKEN.fullmatch(self.tokenizer.convert_ids_to_tokens(tid) or "")
            self._bytes[tid] = int(m.group(1), 16) if m else None
        return self._bytes[tid]

    def token_bytes(self, tid: int) -> list[int]:
        byte = self.byte_of(tid)
        return [byte] if byte is not None else list(self.token(tid).encode())


def completion_logprobs(spell: TokenText, entries: list[tuple[int, float, list | None]], prefix: list[int]) -> dict:
    """The legacy completions `logprobs` object of some sampled tokens (`prefix`: the choice's ids before them)."""
    tokens, lps, tops, offsets = [], [], [], []
    ids = list(prefix)
    for tid, lp, top in entries:
        offsets.append(len(spell.text(ids)))
        ids.append(tid)
        tokens.append(spell.token(tid))
        lps.append(lp)
        tops.append(None if top is None else {spell.token(t): v for t, v in top})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(spell: TokenText, entries: list[tuple[int, float, list | None]]) -> dict:
    """The chat `logprobs` object (`content`: one row per sampled token, with its top alternatives)."""
    return {"content": [{"token": spell.token(tid), "logprob": lp, "bytes": spell.token_bytes(tid),
                         "top_logprobs": [{"token": spell.token(t), "logprob": v, "bytes": spell.token_bytes(t)}
                                          for t, v in (top or [])]} for tid, lp, top in entries]}


class ChoiceText:
    """One choice's answer as its tokens arrive: text is released once it cannot be the start of a stop sequence
    and ends outside a run of byte tokens, and a stop sequence the choice ended on (eos included) is cut, as
    OpenAI's API answers (the core's samples end with it). Streamed and whole answers are built the same way."""

    def __init__(self, spell: TokenText, stops: list[tuple[int, ...]]) -> None:
        self.spell, self.stops = spell, [tuple(q) for q in stops]
        self.entries: list[tuple[int, float, list | None]] = []  # (id, log-prob, top alternatives) per token
        self.sent = 0  # entries released
        self.text = ""  # text released

    def push(self, entries) -> tuple[str, list]:
        """Add sampled tokens -> (text now released, the entries it covers)."""
        self.entries.extend(entries)
        return self._release(len(self.entries) - self._held(), final=False)

    def finish(self, stopped: bool) -> tuple[str, list]:
        """The choice ended (`stopped`: on a stop sequence or eos) -> the rest of its text and entries."""
        end = len(self.entries)
        if stopped:
            ids = tuple(e[0] for e in self.entries)
            end -= max((len(q) for q in self.stops if ids[len(ids) - len(q):] == q), default=0)
        return self._release(end, final=True)

    def released_ids(self) -> list[int]:
        return [e[0] for e in self.entries[:self.sent]]

    def _held(self) -> int:
        """How many trailing tokens may yet be (or are) a stop sequence."""
        ids = [e[0] for e in self.entries]
        held = 0
        for q in self.stops:
            for k in range(min(len(q), len(ids)), held, -1):
                if tuple(ids[len(ids) - k:]) == q[:k]:
                    held = k
                    break
        return held

    def _release(self, end: int, final: bool) -> tuple[str, list]:
        # The decoder reads a run of byte tokens as one UTF-8 sequence (an invalid one as U+FFFD per byte), so text
        # is a stable prefix of the answer only at a boundary outside such a run.
        while not final and end > self.sent and self.spell.byte_of(self.entries[end - 1][0]) is not None:
            end -= 1
        if end <= self.sent:
            return "", []
        text = self.spell.text([e[0] for e in self.entries[:end]])
        delta = text[len(self.text):] if text.startswith(self.text) else text
        new, self.sent, self.text = self.entries[self.sent:end], end, text
        return delta, new
