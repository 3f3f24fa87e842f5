"""OpenAI request bodies as pydantic models, each bad field an ApiError in OpenAI's shape.

    req = parse_body(body, chat=False)          # CompletionRequest | ChatRequest, or ApiError naming the field

The models hold what a field may be on its own (types, ranges, at most 4 stop sequences, the fields this server
refuses rather than ignores); tasks/serving/parsing.py (`parse_request`) adds what depends on the model being
served (the tokenizer, the vocabulary, the context length). Every problem is an `ApiError` in OpenAI's shape, with
the request field in `param` and in the message (pydantic's first error, reworded: "n must be between 1 and 16, got
0"). Unknown fields (`user`, ...) are accepted and ignored, as OpenAI's clients send them.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from annotated_types import Ge, Gt, Le
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError, field_validator

MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_LOGPROBS = 20  # alternatives per position (OpenAI's top_logprobs limit)
MAX_N = 16  # choices per prompt


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, type_: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def type_name(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number"
    )


# ----------------------------------------------------------------------------- the models


def _whole(v: Any) -> Any:
    """JSON has one number type: 2.0 is an integer field's 2 (bools stay bools, and are refused)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


Int = int | None  # strict: no strings, no booleans; a whole float is its integer
Number = float | None  # finite; an integer is its float

# fields whose non-default values this server cannot honour: refused, never silently ignored
NEUTRAL: dict[str, tuple] = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "best_of": (1,),
    "suffix": ("",),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none", "auto"),
    "function_call": ("none", "auto"),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


class _Request(BaseModel):
    """The fields completions and chat share."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: StrictStr = Field(min_length=1)
    n: Int = Field(1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: Int = None  # its range depends on the context left and on echo: `parse_request`
    temperature: Number = Field(1.0, ge=0.0, le=2.0)
    top_p: Number = Field(1.0, gt=0.0, le=1.0)
    top_k: Int = Field(None, ge=-1)
    seed: Int = Field(None, ge=0, le=2**63 - 1)
    stop: StrictStr | list[StrictStr] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator(
        "n",
        "max_tokens",
        "top_k",
        "seed",
        "logprobs",
        "top_logprobs",
        "max_completion_tokens",
        mode="before",
        check_fields=False,
    )
    @classmethod
    def _integers(cls, v: Any) -> Any:
        return _whole(v)

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _numbers(cls, v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool):
            return float(v)
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError("not finite")
        return v

    def checks(self) -> None:
        """What the field types cannot say: refused fields, the stop count, stream_options only with stream."""
        extra = self.model_extra or {}
        for name, ok in NEUTRAL.items():
            v = extra.get(name)
            if v is not None and not any(v == o and type(v) is type(o) for o in ok):
                raise ApiError(400, f"{name} is not supported by this server; remove it", name)
        rf = self.response_format
        if rf is not None and rf.get("type") != "text":
            raise ApiError(400, 'response_format: only {"type": "text"} is supported by this server', "response_format")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise ApiError(400, f"stop has {len(self.stop)} sequences; at most {MAX_STOP} are allowed", "stop")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")

    @property
    def stops(self) -> list[str]:
        return [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop or []) if s]


class CompletionRequest(_Request):
    """POST /v1/completions: a prompt (text, token ids, or an array of either), echo and logprobs."""

    prompt: Any = None  # checked by `prompts` (its errors name the element: prompt[1])
    echo: StrictBool = False
    logprobs: Int = Field(None, ge=0, le=MAX_LOGPROBS)
    top_logprobs: Int = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's spelling; logprobs wins when both given

    @property
    def alternatives(self) -> int | None:
        return self.logprobs if self.logprobs is not None else self.top_logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]

    @property
    def turn(self) -> tuple[str, str]:
        """(role, text): developer is system; text parts are joined."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return ("system" if self.role == "developer" else self.role), text


class ChatRequest(_Request):
    """POST /v1/chat/completions: messages rendered with the model's prompt format, logprobs + top_logprobs."""

    messages: list[Message] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: Int = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: Int = None
    echo: Any = None  # a /v1/completions field: refused by `checks`

    def checks(self) -> None:
        super().checks()
        if self.echo is not None:
            raise ApiError(
                400, "echo is not supported with chat completions (it is a /v1/completions field); remove it", "echo"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs: true", "top_logprobs")
        j = len(self.messages) - 1
        if self.messages[-1].turn[0] != "user":
            raise ApiError(
                400,
                f"messages[{j}].role is '{self.messages[-1].turn[0]}'; the last message must be the "
                f"user's (the model answers it)",
                f"messages[{j}].role",
            )


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): text in, the server's token ids out."""

    model_config = ConfigDict(extra="allow", strict=True)
    prompt: StrictStr
    add_special_tokens: StrictBool = True


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's): token ids in, text out (ids checked against the vocabulary by the route)."""

    model_config = ConfigDict(extra="allow", strict=True)
    tokens: list[int]


