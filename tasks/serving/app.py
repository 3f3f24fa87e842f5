"""The OpenAI-compatible HTTP API on FastAPI + uvicorn, and `msllm serve`.

    msllm serve [ARTIFACT] [--host 127.0.0.1] [--port 8000] [--model-name NAME]
                [--max-active 32] [--max-queue 256] [--drain-timeout 8] [--adapter NAME=FINETUNE ...]

Each --adapter serves a LoRA finetune of ARTIFACT as its own `model` id (tasks/serving/adapters.py:
merged into the base, listed in /v1/models with `parent`/`base` and `adapter_mode: "merged"`).

Endpoints:
    POST /v1/completions        prompt (a string, or token ids) -> text
    POST /v1/chat/completions   messages rendered with the model's own chat template (a tokenizer.json
                                model's, as transformers' apply_chat_template renders it) or, for a model
                                trained here, the finetune stage's instruction template
                                (`tasks.prompts.chat_prompt_ids`), ending where the
                                response begins
    GET  /v1/models, /v1/models/{id}, /health
    GET  /metrics               Prometheus text format (tasks/serving/metrics.py, a registry per app)
    POST /tokenize, /detokenize, GET /tokenizer_info   vLLM's tokenizer endpoints (lm-eval's remote tokenizer)

Parameters: model, max_tokens (chat: also max_completion_tokens), temperature (0 = greedy,
0..2), top_p, top_k, stop (a string or up to 4), seed, n (1..16; choice j samples with seed + j),
stream, stream_options.include_usage; completions: echo, logprobs (0..20); chat: logprobs,
top_logprobs (0..20). A completions prompt may be an array (strings or token-id arrays): one choice
per prompt and per n, `index` in that order. `usage` (prompt/completion/total tokens) is in every
response; a stream ends with a chunk that has the finish_reason and the usage, then
`data: [DONE]`. Defaults follow OpenAI: max_tokens 16 for completions and the rest of the
context for chat, temperature 1, top_p 1; without a seed sampling is not reproducible.

Completions prompts, strings and token ids alike, are conditioned on the document prefix first
(`completion_prompt`: [EOS] for a SentencePiece model trained here, EOS being where documents start in the
training stream; a tokenizer.json model's BOS where its tokenizer adds one), as pretraining, eval and
`msllm predict` see a document; echo and prompt logprobs cover the client's part. Chat prompts start
with the template, like the finetune examples.

Errors use OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the
request field in `param` and in the message: 400 for a malformed body or a bad field
(also a prompt longer than the context, or max_tokens past it), 404 for an unknown
model or route, 503 when the queue is full or the server is draining, 500 if the model
fails on a request (the server goes on). One log line per request (stderr): tokens in and
out, queue wait, time to first token, tokens/s.

SIGTERM (or Ctrl-C): uvicorn stops accepting connections, the requests in flight (and
those queued behind them) finish, then the process exits 0; whatever is still running
after --drain-timeout seconds is cut.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import signal
import sys
import time
import uuid
from pathlib import Path
from dataclasses import replace
from typing import Any, AsyncIterator, Collection, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tasks.serving.adapters import AdapterSpec
from tasks.serving.engine import Busy, Engine, LogProb, Sampling

log = logging.getLogger("msllm.serve")

MAX_STOP = 4  # OpenAI's limit on stop sequences


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ----------------------------------------------------------------------------- request fields


def _type_name(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number")


def _int(body: dict, name: str, default: int | None = None, *, lo: int | None = None, hi: int | None = None,
         fix: str = "") -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"{name} must be an integer, got {_type_name(v)}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise ApiError(400, f"{name} must be {rng}, got {v}{fix}", name)
    return v


def _float(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ApiError(400, f"{name} must be a finite number, got {v if isinstance(v, float) else _type_name(v)}", name)
    if v < lo or v > hi or (lo_open and v == lo):
        rng = f"above {lo:g} and at most {hi:g}" if lo_open else f"between {lo:g} and {hi:g}"
        raise ApiError(400, f"{name} must be {rng}, got {v}", name)
    return float(v)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"{name} must be true or false, got {_type_name(v)}", name)
    return v


def _unsupported(body: dict) -> None:
    """Fields whose non-default values this server cannot honour: refused, never silently ignored."""
    neutral = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},),
               "best_of": (1,), "suffix": ("",), "tools": ([],), "functions": ([],),
               "tool_choice": ("none", "auto"), "function_call": ("none", "auto")}
    for name, ok in neutral.items():
        v = body.get(name)
        if v is not None and not any(v == o and type(v) is type(o) for o in ok):
            raise ApiError(400, f"{name} is not supported by this server; remove it", name)
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise ApiError(400, "response_format: only {\"type\": \"text\"} is supported by this server", "response_format")


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, f"stop must be a string or an array of strings, got {_type_name(v)}", "stop")
    if len(stops) > MAX_STOP:
        raise ApiError(400, f"stop has {len(stops)} sequences; at most {MAX_STOP} are allowed", "stop")
    return [s for s in stops if s]


def _message_text(m: Any, j: int) -> tuple[str, str]:
    """(role, text) of messages[j]; content may be a string or an array of text parts."""
    where = f"messages[{j}]"
    if not isinstance(m, dict):
        raise ApiError(400, f"{where} must be an object with 'role' and 'content', got {_type_name(m)}", where)
    role = m.get("role")
    role = "system" if role == "developer" else role
    if role not in ("system", "user", "assistant"):
        raise ApiError(400, f"{where}.role must be 'system', 'user' or 'assistant', got {role!r}", f"{where}.role")
    content = m.get("content")
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ApiError(400, f"{where}.content[{k}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                    f"are supported", f"{where}.content[{k}]")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise ApiError(400, f"{where}.content must be a string or an array of text parts, got {_type_name(content)}",
                       f"{where}.content")
    return role, content


def document_prefix(tok) -> list[int] | None:
    """The ids a document starts with before its text: what `Tokenizer.prompt_ids` puts before `encode` ([EOS] for a
    SentencePiece model trained here, BOS for a tokenizer.json whose post-processor adds one, [] for SmolLM2).
    None when prompt_ids is not `prefix + encode(text)` (then string prompts use prompt_ids as they are)."""
    probe = "The document starts"
    p, e = tok.prompt_ids(probe), tok.encode(probe)
    k = len(p) - len(e)
    return list(p[:k]) if k >= 0 and list(p[k:]) == list(e) else None


def completion_prompt(tok, prefix: list[int] | None, prompt: str | list[int]) -> tuple[list[int], int]:
    """(the ids the model is conditioned on, the index where the client's own prompt starts there).

    One rule for strings and token ids: the model sees the document prefix, then the prompt. A string is
    `prefix + encode(text)` (= `prompt_ids`, how pretraining, eval and `msllm predict` see a document start); token
    ids get the same prefix unless they already start with it. The prefix is conditioning, not prompt: echo and
    prompt logprobs cover the client's part only, so the first echoed token is scored after the prefix, and
    lm-eval's `local-completions` (which tokenizes without special tokens and sends ids) reads its context length
    from the tokens it sent."""
    if isinstance(prompt, str):
        if prefix is None:
            return list(tok.prompt_ids(prompt)), 0
        return prefix + list(tok.encode(prompt)), len(prefix)
    ids = [int(t) for t in prompt]
    if prefix and ids[:len(prefix)] != prefix:
        return prefix + ids, len(prefix)
    return ids, 0


def completion_prompt_ids(sp, prompt: str) -> list[int]:
    """How pretraining, eval and `msllm predict` see the start of a document (`Tokenizer.prompt_ids`)."""
    return sp.prompt_ids(prompt)


MAX_LOGPROBS = 20  # alternatives per position (OpenAI's top_logprobs limit)
MAX_N = 16  # choices per prompt


class Prompt:
    """One prompt of a request: conditioning ids, where the client's part starts, and its text (for echo)."""

    def __init__(self, ids: list[int], start: int, text: str | None):
        self.ids, self.start, self.text = ids, start, text


class Parsed:
    """A validated request: prompts, choices per prompt, sampling, streaming and logprobs options."""

    def __init__(self, prompts: list[Prompt], sampling: Sampling, stream: bool, include_usage: bool, *, n: int = 1,
                 echo: bool = False, logprobs: int | None = None, model: str = ""):
        self.prompts, self.sampling, self.stream, self.include_usage = prompts, sampling, stream, include_usage
        self.n, self.echo, self.logprobs, self.model = n, echo, logprobs, model

    @property
    def prompt_ids(self) -> list[int]:  # the first prompt's ids (one-prompt callers)
        return self.prompts[0].ids

    def jobs(self) -> list[tuple[Prompt, Sampling]]:
        """(prompt, sampling) of each choice in OpenAI's order (prompt by prompt, n each). Choice j of a prompt
        samples with seed + j, so n seeded choices differ from each other and each is reproducible."""
        out = []
        for p in self.prompts:
            for j in range(self.n):
                seed = None if self.sampling.seed is None else (self.sampling.seed + j) % 2**63
                out.append((p, replace(self.sampling, seed=seed, echo_from=p.start if self.echo else None)))
        return out


def requested_model(body: Any, served: Collection[str]) -> str:
    """The `model` field, checked against the served ids (404 naming them)."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_type_name(body)}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required: the served model's id (GET /v1/models lists it)", "model")
    if model not in served:
        names = ", ".join(f"'{m}'" for m in served)
        raise ApiError(404, f"model '{model}' does not exist; this server serves {names}", "model",
                       code="model_not_found")
    return model


def _logprob_fields(body: dict, chat: bool) -> tuple[bool, int | None]:
    """(echo, alternatives per position or None for no logprobs)."""
    if chat:
        if body.get("echo") is not None:
            raise ApiError(400, "echo is not supported with chat completions (it is a /v1/completions field); "
                                "remove it", "echo")
        want = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
        if top is not None and not want:
            raise ApiError(400, "top_logprobs requires logprobs: true", "top_logprobs")
        return False, (top or 0) if want else None
    echo = _bool(body, "echo")
    lp = _int(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS)
    top = _int(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)  # vLLM's spelling; logprobs wins when both given
    return echo, lp if lp is not None else top


def _prompts(body: dict, backend, prefix: list[int] | None) -> list[Prompt]:
    sp, vocab = backend.tokenizer, backend.vocab_size

    def is_ids(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

    def one(v: Any, where: str) -> Prompt:
        if isinstance(v, str):
            ids, start = completion_prompt(sp, prefix, v)
            text = v
        elif is_ids(v):
            bad = [t for t in v if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"{where}: token id {bad[0]} is outside the vocabulary [0, {vocab})", where)
            ids, start = completion_prompt(sp, prefix, v)
            text = None  # decoded when echoed
        else:
            raise ApiError(400, f"{where} must be a string or an array of token ids, got {_type_name(v)}", where)
        if not ids:
            raise ApiError(400, f"{where} is empty and this model has no document prefix to start from", where)
        return Prompt(ids, start, text)

    prompt = body.get("prompt")
    if isinstance(prompt, str) or is_ids(prompt):
        return [one(prompt, "prompt")]
    if isinstance(prompt, list) and prompt:
        return [one(v, f"prompt[{i}]") for i, v in enumerate(prompt)]
    raise ApiError(400, f"prompt must be a string, an array of token ids, or a non-empty array of either, got "
                        f"{_type_name(prompt) if prompt != [] else 'an empty array'}", "prompt")


def parse_request(body: Any, *, chat: bool, model_id: str | Collection[str], backend,
                  prefix: list[int] | None = None) -> Parsed:
    """Validate an OpenAI request body; ApiError naming the field on the first problem."""
    model = requested_model(body, [model_id] if isinstance(model_id, str) else model_id)
    _unsupported(body)
    n = _int(body, "n", 1, lo=1, hi=MAX_N)
    echo, logprobs = _logprob_fields(body, chat)
    stream = _bool(body, "stream")
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(so, dict):
            raise ApiError(400, f"stream_options must be an object, got {_type_name(so)}", "stream_options")
        include_usage = _bool(so, "include_usage")

    sp, ctx = backend.tokenizer, backend.context_length
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "messages must be a non-empty array of {role, content} objects", "messages")
        turns = [_message_text(m, j) for j, m in enumerate(msgs)]
        if turns[-1][0] != "user":
            j = len(turns) - 1
            raise ApiError(400, f"messages[{j}].role is '{turns[-1][0]}'; the last message must be the user's "
                                f"(the model answers it)", f"messages[{j}].role")
        from tasks.tokenizer import TokenizerError

        try:
            from tasks.prompts import chat_prompt_ids

            prompts, field = [Prompt(chat_prompt_ids(sp, turns), 0, None)], "messages"
        except TokenizerError as exc:  # the model's template refused the conversation (e.g. its raise_exception)
            raise ApiError(400, f"messages: {exc}", "messages") from None
    else:
        prompts = _prompts(body, backend, prefix)
        field = "prompt"
    longest = max(prompts, key=lambda p: len(p.ids))
    where = field if len(prompts) == 1 else f"{field}[{prompts.index(longest)}]"
    n_ids = len(longest.ids)
    if n_ids > ctx or (n_ids == ctx and not echo):
        raise ApiError(400, f"{where}: the prompt is {n_ids} tokens but the model's context is {ctx} tokens, "
                            f"and at least one must be left for the completion; shorten the {field}", where,
                       code="context_length_exceeded")
    room = ctx - n_ids
    mt_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, mt_name, room if chat else min(16, room), lo=0 if echo else 1,
                      fix="" if chat or echo else " (0 only with echo: true)")
    if max_tokens > room:
        raise ApiError(400, f"{mt_name} is {max_tokens} but the model's context is {ctx} tokens and the prompt "
                            f"uses {n_ids}; set {mt_name} to at most {room}", mt_name,
                       code="context_length_exceeded")
    top_k = _int(body, "top_k", None, lo=-1)
    seed = _int(body, "seed", None, lo=0, hi=2**63 - 1)
    sampling = Sampling(max_tokens=max_tokens, temperature=_float(body, "temperature", 1.0, 0.0, 2.0),
                        top_p=_float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True), top_k=top_k if top_k and top_k > 0
                        else None, seed=seed, stop=_stop(body), logprobs=logprobs)
    return Parsed(prompts, sampling, stream, include_usage, n=n, echo=echo, logprobs=logprobs, model=model)


# ----------------------------------------------------------------------------- logprobs in OpenAI's shapes

_WINDOW = 8  # tokens of context decoded with a token to find its text (a leading space survives)


class TokenText:
    """The text each token adds after the tokens before it (decoded with a few of them), and the special
    tokens' own pieces (they decode to nothing)."""

    def __init__(self, tok):
        self.tok = tok
        self.special = {i for i in (tok.eos_id(), tok.bos_id(), tok.pad_id()) if i is not None and i >= 0}

    def after(self, head: Sequence[int], t: int) -> str:
        if t in self.special:
            return self.tok.id_to_piece(t)
        head = [h for h in head[-_WINDOW:] if h not in self.special]
        if not head:
            return self.tok.decode([t])
        a, b = self.tok.decode(head), self.tok.decode(head + [t])
        return b[len(a):] if b.startswith(a) else self.tok.decode([t])

    def run(self, context: Sequence[int], ids: Sequence[int]) -> list[str]:
        full = list(context) + list(ids)
        c = len(context)
        return [self.after(full[max(0, c + i - _WINDOW):c + i], t) for i, t in enumerate(ids)]


def completion_logprobs(tt: TokenText, context: Sequence[int], entries: Sequence[LogProb], offset: int,
                        k: int) -> dict[str, Any]:
    """OpenAI's completions `logprobs` for `entries` (tokens after `context`): tokens, token_logprobs,
    top_logprobs (the k most likely plus the chosen token, as OpenAI: up to k + 1; None where the logprob is None),
    text_offset (from `offset`)."""
    ids = [e.token for e in entries]
    texts = tt.run(context, ids)
    full = list(context) + ids
    tops, offsets = [], []
    for i, (e, text) in enumerate(zip(entries, texts)):
        offsets.append(offset)
        offset += len(text)
        if e.logprob is None:
            tops.append(None)
            continue
        head = full[max(0, len(context) + i - _WINDOW):len(context) + i]
        top: dict[str, float] = {}
        for t, lp in e.top[:k]:
            top.setdefault(tt.after(head, t), lp)
        top.setdefault(text, e.logprob)
        tops.append(top)
    return {"tokens": texts, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(tt: TokenText, context: Sequence[int], entries: Sequence[LogProb], k: int) -> list[dict[str, Any]]:
    """OpenAI's chat `logprobs.content`: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""
    ids = [e.token for e in entries]
    texts = tt.run(context, ids)
    full = list(context) + ids
    out = []
    for i, (e, text) in enumerate(zip(entries, texts)):
        head = full[max(0, len(context) + i - _WINDOW):len(context) + i]
        alts = [(tt.after(head, t), lp) for t, lp in e.top[:k]]
        out.append({"token": text, "logprob": e.logprob, "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [{"token": a, "logprob": lp, "bytes": list(a.encode("utf-8"))} for a, lp in alts]})
    return out


# ----------------------------------------------------------------------------- the app


class Served:
    """One model id of the server: its engine, the engine's name for its backend (None: the engine's default
    model), the artifact it came from, extra /v1/models fields (an adapter's `base`, `adapter_mode`, ...)."""

    def __init__(self, engine: Engine, artifact: Path | str, model: str | None = None, **card: Any):
        self.engine, self.artifact, self.card = engine, artifact, card
        self.model = engine.default_model if model is None else model
        self.backend = engine.backends[self.model]
        self.prefix = document_prefix(self.backend.tokenizer)
        self.text = TokenText(self.backend.tokenizer)

    def submit(self, prompt_ids: list[int], sampling: Sampling, emit):
        return self.engine.submit(prompt_ids, sampling, emit, model=self.model)

    def queued(self) -> int:
        return self.engine.queued(self.model)

    def running(self) -> int:
        return self.engine.running(self.model)


def build_app(engine: Engine, model_id: str, artifact: Path | str, *, adapters: dict[str, Served] | None = None) -> FastAPI:
    """The app serving `engine`'s default model as `model_id`, and each of `adapters` (id -> Served, e.g.
    `Served(engine, merged, model="a", base=model_id, adapter_mode="merged")`) as its own model id."""
    from fastapi.responses import Response

    from tasks.serving.metrics import ServerMetrics

    served: dict[str, Served] = {model_id: Served(engine, artifact), **(adapters or {})}
    backend = engine.backend
    created = int(time.time())
    app = FastAPI(title="msllm", version="1", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServerMetrics(backend.kind, served)
    app.state.metrics = metrics

    def error(exc: ApiError, endpoint: str = "") -> JSONResponse:
        if endpoint:
            log.info("%s %d %s", endpoint, exc.status, exc.message)
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.middleware("http")
    async def _count(request: Request, call_next):
        response = await call_next(request)
        # the served model a completions/chat request named (set by `handle`); "" elsewhere and for unknown ids
        metrics.request(request.url.path, response.status_code, getattr(request.state, "model", ""))
        return response

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        msg = (f"no route {request.method} {request.url.path}; the API is under /v1 (completions, chat/completions, "
               f"models)") if exc.status_code == 404 else str(exc.detail)
        return error(ApiError(exc.status_code, msg), f"{request.method} {request.url.path}")

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))

    def model_card(name: str) -> dict[str, Any]:
        sv = served[name]
        return {"id": name, "object": "model", "created": created, "owned_by": "msllm", "backend": sv.backend.kind,
                "context_length": sv.backend.context_length, "artifact": str(sv.artifact), **sv.card}

    @app.get("/health")
    async def health():
        ok = all(sv.engine.alive() for sv in served.values())
        return JSONResponse({"status": "ok" if ok else "stopping", "model": model_id, "models": list(served),
                             "backend": backend.kind,
                             "batched": engine.batched, "active": engine.active, "peak_active": engine.peak_active,
                             "queued": engine.queued()}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus():
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(m) for m in served]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name not in served:
            return error(ApiError(404, f"model '{name}' does not exist; this server serves "
                                       f"{', '.join(repr(m) for m in served)}", "model", code="model_not_found"),
                         f"GET /v1/models/{name}")
        return model_card(name)

    # ---- vLLM's tokenizer endpoints: lm-eval's `local-completions` finds them (tokenizer_backend=auto or
    # remote) and tokenizes with the server's own tokenizer, so its token ids are the server's.

    tok = backend.tokenizer
    doc_start = served[model_id].prefix

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        def piece(i: int) -> str | None:
            return tok.id_to_piece(i) if i is not None and i >= 0 else None

        # bos_token: the token a document starts with, which lm-eval puts before an empty context (its
        # prefix_token_id): the document prefix where there is one ([EOS] for a SentencePiece model trained here,
        # whose training stream never holds BOS), else the tokenizer's BOS.
        bos = doc_start[0] if doc_start else tok.bos_id()
        return {"tokenizer_class": tok.kind, "eos_token": piece(tok.eos_id()), "bos_token": piece(bos),
                "pad_token": piece(tok.pad_id()), "unk_token": piece(tok.unk_id()), "chat_template": tok.chat_template,
                "model_max_length": backend.context_length, "document_prefix": doc_start}

    def encode_text(text: str, add_special_tokens: bool) -> list[int]:
        specials = {tok.id_to_piece(i): i for i in (tok.eos_id(), tok.bos_id(), tok.pad_id(), tok.unk_id()) if i >= 0}
        if text in specials:  # a special token's own text is that token (as HF tokenizers parse it)
            return [specials[text]]
        return completion_prompt(tok, doc_start, text)[0] if add_special_tokens else list(tok.encode(text))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        try:
            body = await _json_body(request)
            text = body.get("prompt")
            if not isinstance(text, str):
                raise ApiError(400, f"prompt must be a string, got {_type_name(text)}", "prompt")
            ids = encode_text(text, _bool(body, "add_special_tokens", True))
        except ApiError as exc:
            return error(exc, "POST /tokenize")
        return {"count": len(ids), "max_model_len": backend.context_length, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        try:
            body = await _json_body(request)
            ids = body.get("tokens")
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                    and 0 <= t < backend.vocab_size for t in ids):
                raise ApiError(400, f"tokens must be an array of token ids in [0, {backend.vocab_size})", "tokens")
        except ApiError as exc:
            return error(exc, "POST /detokenize")
        return {"prompt": tok.decode(ids)}

    # ---- completions and chat

    async def handle(request: Request, chat: bool):
        endpoint = f"POST {request.url.path}"
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        reqs: list = []
        try:
            body = await _json_body(request)
            name = requested_model(body, served)
            request.state.model = name
            sv = served[name]
            p = parse_request(body, chat=chat, model_id=name, backend=sv.backend, prefix=sv.prefix)
            jobs = p.jobs()

            def emitter(i: int):
                def emit(ev: dict[str, Any]) -> None:  # called from the engine's thread
                    try:
                        loop.call_soon_threadsafe(events.put_nowait, (i, ev))
                    except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
                        pass
                return emit

            try:
                for i, (prompt, sampling) in enumerate(jobs):
                    reqs.append(sv.submit(prompt.ids, sampling, emitter(i)))
            except Busy as exc:
                for r in reqs:
                    r.cancel()
                raise ApiError(503, str(exc), code="server_busy") from None
        except ApiError as exc:
            return error(exc, endpoint)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        meta = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": name}
        fmt = _Choices(sv, p, jobs, chat)
        if p.stream:
            return StreamingResponse(_stream(reqs, events, meta, fmt, p.include_usage, rid, endpoint, metrics, name),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        texts: list[list[str]] = [[] for _ in jobs]
        done: list[dict[str, Any] | None] = [None] * len(jobs)
        try:
            while any(d is None for d in done):
                i, ev = await events.get()
                if ev["type"] == "token":
                    texts[i].append(ev["text"])
                elif ev["type"] == "done":
                    done[i] = ev
                    metrics.finished(name, ev)
                    _log_done(rid if len(jobs) == 1 else f"{rid}[{i}]", endpoint, ev)
                else:
                    raise ApiError(500, ev["message"])
        except ApiError as exc:
            return error(exc, f"{endpoint} {rid}")
        finally:
            for r in reqs:
                r.cancel()  # no-op when finished; stops the work when this handler was cancelled
        choices = [fmt.final(i, "".join(texts[i]), done[i]) for i in range(len(jobs))]
        return {**meta, "choices": choices, "usage": fmt.usage(done)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc}); send a JSON object with "
                            f"Content-Type: application/json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_type_name(body)}")
    return body


