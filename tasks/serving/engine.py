"""The generation engine: one worker thread, a request queue, sequences decoded in turn.

    engine = Engine(lambda: load_backend(path), max_active=32, max_queue=256)
    engine = Engine({"base": lambda: load_backend(base), "a": lambda: load_backend(merged_a)})  # several models
    engine.start()                                  # loads the backend(s) in the worker thread; raises the error
    req = engine.submit(prompt_ids, Sampling(max_tokens=32, temperature=0.0), emit)   # model=None: the first
    req = engine.submit(prompt_ids, sampling, emit, model="a")
    # emit(event) is called from the worker thread with, in order:
    #   {"type": "token", "text": "...", "tokens": n, "logprobs": [...]}  zero or more: text safe to show (stop
    #                                                     strings held back); logprobs of those n tokens if asked
    #   {"type": "done", "finish_reason": "stop"|"length", "prompt_tokens", "completion_tokens", timings,
    #    "prompt_logprobs": [...] (echo), "logprobs": [...] (every generated token), "token_gaps": [s, ...]}
    #   or {"type": "error", "message": ...}
    req.cancel()                                    # a client went away: dropped at the next round
    engine.listeners.append(fn)                     # fn(model, finished) from the worker thread as each sequence
                                                    # ends (stop, length, abort), before its done event: metrics
    engine.stop()

Everything that touches a model (loading, compiling, every step) runs in the one
worker thread: MindSpore is not thread-safe in general. Several models (a base and its LoRA
adapters, `msllm serve --adapter`) share that thread, the queue and `max_active`: each
sequence runs on its request's backend, and a batched round makes one call per backend. Unmerged
adapters are backends over the base's one network (tasks/serving/backends.py `AdapterBackend`): each of
their calls puts its adapter in place first, which is exact because MindSpore sequences take one call each. Up to
`max_active` sequences run at once (the rest wait in the queue, FIFO); each round gives every one of them a token, so
a new request gets its first token after at most one round instead of waiting for every
earlier request to finish. Newly admitted sequences are prefilled (batched on a backend with `prefill_many`, the
MindSpore slots: their prompts in one pass; otherwise each alone). Then either:
  - batched (a backend with `batched = True`: onnxruntime, which keeps the running sequences as one left-padded
    batch, or MindSpore with `--parallel` > 1, which keeps each in a KV cache slot: `BatchDecodeStep`): one
    `decode` call per round for all running sequences (continuous batching: rows join after their prefill and
    leave when done; a backend's `max_active` caps how many run, the rest queue), or
  - interleaved (MindSpore, or `batching=False`): one call per sequence per round through
    its own `steps` coroutine.
Each sequence has its own KV cache (or cache rows) and its own
`numpy.random.default_rng(seed)`, and tokens are drawn with the backend's `sample_next`
(`model.generate.sample_next`, or its numpy copy in `tasks.deploy.onnx_generate`) exactly as
`Generator.generate` / `OnnxGenerator.generate` do: with a seed (or temperature 0) a request yields
the same tokens alone or among 31 others, and the same as `msllm predict`.

A completion's text is handed out as it grows, held back where a stop string may begin
(tasks/serving/text_stream.py); logprobs, when asked, come with each token (tasks/serving/logprobs.py).
`max_tokens` 0 is allowed with echo only: the prompt is scored and nothing is generated.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tasks.serving.logprobs import LogProb, logprob_entry, prompt_logprobs
from tasks.serving.text_stream import TextStream

log = logging.getLogger("msllm.serve")


@dataclass
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # alternatives per position (0..20) with each token's logprob; None: no logprobs
    echo_from: int | None = None  # score the prompt's tokens from this index on (echo); None: not at all


class Busy(RuntimeError):
    """The queue is full or the server is shutting down."""


class Request:
    """One generation request; `emit` receives its events (from the worker thread)."""

    _ids = 0
    _lock = threading.Lock()

    def __init__(
        self,
        prompt_ids: Sequence[int],
        sampling: Sampling,
        emit: Callable[[dict[str, Any]], None],
        model: str | None = None,
    ):
        with Request._lock:
            Request._ids += 1
            self.number = Request._ids
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.sampling = sampling
        self.emit = emit
        self.model = model  # the engine's name of the backend that runs it
        self.cancelled = False
        self.outcome: str | None = None  # how it ended: "stop", "length", "abort", "error"; None: not yet
        self.t_arrival = time.perf_counter()
        self.t_start: float | None = None  # first scheduled (admitted)
        self.t_first: float | None = None  # first token (echo alone: the prompt scored)

    def cancel(self) -> None:
        self.cancelled = True


class _Seq:
    """A request being decoded: its backend state, sampler and text."""

    def __init__(self, req: Request, backend, budget: int, batched: bool):
        self.req = req
        self.backend = backend
        self.batched = batched
        # interleaved: the backend's step coroutine; batched: the backend holds the row (keyed by this object)
        self.steps = None if batched else backend.steps(req.prompt_ids)
        self.rng = np.random.default_rng(req.sampling.seed)
        self.text = TextStream(backend.tokenizer, req.prompt_ids, req.sampling.stop, backend.eos_id)
        self.budget = budget
        self.new: list[int] = []
        self.emitted = 0  # tokens already reported in token events
        self.logprobs: list[LogProb] = []  # of the generated tokens, when asked
        self.prompt_logprobs: list[LogProb] = []
        self.gaps: list[float] = []  # seconds between consecutive tokens
        self.t_last: float | None = None

    def close(self) -> None:
        if self.batched:
            self.backend.release(self)
        else:
            self.steps.close()


class Engine:
    def __init__(
        self,
        load_backend: Callable[[], Any] | Mapping[str, Callable[[], Any]],
        max_active: int = 32,
        max_queue: int = 256,
        batching: bool = True,
    ):
        if max_active < 1 or max_queue < 1:
            raise ValueError("max_active and max_queue must be at least 1")
        # name -> loader; the first is the default model (a bare loader is the one model, named "")
        self._loaders = dict(load_backend) if isinstance(load_backend, Mapping) else {"": load_backend}
        if not self._loaders:
            raise ValueError("the engine needs at least one model")
        self.default_model = next(iter(self._loaders))
        self.batching = batching  # decode the active sequences in one batched call when every backend can
        self.batched = False
        self.max_active = max_active
        self.max_queue = max_queue
        self.backend = None  # the default model's backend
        self.backends: dict[str, Any] = {}  # name -> backend, once loaded
        self.running_by: dict[str, int] = {}  # name -> sequences being decoded
        self._queue: queue.Queue = queue.Queue()
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="msllm-serve-engine", daemon=True)
        self.active = 0
        self.peak_active = 0  # the most sequences decoded in one round so far
        # fn(model, finished) called in the worker thread as each sequence ends (`_finished`): the app's metrics
        self.listeners: list[Callable[[str, dict[str, Any]], None]] = []

    # ---- lifecycle

    def start(self, timeout: float | None = None) -> None:
        """Start the worker; return once the backend is loaded and warmed up (or raise its load error)."""
        self._thread.start()
        self._ready.wait(timeout)
        if self._load_error is not None:
            raise self._load_error
        if self.backend is None:
            raise TimeoutError(f"the model did not load within {timeout}s")

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the worker: requests still queued or running get an error event."""
        self._stopping = True
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    # ---- requests

    def submit(
        self,
        prompt_ids: Sequence[int],
        sampling: Sampling,
        emit: Callable[[dict[str, Any]], None],
        model: str | None = None,
    ) -> Request:
        model = self.default_model if model is None else model
        if model not in self._loaders:
            raise ValueError(f"this engine runs {sorted(self._loaders)}, not {model!r}")
        if self._stopping:
            raise Busy("the server is shutting down")
        if self._queue.qsize() >= self.max_queue:
            raise Busy(
                f"{self._queue.qsize()} requests are already waiting (--max-queue {self.max_queue}); retry later"
            )
        req = Request(prompt_ids, sampling, emit, model)
        self._queue.put(req)
        return req

    def queued(self, model: str | None = None) -> int:
        """Requests waiting (for `model` only when given)."""
        if model is None:
            return self._queue.qsize()
        with self._queue.mutex:
            return sum(1 for r in self._queue.queue if r is not None and r.model == model)

    def running(self, model: str | None = None) -> int:
        """Sequences being decoded (of `model` only when given)."""
        return self.active if model is None else self.running_by.get(model, 0)

    # ---- the worker thread

    def _run(self) -> None:
        try:
            for name, load in self._loaders.items():
                backend = load()
                backend.warmup()
                self.backends[name] = backend
            self.backend = self.backends[self.default_model]
        except BaseException as exc:  # noqa: BLE001 - handed to start(), which raises it in the main thread
            self.backend = None
            self._load_error = exc
            self._ready.set()
            return
        self.batched = self.batching and all(getattr(b, "batched", False) for b in self.backends.values())
        # a backend that runs fewer sequences at once caps them: batched, its decode slots; interleaved, a network
        # holding only its 16/8-bit matrices runs one
        caps = [getattr(b, "max_active" if self.batched else "max_interleaved", None) for b in self.backends.values()]
        self.max_active = min([self.max_active] + [c for c in caps if isinstance(c, int)])
        self._ready.set()
        active: list[_Seq] = []
        stop = False
        while not stop:
            # admit new requests: block only when idle
            new: list[_Seq] = []
            while len(active) + len(new) < self.max_active:
                try:
                    req = self._queue.get(block=not (active or new), timeout=None if active or new else 0.5)
                except queue.Empty:
                    break
                if req is None:
                    stop = True
                    break
                if req.cancelled:
                    self._finished(req, "abort", 0, [])
                    continue
                seq = self._admit(req)
                if seq is not None:
                    new.append(seq)
            self.active = len(active) + len(new)
            self.peak_active = max(self.peak_active, self.active)
            self._count_running(active + new)
            # one model call per sequence per round: the prefill of a new one, a decode step for the others
            if self.batched:
                running = self._batched_step(active)
            else:
                running = [seq for seq in active if self._advance(seq)]
            running += self._prefill_new(new) if self.batched else [seq for seq in new if self._advance(seq)]
            for seq in active + new:
                if seq not in running:
                    seq.close()
                    if seq.req.outcome is None and seq.req.cancelled:  # dropped before it finished
                        self._finished(seq.req, "abort", len(seq.new), seq.gaps)
            active = running
            self.active = len(active)
            self._count_running(active)
        for seq in active:
            seq.close()
            seq.req.emit({"type": "error", "message": "the server shut down before the request finished"})
        while True:
            try:
                req = self._queue.get_nowait()
            except queue.Empty:
                break
            if req is not None:
                req.emit({"type": "error", "message": "the server shut down before the request started"})

    def _count_running(self, seqs: list[_Seq]) -> None:
        counts = dict.fromkeys(self._loaders, 0)
        for seq in seqs:
            counts[seq.req.model] += 1
        self.running_by = counts  # replaced whole: readers in other threads see one round or the next

    def _admit(self, req: Request) -> _Seq | None:
        req.t_start = time.perf_counter()
        s = req.sampling
        backend = self.backends[req.model]
        budget = min(s.max_tokens, backend.context_length - len(req.prompt_ids))
        try:
            if budget < 1 and not (s.max_tokens == 0 and s.echo_from is not None):
                raise ValueError(
                    f"no room for new tokens: the prompt has {len(req.prompt_ids)} tokens and the "
                    f"context {backend.context_length}"
                )
            prompt_lp = (
                [] if s.echo_from is None else prompt_logprobs(backend, req.prompt_ids, s.echo_from, s.logprobs or 0)
            )
            if s.max_tokens == 0:  # echo alone: the prompt scored, nothing generated
                now = time.perf_counter()
                req.t_first = now
                self._finished(req, "length", 0, [], now)
                req.emit(
                    {
                        "type": "done",
                        "finish_reason": "length",
                        "text": "",
                        "prompt_tokens": len(req.prompt_ids),
                        "completion_tokens": 0,
                        "queue_s": req.t_start - req.t_arrival,
                        "ttft_s": now - req.t_arrival,
                        "total_s": now - req.t_arrival,
                        "decode_s": now - req.t_start,
                        "prompt_logprobs": prompt_lp,
                        "logprobs": [],
                        "token_gaps": [],
                    }
                )
                return None
            seq = _Seq(req, backend, budget, self.batched)
            seq.prompt_logprobs = prompt_lp
            return seq
        except Exception as exc:  # noqa: BLE001 - one request fails, the server goes on
            log.exception("request %d failed to start", req.number)
            req.outcome = "error"
            req.emit({"type": "error", "message": f"{type(exc).__name__}: {exc}"})
            return None

    def _finished(self, req: Request, reason: str, generated: int, gaps: list[float], now: float | None = None) -> None:
        """`req` ended (stop, length, abort): tell the listeners, before its done event goes out (so a client that
        has its response finds the request in /metrics)."""
        req.outcome = reason
        if not self.listeners:
            return
        stats = {
            "finish_reason": reason,
            "generation_tokens": generated,
            "max_tokens": req.sampling.max_tokens,
            # prompt tokens count once prefilled (the first token came), as vLLM counts them
            "prompt_tokens": len(req.prompt_ids) if req.t_first is not None else 0,
            "t_arrival": req.t_arrival,
            "t_start": req.t_start,
            "t_first": req.t_first,
            "t_finish": time.perf_counter() if now is None else now,
            "gaps": list(gaps),
        }
        for fn in self.listeners:
            try:
                fn(req.model, stats)
            except Exception:  # noqa: BLE001 - a metrics failure must not fail the request
                log.exception("a listener failed on request %d", req.number)

    def _advance(self, seq: _Seq) -> bool:
        """One model call for `seq` alone (a prefill, or an interleaved decode step) and its token; False once done."""
        if seq.req.cancelled:
            return False
        try:
            if seq.batched:  # only prefills come here when batched
                logits = seq.backend.prefill(seq, seq.req.prompt_ids)
            else:
                logits = next(seq.steps) if not seq.new else seq.steps.send(seq.new[-1])
        except Exception as exc:  # noqa: BLE001 - one request fails, the server goes on
            return self._fail([seq], exc)
        return self._take(seq, logits)

    def _prefill_new(self, new: list[_Seq]) -> list[_Seq]:
        """The newly admitted sequences' prompts, batched: one `prefill_many` call per backend that has it for its
        sequences (their prompts in one pass), the others one `prefill` each; those still running."""
        running = []
        for backend in self.backends.values():
            mine = [seq for seq in new if seq.backend is backend and not seq.req.cancelled]
            if len(mine) < 2 or not hasattr(backend, "prefill_many"):
                running += [seq for seq in mine if self._advance(seq)]
                continue
            try:
                rows = backend.prefill_many({seq: seq.req.prompt_ids for seq in mine})
            except Exception as exc:  # noqa: BLE001 - these requests fail, the server goes on
                self._fail(mine, exc)
                continue
            running += [seq for seq in mine if self._take(seq, rows[seq])]
        return running

    def _batched_step(self, active: list[_Seq]) -> list[_Seq]:
        """One batched decode call per backend for its active sequences; those still running."""
        running = []
        for backend in self.backends.values():
            mine = [seq for seq in active if seq.backend is backend]
            for seq in mine:
                if seq.req.cancelled:
                    backend.release(seq)
            live = [seq for seq in mine if not seq.req.cancelled]
            if not live:
                continue
            try:
                rows = backend.decode({seq: seq.new[-1] for seq in live})
            except Exception as exc:  # noqa: BLE001 - these requests fail, the server goes on
                self._fail(live, exc)
                continue
            running += [seq for seq in live if self._take(seq, rows[seq])]
        return running

    def _fail(self, seqs: list[_Seq], exc: Exception) -> bool:
        log.exception("generation failed for request(s) %s", [s.req.number for s in seqs])
        for seq in seqs:
            seq.req.outcome = "error"
            seq.req.emit({"type": "error", "message": f"{type(exc).__name__}: {exc}"})
        return False

    def _take(self, seq: _Seq, logits) -> bool:
        """Sample the next token of `seq` from `logits` [V] and hand out its text; False once the request is done."""
        req, s = seq.req, seq.req.sampling
        try:
            tok = seq.backend.sample_next(np.asarray(logits), s.temperature, s.top_k, s.top_p, seq.rng)
        except Exception as exc:  # noqa: BLE001
            return self._fail([seq], exc)
        now = time.perf_counter()
        if req.t_first is None:
            req.t_first = now
        else:
            seq.gaps.append(now - seq.t_last)
        seq.t_last = now
        if s.logprobs is not None:
            seq.logprobs.append(logprob_entry(logits, tok, s.logprobs))
        seq.new.append(tok)
        eos = tok == seq.backend.eos_id
        full = len(seq.new) >= seq.budget
        delta, hit = seq.text.update(seq.new, final=eos or full)
        if delta:
            req.emit(
                {
                    "type": "token",
                    "text": delta,
                    "tokens": len(seq.new) - seq.emitted,
                    "logprobs": seq.logprobs[seq.emitted : len(seq.new)],
                    "prompt_logprobs": seq.prompt_logprobs if seq.emitted == 0 else None,
                }
            )
            seq.emitted = len(seq.new)
        if not (eos or hit or full):
            return True
        now = time.perf_counter()
        self._finished(req, "stop" if eos or hit else "length", len(seq.new), seq.gaps, now)
        req.emit(
            {
                "type": "done",
                "finish_reason": req.outcome,
                "text": seq.text.text,
                "prompt_tokens": len(req.prompt_ids),
                "completion_tokens": len(seq.new),
                "queue_s": req.t_start - req.t_arrival,
                "ttft_s": req.t_first - req.t_arrival,
                "total_s": now - req.t_arrival,
                "decode_s": now - req.t_start,
                "prompt_logprobs": seq.prompt_logprobs,
                "logprobs": seq.logprobs,
                "unsent_logprobs": seq.logprobs[seq.emitted :],
                "token_gaps": seq.gaps,
            }
        )
        return False