# ----------------------------------------------------------------------------- pydantic's errors, OpenAI's shape


def _param(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[TextPart]", "list[str]", "function-after[", "TextPart") or "[" in str(part):
            continue  # the union branch pydantic tried, not a field
        else:
            out += ("." if out else "") + str(part)
    return out


def _bounds(model: type[BaseModel], name: str) -> tuple[float | None, float | None, bool]:
    """(lower bound, upper bound, lower bound exclusive) declared on a field."""
    field = model.model_fields.get(name)
    lo = hi = None
    open_ = False
    for m in field.metadata if field else ():
        if isinstance(m, Ge):
            lo = m.ge
        elif isinstance(m, Gt):
            lo, open_ = m.gt, True
        elif isinstance(m, Le):
            hi = m.le
    return lo, hi, open_


def _fmt(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def api_error(exc: ValidationError, model: type[BaseModel], body: dict[str, Any]) -> ApiError:
    """The first of pydantic's errors as an ApiError naming the field, in the words of the old hand checks."""
    errs = exc.errors()
    e = errs[0]
    loc = tuple(e["loc"])
    param = _param(loc) or "body"
    name = loc[0] if loc else ""
    value = e.get("input")
    kind = e["type"]
    if name == "model" and model is not TokenizeRequest:
        return ApiError(400, "model is required: the served model's id (GET /v1/models lists it)", "model")
    if name == "messages" and len(loc) == 1:
        return ApiError(400, "messages must be a non-empty array of {role, content} objects", "messages")
    if name == "messages" and len(loc) >= 3:
        j = loc[1]
        where, m = f"messages[{j}]", body["messages"][j]
        if loc[2] == "role":
            return ApiError(
                400, f"{where}.role must be 'system', 'user' or 'assistant', got {m.get('role')!r}", f"{where}.role"
            )
        content = m.get("content")
        parts = [x["loc"][4] for x in errs if len(x["loc"]) > 4 and tuple(x["loc"][:3]) == tuple(loc[:3])]
        if isinstance(content, list) and parts:
            return ApiError(
                400,
                f'{where}.content[{parts[0]}]: only text parts ({{"type": "text", "text": ...}}) are supported',
                f"{where}.content[{parts[0]}]",
            )
        return ApiError(
            400,
            f"{where}.content must be a string or an array of text parts, got {type_name(content)}",
            f"{where}.content",
        )
    if name == "messages":
        where = f"messages[{loc[1]}]"
        return ApiError(400, f"{where} must be an object with 'role' and 'content', got {type_name(value)}", where)
    if name == "stop":
        return ApiError(400, f"stop must be a string or an array of strings, got {type_name(body.get('stop'))}", "stop")
    if name == "stream_options" and len(loc) == 1:
        return ApiError(400, f"stream_options must be an object, got {type_name(value)}", "stream_options")
    if name == "response_format":
        return ApiError(400, 'response_format: only {"type": "text"} is supported by this server', "response_format")
    raw = body.get(name) if len(loc) == 1 else value
    ann = model.model_fields[name].annotation if name in model.model_fields else None
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        lo, hi, open_ = _bounds(model, name)
        rng = (
            f"at least {_fmt(lo)}"
            if hi is None
            else f"above {_fmt(lo)} and at most {_fmt(hi)}"
            if open_
            else f"between {_fmt(lo)} and {_fmt(hi)}"
        )
        return ApiError(400, f"{param} must be {rng}, got {raw}", param)
    if kind in ("bool_type",) or ann is bool:
        return ApiError(400, f"{param} must be true or false, got {type_name(raw)}", param)
    if ann == Number:
        return ApiError(
            400, f"{param} must be a finite number, got {raw if isinstance(raw, float) else type_name(raw)}", param
        )
    if ann == Int:
        return ApiError(400, f"{param} must be an integer, got {type_name(raw)}", param)
    if ann is str:
        return ApiError(400, f"{param} must be a string, got {type_name(raw)}", param)
    return ApiError(400, f"{param}: {e['msg']}", param)


def validate(model: type[BaseModel], body: Any):
    """`body` (a decoded JSON value) as `model`; ApiError naming the first bad field. null is the default."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type_name(body)}")
    try:
        return model.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        raise api_error(exc, model, body) from None


def parse_body(body: Any, *, chat: bool) -> CompletionRequest | ChatRequest:
    """The request body as its model (every field checked on its own); ApiError naming the first bad field."""
    req = validate(ChatRequest if chat else CompletionRequest, body)
    req.checks()
    return req