class _Choices:
    """The choices of one response in OpenAI's shapes (completions or chat; whole or streamed)."""

    def __init__(self, sv: Served, p: Parsed, jobs: list[tuple[Prompt, Sampling]], chat: bool):
        self.sv, self.p, self.jobs, self.chat = sv, p, jobs, chat
        self.sent = [0] * len(jobs)  # streamed: generated tokens whose logprobs went out
        self.offset = [0] * len(jobs)  # streamed: text offset of the next token

    def echo_text(self, i: int) -> str:
        prompt = self.jobs[i][0]
        if prompt.text is not None:
            return prompt.text
        return self.sv.backend.tokenizer.decode(prompt.ids[prompt.start:])

    def _completion_lp(self, i: int, prompt_lp: list[LogProb], gen_lp: list[LogProb], offset: int) -> dict[str, Any]:
        """Completions `logprobs` of echoed prompt tokens then generated ones, text offsets from `offset`."""
        prompt = self.jobs[i][0]
        k, tt = self.p.logprobs or 0, self.sv.text
        parts = []
        if prompt_lp:
            parts.append(completion_logprobs(tt, prompt.ids[:prompt.start], prompt_lp, offset, k))
            offset += sum(len(t) for t in parts[-1]["tokens"])
        if gen_lp:
            parts.append(completion_logprobs(tt, prompt.ids + [e.token for e in self.sent_before(i)], gen_lp, offset, k))
        return {key: [x for part in parts for x in part[key]]
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}

    def sent_before(self, i: int) -> list[LogProb]:
        return getattr(self, "_history", {}).get(i, [])

    def final(self, i: int, text: str, done: dict[str, Any]) -> dict[str, Any]:
        finish = done["finish_reason"]
        k = self.p.logprobs
        if self.chat:
            lp = None
            if k is not None:
                lp = {"content": chat_logprobs(self.sv.text, self.jobs[i][0].ids, done["logprobs"], k), "refusal": None}
            return {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                    "finish_reason": finish}
        if self.p.echo:
            echo = self.echo_text(i)
            text = echo + text
        lp = None
        if k is not None:
            lp = self._completion_lp(i, done["prompt_logprobs"] if self.p.echo else [], done["logprobs"], 0)
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}

    def usage(self, done: list[dict[str, Any] | None]) -> dict[str, int]:
        """Prompt tokens once per prompt (not per choice), completion tokens of every choice."""
        prompt = sum(len(p.ids) for p in self.p.prompts)
        completion = sum(d["completion_tokens"] for d in done if d is not None)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # ---- streamed

    def start_chunks(self) -> list[dict[str, Any]]:
        """What goes first: the assistant role (chat), the echoed prompt (completions with echo)."""
        out = []
        for i, (prompt, _) in enumerate(self.jobs):
            if self.chat:
                out.append({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})
        return out

    def chunk(self, i: int, text: str | None, entries: list[LogProb] | None, finish: str | None = None,
              prompt_lp: list[LogProb] | None = None, echo: str | None = None) -> dict[str, Any]:
        k = self.p.logprobs
        prompt = self.jobs[i][0]
        if self.chat:
            lp = None
            if k is not None and entries:
                ctx = prompt.ids + [e.token for e in self.sent_before(i)]
                lp = {"content": chat_logprobs(self.sv.text, ctx, entries, k), "refusal": None}
            if entries:
                self._history = getattr(self, "_history", {})
                self._history.setdefault(i, []).extend(entries)
            delta = {} if text is None else {"content": text}
            return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
        lp = None
        if k is not None and (entries or prompt_lp):
            lp = self._completion_lp(i, prompt_lp or [], entries or [], self.offset[i])
            if lp["tokens"]:
                self.offset[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
        if entries:
            self._history = getattr(self, "_history", {})
            self._history.setdefault(i, []).extend(entries)
        return {"index": i, "text": (echo or "") + (text or ""), "logprobs": lp, "finish_reason": finish}


def _usage(done: dict[str, Any]) -> dict[str, int]:
    return {"prompt_tokens": done["prompt_tokens"], "completion_tokens": done["completion_tokens"],
            "total_tokens": done["prompt_tokens"] + done["completion_tokens"]}


def _log_done(rid: str, endpoint: str, done: dict[str, Any]) -> None:
    out = done["completion_tokens"]
    rate = out / done["decode_s"] if done["decode_s"] > 0 else 0.0
    log.info("%s %s 200 in=%d out=%d ttft=%.3fs tok/s=%.1f queue=%.3fs total=%.3fs finish=%s", endpoint, rid,
             done["prompt_tokens"], out, done["ttft_s"], rate, done["queue_s"], done["total_s"], done["finish_reason"])


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


async def _stream(reqs: list, events: asyncio.Queue, meta: dict[str, Any], fmt: _Choices, include_usage: bool,
                  rid: str, endpoint: str, metrics, model: str) -> AsyncIterator[bytes]:
    meta = {**meta, "object": "chat.completion.chunk" if fmt.chat else "text_completion"}
    n = len(reqs)
    done: list[dict[str, Any] | None] = [None] * n
    echoed = [not (fmt.p.echo and not fmt.chat)] * n  # completions with echo: the prompt goes out first
    tokens = 0
    failed = False
    try:
        for c in fmt.start_chunks():
            yield _sse({**meta, "choices": [c]})
        while any(d is None for d in done):
            i, ev = await events.get()
            if ev["type"] == "error":
                failed = True
                log.info("%s %s 500 %s", endpoint, rid, ev["message"])
                yield _sse(ApiError(500, ev["message"]).body())
                break
            extra: dict[str, Any] = {}
            if not echoed[i] and ev["type"] in ("token", "done"):
                echoed[i] = True
                if ev["type"] == "token":  # the echoed prompt (and its logprobs) before the first token
                    yield _sse({**meta, "choices": [fmt.chunk(i, None, None, prompt_lp=ev.get("prompt_logprobs"),
                                                              echo=fmt.echo_text(i))]})
                else:
                    extra = {"echo": fmt.echo_text(i), "prompt_lp": ev.get("prompt_logprobs")}
            if ev["type"] == "token":
                tokens += ev["tokens"]
                yield _sse({**meta, "choices": [fmt.chunk(i, ev["text"], ev.get("logprobs"))]})
            else:
                done[i] = ev
                metrics.finished(model, ev)
                _log_done(rid if n == 1 else f"{rid}[{i}]", endpoint, ev)
                last = fmt.chunk(i, None, ev.get("unsent_logprobs"), ev["finish_reason"], **extra)
                yield _sse({**meta, "choices": [last], **({"usage": _usage(ev)} if n == 1 else {})})
        if not failed:
            if include_usage:
                yield _sse({**meta, "choices": [], "usage": fmt.usage(done)})
        yield b"data: [DONE]\n\n"
    finally:
        if failed or any(d is None for d in done):
            for r in reqs:
                r.cancel()
            if not failed:
                log.info("%s %s client went away after out=%d tokens", endpoint, rid, tokens)


# ----------------------------------------------------------------------------- running it


def default_model_id(artifact: Path) -> str:
    """`<stage>/<key>` of an artifact directory (what `msllm lineage` and --from take)."""
    return f"{artifact.parent.name}/{artifact.name}"


def configure_logging() -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("msllm.serve").setLevel(logging.INFO)


def serve(artifact: str | Path, host: str = "127.0.0.1", port: int = 8000, *, model_name: str | None = None,
          max_active: int = 32, max_queue: int = 256, drain_timeout: float = 8.0, batching: bool = True,
          adapters: Sequence[AdapterSpec] = (), store=None) -> int:
    """Load the artifact (and each adapter, merged: tasks/serving/adapters.py), serve until SIGTERM/SIGINT, drain,
    return 0. `store` resolves adapter references that are not directories."""
    import tempfile

    from tasks.serving.adapters import check_adapters
    from tasks.serving.backends import artifact_kind, load_backend

    artifact = Path(artifact).resolve()
    kind = artifact_kind(artifact)  # a bad path fails here, before the model is loaded
    model_id = model_name or default_model_id(artifact)
    checked = check_adapters(artifact, list(adapters), model_id, store)  # every --adapter error before any loading
    configure_logging()
    tmp = tempfile.TemporaryDirectory(prefix="msllm-serve-")  # adapters' ONNX files on an export base
    try:
        t0 = time.perf_counter()
        dirs = {a.name: a.model_dir(kind, artifact, Path(tmp.name)) for a in checked}
        loaders = {model_id: lambda: load_backend(artifact),
                   **{name: (lambda d=d: load_backend(d)) for name, d in dirs.items()}}
        engine = Engine(loaders, max_active=max_active, max_queue=max_queue, batching=batching)
        engine.start()
        b = engine.backend
        log.info("loaded %s on %s in %.1fs: model '%s', context %d tokens, vocabulary %d, %s of up to %d sequences",
                 artifact, b.kind, time.perf_counter() - t0, model_id, b.context_length, b.vocab_size,
                 "batched decoding" if engine.batched else "interleaved decoding", max_active)
        for a in checked:
            log.info("adapter '%s': %s (%s) merged into the base, served from %s", a.name, a.finetune_id, a.method,
                     dirs[a.name])
        served = {a.name: Served(engine, dirs[a.name], model=a.name, parent=model_id, base=model_id,
                                 adapter_mode="merged", finetune=a.finetune_id, method=a.method) for a in checked}
        return _run(build_app(engine, model_id, artifact, adapters=served), engine, host, port, drain_timeout)
    finally:
        tmp.cleanup()


def _run(app: FastAPI, engine: Engine, host: str, port: int, drain_timeout: float) -> int:
    """uvicorn until SIGTERM/SIGINT, then the drain; 0, or 1 when the server never started."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, access_log=False, log_config=None, lifespan="off",
                            timeout_graceful_shutdown=drain_timeout, timeout_keep_alive=5)
    server = uvicorn.Server(config)
    # uvicorn handles SIGTERM/SIGINT while it runs and re-raises the signal once it has drained; with the
    # default handler that re-raise would kill the process (exit -15) before the engine is stopped.
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        engine.stop()
    if not server.started:
        return 1  # uvicorn logged why (e.g. the port is in use)
    log.info("stopped")
    return 0
