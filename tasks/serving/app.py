"""The OpenAI-compatible HTTP API on FastAPI + uvicorn, and `msllm serve`: the routes.

Request bodies are pydantic models (tasks/serving/requests.py: their fields, ranges and errors), read and decoded
by tasks/serving/bodies.py and checked against the served model by tasks/serving/parsing.py; responses, logprobs
and the event stream are tasks/serving/streaming.py; the batching engine is tasks/serving/engine.py.

    msllm serve [ARTIFACT] [--host 127.0.0.1] [--port 8000] [--model-name NAME]
                [--max-active 32] [--max-queue 256] [--max-body-size 8MiB] [--drain-timeout 8]
                [--adapter NAME=FINETUNE ...]

Each --adapter serves a LoRA finetune of ARTIFACT as its own `model` id (tasks/serving/adapters.py), listed
in /v1/models with `parent`/`base` and `adapter_mode`: "unmerged" over a model artifact (one base network,
the adapter's A/B applied per sequence), "merged" over an export (a merged copy as its own ONNX decoder).

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
(also a prompt longer than the context, or max_tokens past it, more prompts × n than
--max-queue, a chat template past its time or size limit), 404 for an unknown model or
route, 413 for a body over --max-body-size (from Content-Length before keeping any of it, or
once a chunked body passes it), 503 when the queue is full or the server is draining (worth a retry), 500 if
the model fails on a request (the server goes on). One log line per request (stderr):
tokens in and out, queue wait, time to first token, tokens/s.

The event loop only moves bytes: decoding a body's JSON, tokenizing and rendering chat templates run in
worker threads (Starlette's thread pool; both tokenizer libraries release the GIL), so /health and
streams answer while a large request is tokenized.

SIGTERM (or Ctrl-C): uvicorn stops accepting connections, the requests in flight (and
those queued behind them) finish, then the process exits 0; whatever is still running
after --drain-timeout seconds is cut.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from tasks.serving.adapters import AdapterSpec, check_adapters
from tasks.serving.backends import MindSporeBackend, artifact_kind, load_backend
from tasks.serving.bodies import json_body, respond
from tasks.serving.connections import HEAD_TIMEOUT, head_deadline_protocol
from tasks.serving.engine import Busy, Engine, Sampling
from tasks.serving.metrics import ServerMetrics
from tasks.serving.parsing import completion_prompt, document_prefix, parse_request, requested_model
from tasks.serving.requests import ApiError, DetokenizeRequest, TokenizeRequest, validate
from tasks.serving.streaming import Choices, TokenText, log_done, stream_choices

log = logging.getLogger("msllm.serve")

# --max-body-size's default: the largest request body read. A prompt that fills SmolLM2's 8192-token context is
# ~35 KB as text and ~50 KB as token ids, so 8 MiB holds a prompt array of 160 of them, and the whole documents
# lm-eval sends to /tokenize for rolling loglikelihoods (wikitext's are under 100 KB).
MAX_BODY = 8 * 2**20


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


def build_app(
    engine: Engine,
    model_id: str,
    artifact: Path | str,
    *,
    adapters: dict[str, Served] | None = None,
    max_body: int = MAX_BODY,
) -> FastAPI:
    """The app serving `engine`'s default model as `model_id`, and each of `adapters` (id -> Served, e.g.
    `Served(engine, merged, model="a", base=model_id, adapter_mode="merged")`) as its own model id; request bodies
    of more than `max_body` bytes are a 413."""
    served: dict[str, Served] = {model_id: Served(engine, artifact), **(adapters or {})}
    app = FastAPI(title="msllm", version="1", docs_url=None, redoc_url=None, openapi_url=None)
    _add_metrics(app, engine, served)
    _add_error_handlers(app)
    _add_model_routes(app, engine, model_id, served)
    _add_tokenizer_routes(app, served[model_id], max_body)
    _add_generation_routes(app, served, max_body)
    return app


def _error(exc: ApiError, endpoint: str = "") -> JSONResponse:
    """An ApiError as OpenAI's error body (logged with the endpoint when one is named)."""
    if endpoint:
        log.info("%s %d %s", endpoint, exc.status, exc.message)
    return JSONResponse(exc.body(), status_code=exc.status)


