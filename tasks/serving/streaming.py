"""Responses in OpenAI's shapes: choices, logprobs, usage, and the server-sent event stream.

    fmt = Choices(served, parsed, jobs, chat)      # formats each choice of one request
    fmt.final(i, text, done)                         # a choice of a non-streamed response
    StreamingResponse(stream_choices(reqs, events, meta, fmt, ...))   # `data: {chunk}` ... `data: [DONE]`

Completions logprobs are OpenAI's legacy shape (tokens, token_logprobs, top_logprobs, text_offset), chat
logprobs its `content` list; a token's text is decoded with a few tokens of context (`TokenText`), so a
leading space survives. The engine (tasks/serving/engine.py) emits events from its thread; the app puts
them on an asyncio queue that these functions read.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from tasks.serving.engine import Sampling
from tasks.serving.logprobs import LogProb
from tasks.serving.parsing import Parsed, Prompt
from tasks.serving.requests import ApiError

if TYPE_CHECKING:
    from tasks.serving.app import Served

log = logging.getLogger("msllm.serve")


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
        return b[len(a) :] if b.startswith(a) else self.tok.decode([t])

    def run(self, context: Sequence[int], ids: Sequence[int]) -> list[str]:
        full = list(context) + list(ids)
        c = len(context)
        return [self.after(full[max(0, c + i - _WINDOW) : c + i], t) for i, t in enumerate(ids)]


def completion_logprobs(
    tt: TokenText, context: Sequence[int], entries: Sequence[LogProb], offset: int, k: int
) -> dict[str, Any]:
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
        head = full[max(0, len(context) + i - _WINDOW) : len(context) + i]
        top: dict[str, float] = {}
        for t, lp in e.top[:k]:
            top.setdefault(tt.after(head, t), lp)
        top.setdefault(text, e.logprob)
        tops.append(top)
    return {
        "tokens": texts,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(tt: TokenText, context: Sequence[int], entries: Sequence[LogProb], k: int) -> list[dict[str, Any]]:
    """OpenAI's chat `logprobs.content`: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""
    ids = [e.token for e in entries]
    texts = tt.run(context, ids)
    full = list(context) + ids
    out = []
    for i, (e, text) in enumerate(zip(entries, texts)):
        head = full[max(0, len(context) + i - _WINDOW) : len(context) + i]
        alts = [(tt.after(head, t), lp) for t, lp in e.top[:k]]
        out.append(
            {
                "token": text,
                "logprob": e.logprob,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [{"token": a, "logprob": lp, "bytes": list(a.encode("utf-8"))} for a, lp in alts],
            }
        )
    return out


# ----------------------------------------------------------------------------- the app


class Choices:
    """The choices of one response in OpenAI's shapes (completions or chat; whole or streamed)."""

    def __init__(self, sv: Served, p: Parsed, jobs: list[tuple[Prompt, Sampling]], chat: bool):
        self.sv, self.p, self.jobs, self.chat = sv, p, jobs, chat
        self.sent = [0] * len(jobs)  # streamed: generated tokens whose logprobs went out
        self.offset = [0] * len(jobs)  # streamed: text offset of the next token

    def echo_text(self, i: int) -> str:
        prompt = self.jobs[i][0]
        if prompt.text is not None:
            return prompt.text
        return self.sv.backend.tokenizer.decode(prompt.ids[prompt.start :])

    def _completion_lp(self, i: int, prompt_lp: list[LogProb], gen_lp: list[LogProb], offset: int) -> dict[str, Any]:
        """Completions `logprobs` of echoed prompt tokens then generated ones, text offsets from `offset`."""
        prompt = self.jobs[i][0]
        k, tt = self.p.logprobs or 0, self.sv.text
        parts = []
        if prompt_lp:
            parts.append(completion_logprobs(tt, prompt.ids[: prompt.start], prompt_lp, offset, k))
            offset += sum(len(t) for t in parts[-1]["tokens"])
        if gen_lp:
            parts.append(
                completion_logprobs(tt, prompt.ids + [e.token for e in self.sent_before(i)], gen_lp, offset, k)
            )
        return {
            key: [x for part in parts for x in part[key]]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        }

    def sent_before(self, i: int) -> list[LogProb]:
        return getattr(self, "_history", {}).get(i, [])

    def final(self, i: int, text: str, done: dict[str, Any]) -> dict[str, Any]:
        finish = done["finish_reason"]
        k = self.p.logprobs
        if self.chat:
            lp = None
            if k is not None:
                lp = {"content": chat_logprobs(self.sv.text, self.jobs[i][0].ids, done["logprobs"], k), "refusal": None}
            return {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": lp,
                "finish_reason": finish,
            }
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
        for i, (_prompt, _) in enumerate(self.jobs):
            if self.chat:
                out.append(
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                )
        return out

    def chunk(
        self,
        i: int,
        text: str | None,
        entries: list[LogProb] | None,
        finish: str | None = None,
        prompt_lp: list[LogProb] | None = None,
        echo: str | None = None,
    ) -> dict[str, Any]:
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
    return {
        "prompt_tokens": done["prompt_tokens"],
        "completion_tokens": done["completion_tokens"],
        "total_tokens": done["prompt_tokens"] + done["completion_tokens"],
    }


def log_done(rid: str, endpoint: str, done: dict[str, Any]) -> None:
    out = done["completion_tokens"]
    rate = out / done["decode_s"] if done["decode_s"] > 0 else 0.0
    log.info(
        "%s %s 200 in=%d out=%d ttft=%.3fs tok/s=%.1f queue=%.3fs total=%.3fs finish=%s",
        endpoint,
        rid,
        done["prompt_tokens"],
        out,
        done["ttft_s"],
        rate,
        done["queue_s"],
        done["total_s"],
        done["finish_reason"],
    )


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


async def stream_choices(
    reqs: list, events: asyncio.Queue, meta: dict[str, Any], fmt: Choices, include_usage: bool, rid: str, endpoint: str
) -> AsyncIterator[bytes]:
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
                    yield _sse(
                        {
                            **meta,
                            "choices": [
                                fmt.chunk(i, None, None, prompt_lp=ev.get("prompt_logprobs"), echo=fmt.echo_text(i))
                            ],
                        }
                    )
                else:
                    extra = {"echo": fmt.echo_text(i), "prompt_lp": ev.get("prompt_logprobs")}
            if ev["type"] == "token":
                tokens += ev["tokens"]
                yield _sse({**meta, "choices": [fmt.chunk(i, ev["text"], ev.get("logprobs"))]})
            else:
                done[i] = ev
                log_done(rid if n == 1 else f"{rid}[{i}]", endpoint, ev)
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
