"""The OpenAI-compatible HTTP API on FastAPI + uvicorn, and `msllm serve`.

    msllm serve [ARTIFACT] [--host 127.0.0.1] [--port 8000] [--model-name NAME]
                [--max-active 32] [--max-queue 256] [--drain-timeout 8]

Endpoints:
    POST /v1/completions        prompt (a string, or token ids) -> text
    POST /v1/chat/completions   messages rendered with the model's own chat template (a tokenizer.json
                                model's, as transformers' apply_chat_template renders it) or, for a model
                                trained here, the finetune stage's instruction template
                                (`tasks.stages.finetune.to_segments` / `encode_segments`), ending where the
                                response begins
    GET  /v1/models, /v1/models/{id}, /health

Parameters: model, max_tokens (chat: also max_completion_tokens), temperature (0 = greedy,
0..2), top_p, top_k, stop (a string or up to 4), seed, n (1 only), stream,
stream_options.include_usage. `usage` (prompt/completion/total tokens) is in every
response; a stream ends with a chunk that has the finish_reason and the usage, then
`data: [DONE]`. Defaults follow OpenAI: max_tokens 16 for completions and the rest of the
context for chat, temperature 1, top_p 1; without a seed sampling is not reproducible.

Completions prompts are encoded as in pretraining and `msllm predict` (`Tokenizer.prompt_ids`):
[EOS] + pieces for a SentencePiece model trained here (EOS is where documents start in the
training stream), the tokenizer's own encoding for a tokenizer.json model (as transformers).
Chat prompts start with the template, like the finetune examples.

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
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tasks.serving.engine import Busy, Engine, Sampling

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
    neutral = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},), "echo": (False,),
               "best_of": (1,), "suffix": ("",), "top_logprobs": (0,), "tools": ([],), "functions": ([],),
               "tool_choice": ("none", "auto"), "function_call": ("none", "auto"), "logprobs": (False, 0)}
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


def chat_prompt_ids(sp, messages: list[tuple[str, str]]) -> list[int]:
    """Token ids of a conversation rendered with the model's chat template (add_generation_prompt; encoded
    without added special tokens, as transformers' apply_chat_template) or, without one, the finetune stage's
    instruction template, ending where the assistant's answer begins (the same tokens as the training examples
    up to their response)."""
    from tasks.stages.finetune import encode_segments, to_segments

    if sp.chat_template is not None:
        return sp.encode(sp.render_chat([{"role": r, "content": c} for r, c in messages], add_generation_prompt=True))

    # to_segments wants an assistant turn to train on: add an empty one and drop it again.
    record = {"messages": [{"role": r, "content": c} for r, c in messages] + [{"role": "assistant", "content": ""}]}
    segments = to_segments(record, "messages")[:-1]
    return encode_segments(sp, segments, sp.eos_id())[0]


def completion_prompt_ids(sp, prompt: str) -> list[int]:
    """How pretraining, eval and `msllm predict` see the start of a document (`Tokenizer.prompt_ids`)."""
    return sp.prompt_ids(prompt)


class Parsed:
    """A validated request: prompt token ids, sampling, streaming options."""

    def __init__(self, prompt_ids: list[int], sampling: Sampling, stream: bool, include_usage: bool):
        self.prompt_ids, self.sampling, self.stream, self.include_usage = prompt_ids, sampling, stream, include_usage


def parse_request(body: Any, *, chat: bool, model_id: str, backend) -> Parsed:
    """Validate an OpenAI request body; ApiError naming the field on the first problem."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_type_name(body)}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required: the served model's id (GET /v1/models lists it)", "model")
    if model != model_id:
        raise ApiError(404, f"model '{model}' does not exist; this server serves '{model_id}'", "model",
                       code="model_not_found")
    _unsupported(body)
    _int(body, "n", 1, lo=1, hi=1, fix=" (one choice per request)")
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
            ids, field = chat_prompt_ids(sp, turns), "messages"
        except TokenizerError as exc:  # the model's template refused the conversation (e.g. its raise_exception)
            raise ApiError(400, f"messages: {exc}", "messages") from None
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = completion_prompt_ids(sp, prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < backend.vocab_size]
            if bad:
                raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary [0, {backend.vocab_size})",
                               "prompt")
            ids = list(prompt)
        elif isinstance(prompt, list) and len(prompt) > 1:
            raise ApiError(400, f"prompt: {len(prompt)} prompts in one request; send one prompt per request", "prompt")
        else:
            raise ApiError(400, f"prompt must be a string or an array of token ids, got {_type_name(prompt)}", "prompt")
        field = "prompt"
    if len(ids) >= ctx:
        raise ApiError(400, f"{field}: the prompt is {len(ids)} tokens but the model's context is {ctx} tokens, "
                            f"and at least one must be left for the completion; shorten the {field}", field,
                       code="context_length_exceeded")
    room = ctx - len(ids)
    mt_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, mt_name, room if chat else min(16, room), lo=1)
    if max_tokens > room:
        raise ApiError(400, f"{mt_name} is {max_tokens} but the model's context is {ctx} tokens and the prompt "
                            f"uses {len(ids)}; set {mt_name} to at most {room}", mt_name,
                       code="context_length_exceeded")
    top_k = _int(body, "top_k", None, lo=-1)
    seed = _int(body, "seed", None, lo=0, hi=2**63 - 1)
    sampling = Sampling(max_tokens=max_tokens, temperature=_float(body, "temperature", 1.0, 0.0, 2.0),
                        top_p=_float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True), top_k=top_k if top_k and top_k > 0
                        else None, seed=seed, stop=_stop(body))
    return Parsed(ids, sampling, stream, include_usage)