def _add_metrics(app: FastAPI, engine: Engine, served: dict[str, Served]) -> None:
    """The app's metrics registry (app.state.metrics): each request counted by a middleware, each sequence by the
    engine, and GET /metrics."""
    metrics = ServerMetrics(engine.backend.kind, served)
    app.state.metrics = metrics
    # each sequence is recorded by the engine's worker thread as it ends (an abort too, which no handler sees)
    engine.listeners.append(metrics.listener({sv.model: name for name, sv in served.items()}))

    @app.middleware("http")
    async def _count(request: Request, call_next):
        response = await call_next(request)
        # the served model a completions/chat request named (set by `_generate`); "" elsewhere and for unknown ids
        metrics.request(request.url.path, response.status_code, getattr(request.state, "model", ""))
        return response

    @app.get("/metrics")
    async def prometheus():
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)


def _add_error_handlers(app: FastAPI) -> None:
    """Starlette's errors (an unknown route, ...) and any crash of a handler in OpenAI's error shape."""

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        msg = (
            (
                f"no route {request.method} {request.url.path}; the API is under /v1 (completions, chat/completions, "
                f"models)"
            )
            if exc.status_code == 404
            else str(exc.detail)
        )
        return _error(ApiError(exc.status_code, msg), f"{request.method} {request.url.path}")

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return _error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))


def _add_model_routes(app: FastAPI, engine: Engine, model_id: str, served: dict[str, Served]) -> None:
    """GET /health, /v1/models and /v1/models/{id}."""
    backend = engine.backend
    created = int(time.time())

    def model_card(name: str) -> dict[str, Any]:
        sv = served[name]
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "msllm",
            "backend": sv.backend.kind,
            "context_length": sv.backend.context_length,
            "artifact": str(sv.artifact),
            **sv.card,
        }

    @app.get("/health")
    async def health():
        ok = all(sv.engine.alive() for sv in served.values())
        return JSONResponse(
            {
                "status": "ok" if ok else "stopping",
                "model": model_id,
                "models": list(served),
                "backend": backend.kind,
                "decode": backend.decode_info,
                "batched": engine.batched,
                "active": engine.active,
                "peak_active": engine.peak_active,
                "queued": engine.queued(),
            },
            status_code=200 if ok else 503,
        )

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(m) for m in served]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name not in served:
            return _error(
                ApiError(
                    404,
                    f"model '{name}' does not exist; this server serves {', '.join(repr(m) for m in served)}",
                    "model",
                    code="model_not_found",
                ),
                f"GET /v1/models/{name}",
            )
        return model_card(name)