# ----------------------------------------------------------------------------- the app


def build_app(engine: Engine, model_id: str, artifact: Path | str) -> FastAPI:
    backend = engine.backend
    created = int(time.time())
    app = FastAPI(title="msllm", version="1", docs_url=None, redoc_url=None, openapi_url=None)

    def error(exc: ApiError, endpoint: str = "") -> JSONResponse:
        if endpoint:
            log.info("%s %d %s", endpoint, exc.status, exc.message)
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        msg = (f"no route {request.method} {request.url.path}; the API is under /v1 (completions, chat/completions, "
               f"models)") if exc.status_code == 404 else str(exc.detail)
        return error(ApiError(exc.status_code, msg), f"{request.method} {request.url.path}")

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))

    def model_card() -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "msllm",
                "backend": backend.kind, "context_length": backend.context_length, "artifact": str(artifact)}

    @app.get("/health")
    async def health():
        ok = engine.alive()
        return JSONResponse({"status": "ok" if ok else "stopping", "model": model_id, "backend": backend.kind,
                             "batched": engine.batched, "active": engine.active, "peak_active": engine.peak_active,
                             "queued": engine.queued()}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != model_id:
            return error(ApiError(404, f"model '{name}' does not exist; this server serves '{model_id}'", "model",
                                  code="model_not_found"), f"GET /v1/models/{name}")
        return model_card()

    async def handle(request: Request, chat: bool):
        endpoint = f"POST {request.url.path}"
        raw = await request.body()
        try:
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ApiError(400, f"the request body is not valid JSON ({exc}); send a JSON object with "
                                    f"Content-Type: application/json") from None
            p = parse_request(body, chat=chat, model_id=model_id, backend=backend)
            events: asyncio.Queue = asyncio.Queue()
            loop = asyncio.get_running_loop()

            def emit(ev: dict[str, Any]) -> None:  # called from the engine's thread
                try:
                    loop.call_soon_threadsafe(events.put_nowait, ev)
                except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
                    pass

            try:
                req = engine.submit(p.prompt_ids, p.sampling, emit)
            except Busy as exc:
                raise ApiError(503, str(exc), code="server_busy") from None
        except ApiError as exc:
            return error(exc, endpoint)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        meta = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": model_id}
        if p.stream:
            return StreamingResponse(_stream(req, events, meta, chat, p.include_usage, rid, endpoint),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, done = [], None
        try:
            while done is None:
                ev = await events.get()
                if ev["type"] == "token":
                    text.append(ev["text"])
                elif ev["type"] == "done":
                    done = ev
                else:
                    raise ApiError(500, ev["message"])
        except ApiError as exc:
            return error(exc, f"{endpoint} {rid}")
        finally:
            req.cancel()  # no-op when finished; stops the work when this handler was cancelled
        _log_done(rid, endpoint, done)
        text = "".join(text)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                   "finish_reason": done["finish_reason"]} if chat else
                  {"index": 0, "text": text, "logprobs": None, "finish_reason": done["finish_reason"]})
        return {**meta, "choices": [choice], "usage": _usage(done)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


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


async def _stream(req, events: asyncio.Queue, meta: dict[str, Any], chat: bool, include_usage: bool, rid: str,
                  endpoint: str) -> AsyncIterator[bytes]:
    meta = {**meta, "object": "chat.completion.chunk" if chat else "text_completion"}

    def chunk(text: str | None, finish: str | None = None, **extra: Any) -> bytes:
        if chat:
            delta = {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return _sse({**meta, "choices": [choice], **extra})

    finished = False
    tokens = 0
    try:
        if chat:
            yield _sse({**meta, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
        while True:
            ev = await events.get()
            if ev["type"] == "token":
                tokens += ev["tokens"]
                yield chunk(ev["text"])
            elif ev["type"] == "done":
                finished = True
                _log_done(rid, endpoint, ev)
                yield chunk(None, ev["finish_reason"], usage=_usage(ev))
                if include_usage:
                    yield _sse({**meta, "choices": [], "usage": _usage(ev)})
                break
            else:
                finished = True
                log.info("%s %s 500 %s", endpoint, rid, ev["message"])
                yield _sse(ApiError(500, ev["message"]).body())
                break
        yield b"data: [DONE]\n\n"
    finally:
        if not finished:
            req.cancel()
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
          max_active: int = 32, max_queue: int = 256, drain_timeout: float = 8.0, batching: bool = True) -> int:
    """Load the artifact, serve it until SIGTERM/SIGINT, drain, return 0."""
    import uvicorn

    from tasks.serving.backends import artifact_kind, load_backend

    artifact = Path(artifact).resolve()
    artifact_kind(artifact)  # a bad path fails here, before the model is loaded
    configure_logging()
    t0 = time.perf_counter()
    engine = Engine(lambda: load_backend(artifact), max_active=max_active, max_queue=max_queue, batching=batching)
    engine.start()
    b = engine.backend
    model_id = model_name or default_model_id(artifact)
    log.info("loaded %s on %s in %.1fs: model '%s', context %d tokens, vocabulary %d, %s of up to %d sequences",
             artifact, b.kind, time.perf_counter() - t0, model_id, b.context_length, b.vocab_size,
             "batched decoding" if engine.batched else "interleaved decoding", max_active)
    app = build_app(engine, model_id, artifact)
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