def _add_tokenizer_routes(app: FastAPI, sv: Served, max_body: int) -> None:
    """vLLM's tokenizer endpoints (GET /tokenizer_info, POST /tokenize, /detokenize) for the default model:
    lm-eval's `local-completions` finds them (tokenizer_backend=auto or remote) and tokenizes with the server's own
    tokenizer, so its token ids are the server's."""
    backend = sv.backend
    tok = backend.tokenizer
    doc_start = sv.prefix

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        def piece(i: int) -> str | None:
            return tok.id_to_piece(i) if i is not None and i >= 0 else None

        # bos_token: the token a document starts with, which lm-eval puts before an empty context (its
        # prefix_token_id): the document prefix where there is one ([EOS] for a SentencePiece model trained here,
        # whose training stream never holds BOS), else the tokenizer's BOS.
        bos = doc_start[0] if doc_start else tok.bos_id()
        return {
            "tokenizer_class": tok.kind,
            "eos_token": piece(tok.eos_id()),
            "bos_token": piece(bos),
            "pad_token": piece(tok.pad_id()),
            "unk_token": piece(tok.unk_id()),
            "chat_template": tok.chat_template,
            "model_max_length": backend.context_length,
            "document_prefix": doc_start,
        }

    def encode_text(text: str, add_special_tokens: bool) -> list[int]:
        specials = {tok.id_to_piece(i): i for i in (tok.eos_id(), tok.bos_id(), tok.pad_id(), tok.unk_id()) if i >= 0}
        if text in specials:  # a special token's own text is that token (as HF tokenizers parse it)
            return [specials[text]]
        return completion_prompt(tok, doc_start, text)[0] if add_special_tokens else list(tok.encode(text))

    def tokenized(body: Any) -> dict[str, Any]:
        req = validate(TokenizeRequest, body)
        ids = encode_text(req.prompt, req.add_special_tokens)
        return {"count": len(ids), "max_model_len": backend.context_length, "tokens": ids}

    def detokenized(body: Any) -> dict[str, Any]:
        try:
            ids = validate(DetokenizeRequest, body).tokens
        except ApiError:
            ids = None
        if ids is None or not all(0 <= t < backend.vocab_size for t in ids):
            raise ApiError(400, f"tokens must be an array of token ids in [0, {backend.vocab_size})", "tokens")
        return {"prompt": tok.decode(ids)}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        try:  # checked and tokenized in a worker thread
            return await respond(await run_in_threadpool(tokenized, await json_body(request, max_body)))
        except ApiError as exc:
            return _error(exc, "POST /tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request):
        try:
            return await respond(await run_in_threadpool(detokenized, await json_body(request, max_body)))
        except ApiError as exc:
            return _error(exc, "POST /detokenize")


def _add_generation_routes(app: FastAPI, served: dict[str, Served], max_body: int) -> None:
    """POST /v1/completions and /v1/chat/completions."""

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, served, max_body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, served, max_body, chat=True)


async def _generate(request: Request, served: dict[str, Served], max_body: int, chat: bool):
    """A completions or chat request: parsed (off the event loop), one engine sequence per prompt and choice, then
    the response, streamed or whole."""
    endpoint = f"POST {request.url.path}"
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    reqs: list = []
    try:
        body = await json_body(request, max_body)
        name = requested_model(body, served)
        request.state.model = name
        sv = served[name]
        # tokenizing (and rendering a chat template) off the event loop; more sequences than the queue ever
        # holds is a 400 before any of it
        p = await run_in_threadpool(
            lambda: parse_request(
                body, chat=chat, model_id=name, backend=sv.backend, prefix=sv.prefix, max_jobs=sv.engine.max_queue
            )
        )
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
        return _error(exc, endpoint)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    meta = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": name,
    }
    fmt = Choices(sv, p, jobs, chat)
    if p.stream:
        return StreamingResponse(
            stream_choices(reqs, events, meta, fmt, p.include_usage, rid, endpoint),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await _whole_response(reqs, events, meta, fmt, len(jobs), rid, endpoint)


async def _whole_response(
    reqs: list, events: asyncio.Queue, meta: dict[str, Any], fmt: Choices, n_jobs: int, rid: str, endpoint: str
):
    """A response that is not streamed: every choice's events gathered until each is done."""
    texts: list[list[str]] = [[] for _ in range(n_jobs)]
    done: list[dict[str, Any] | None] = [None] * n_jobs
    try:
        while any(d is None for d in done):
            i, ev = await events.get()
            if ev["type"] == "token":
                texts[i].append(ev["text"])
            elif ev["type"] == "done":
                done[i] = ev
                log_done(rid if n_jobs == 1 else f"{rid}[{i}]", endpoint, ev)
            else:
                raise ApiError(500, ev["message"])
    except ApiError as exc:
        return _error(exc, f"{endpoint} {rid}")
    finally:
        for r in reqs:
            r.cancel()  # no-op when finished; stops the work when this handler was cancelled
    choices = [fmt.final(i, "".join(texts[i]), done[i]) for i in range(n_jobs)]
    return await respond({**meta, "choices": choices, "usage": fmt.usage(done)})


def default_model_id(artifact: Path) -> str:
    """`<stage>/<key>` of an artifact directory (what `msllm lineage` and --from take)."""
    return f"{artifact.parent.name}/{artifact.name}"


def configure_logging() -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(
            level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    logging.getLogger("msllm.serve").setLevel(logging.INFO)


def serve(
    artifact: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    model_name: str | None = None,
    max_active: int = 32,
    max_queue: int = 256,
    drain_timeout: float = 8.0,
    batching: bool = True,
    adapters: Sequence[AdapterSpec] = (),
    store=None,
    max_body: int = MAX_BODY,
    weights: str = "fp32",
    head_timeout: float = HEAD_TIMEOUT,
    parallel: int = 4,
) -> int:
    """Load the artifact (and each adapter, unmerged or merged: tasks/serving/adapters.py), serve until
    SIGTERM/SIGINT, drain, return 0. `store` resolves adapter references that are not directories; `weights`: a
    model artifact's decode weights (model/fused_decode.py WEIGHT_FORMATS); `parallel`: a model artifact's decode slots
    (sequences decoded together, tasks/serving/backends.py MindSporeBackend)."""
    artifact = Path(artifact).resolve()
    kind = artifact_kind(artifact)  # a bad path fails here, before the model is loaded
    model_id = model_name or default_model_id(artifact)
    checked = check_adapters(artifact, list(adapters), model_id, store)  # every --adapter error before any loading
    configure_logging()
    tmp = tempfile.TemporaryDirectory(prefix="msllm-serve-")  # adapters' ONNX files on an export base
    try:
        t0 = time.perf_counter()
        unmerged = {a.name: a.finetune for a in checked if a.mode(kind) == "unmerged"}
        dirs = {a.name: a.model_dir(kind, artifact, Path(tmp.name)) for a in checked if a.name not in unmerged}
        engine: Engine
        # The engine loads in this order, in its thread: the base first, so an unmerged adapter's loader
        # finds the base's backend (the one network holding every adapter's A/B).
        loaders = {
            model_id: (lambda: MindSporeBackend(artifact, adapters=unmerged, weights=weights))
            if unmerged
            else (lambda: load_backend(artifact, weights=weights, lean=not checked, parallel=parallel)),
            **{
                a.name: (lambda n=a.name: engine.backends[model_id].adapter(n))
                if a.name in unmerged
                else (lambda d=dirs[a.name]: load_backend(d))
                for a in checked
            },
        }
        engine = Engine(loaders, max_active=max_active, max_queue=max_queue, batching=batching)
        engine.start()
        b = engine.backend
        log.info(
            "loaded %s on %s in %.1fs: model '%s', context %d tokens, vocabulary %d, %s of up to %d sequences",
            artifact,
            b.kind,
            time.perf_counter() - t0,
            model_id,
            b.context_length,
            b.vocab_size,
            "batched decoding" if engine.batched else "interleaved decoding",
            engine.max_active,
        )
        for a in checked:
            if a.name in unmerged:
                log.info(
                    "adapter '%s': %s (lora) unmerged on the base network (rank %d slots, %d modules), "
                    "decoded on the MindSpore decoder",
                    a.name,
                    a.finetune_id,
                    b.slots.rank,
                    len(b.slots.layers),
                )
            else:
                log.info(
                    "adapter '%s': %s (%s) merged into the base, served from %s",
                    a.name,
                    a.finetune_id,
                    a.method,
                    dirs[a.name],
                )
        served = {
            a.name: Served(
                engine,
                a.finetune if a.name in unmerged else dirs[a.name],
                model=a.name,
                parent=model_id,
                base=model_id,
                adapter_mode=a.mode(kind),
                finetune=a.finetune_id,
                method=a.method,
            )
            for a in checked
        }
        app = build_app(engine, model_id, artifact, adapters=served, max_body=max_body)
        return _run(app, engine, host, port, drain_timeout, head_timeout)
    finally:
        tmp.cleanup()


def _run(app: FastAPI, engine: Engine, host: str, port: int, drain_timeout: float, head_timeout: float) -> int:
    """uvicorn until SIGTERM/SIGINT, then the drain; 0, or 1 when the server never started. A request head not
    complete within `head_timeout` seconds closes its connection (tasks/serving/connections.py: slow-loris)."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=head_deadline_protocol(head_timeout),
        access_log=False,
        log_config=None,
        lifespan="off",
        timeout_graceful_shutdown=drain_timeout,
        timeout_keep_alive=5,
    )
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
