"""A request body checked against the served model: its prompts tokenized, the context it leaves, its sampling.

    p = parse_request(body, chat=False, model_id="m", backend=backend, prefix=prefix)   # Parsed: prompts, sampling

`parse_request` validates the body with tasks/serving/requests.py's models first (each field on its own), then
what depends on the model: the `model` id, token ids inside the vocabulary, prompts that leave room in the context
for `max_tokens`, and no more sequences than the engine ever queues. Completions prompts (strings and token ids
alike) start with the model's document prefix (`completion_prompt`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace
from functools import lru_cache
from typing import Any

from tasks.prompts import chat_prompt_ids
from tasks.serving.engine import Sampling
from tasks.serving.requests import ApiError, ChatRequest, CompletionRequest, parse_body, type_name
from tasks.tokenizer_error import TokenizerError


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
    if prefix and ids[: len(prefix)] != prefix:
        return prefix + ids, len(prefix)
    return ids, 0


class Prompt:
    """One prompt of a request: conditioning ids, where the client's part starts, and its text (for echo)."""

    def __init__(self, ids: list[int], start: int, text: str | None):
        self.ids, self.start, self.text = ids, start, text


class Parsed:
    """A validated request: prompts, choices per prompt, sampling, streaming and logprobs options."""

    def __init__(
        self,
        prompts: list[Prompt],
        sampling: Sampling,
        stream: bool,
        include_usage: bool,
        *,
        n: int = 1,
        echo: bool = False,
        logprobs: int | None = None,
        model: str = "",
    ):
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
        raise ApiError(400, f"the request body must be a JSON object, got {type_name(body)}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required: the served model's id (GET /v1/models lists it)", "model")
    if model not in served:
        names = ", ".join(f"'{m}'" for m in served)
        raise ApiError(
            404, f"model '{model}' does not exist; this server serves {names}", "model", code="model_not_found"
        )
    return model


def prompts(prompt: Any, backend, prefix: list[int] | None) -> list[Prompt]:
    """A completions `prompt` (a string, token ids, or a non-empty array of either) as Prompts."""
    sp, vocab = backend.tokenizer, backend.vocab_size

    is_ids = _is_ids

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
            raise ApiError(400, f"{where} must be a string or an array of token ids, got {type_name(v)}", where)
        if not ids:
            raise ApiError(400, f"{where} is empty and this model has no document prefix to start from", where)
        return Prompt(ids, start, text)

    if isinstance(prompt, str) or is_ids(prompt):
        return [one(prompt, "prompt")]
    if isinstance(prompt, list) and prompt:
        return [one(v, f"prompt[{i}]") for i, v in enumerate(prompt)]
    raise ApiError(
        400,
        f"prompt must be a string, an array of token ids, or a non-empty array of either, got "
        f"{type_name(prompt) if prompt != [] else 'an empty array'}",
        "prompt",
    )


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def check_sequences(req: CompletionRequest | ChatRequest, max_jobs: int) -> None:
    """A request whose prompts × n exceed what the engine ever holds waiting (--max-queue) can never be queued
    whole: a 400 naming the limit (a full queue is the engine's 503, worth a retry; this is not)."""
    prompts_ = (
        len(req.prompt)
        if isinstance(req, CompletionRequest)
        and isinstance(req.prompt, list)
        and req.prompt
        and not _is_ids(req.prompt)
        else 1
    )
    count = prompts_ * req.n
    if count > max_jobs:
        param = "prompt" if prompts_ > 1 else "n"
        raise ApiError(
            400,
            f"{param}: this request asks for {count} sequences ({prompts_} prompt"
            f"{'s' if prompts_ > 1 else ''} × n={req.n}), more than this server ever queues at once "
            f"(--max-queue {max_jobs}), so it could never be accepted whole; send at most {max_jobs} "
            f"per request (split the prompts over several requests), or start the server with a "
            f"larger --max-queue",
            param,
            code="too_many_sequences",
        )


@lru_cache(maxsize=16)
def longest_piece(tok) -> int:
    """The most characters of text one token stands for (its piece's length: a byte-level or byte-fallback piece
    has at least as many symbols as the text it decodes to has characters). Counted once per tokenizer."""
    return max((len(tok.id_to_piece(i)) for i in range(tok.vocab_size)), default=1)


def parse_request(
    body: Any,
    *,
    chat: bool,
    model_id: str | Collection[str],
    backend,
    prefix: list[int] | None = None,
    max_jobs: int | None = None,
) -> Parsed:
    """Validate an OpenAI request body against the served model; ApiError naming the field on the first problem.
    `max_jobs`: the engine's --max-queue (more sequences than that in one request is a 400, before any
    tokenization)."""
    model = requested_model(body, [model_id] if isinstance(model_id, str) else model_id)
    req = parse_body(body, chat=chat)
    if max_jobs is not None:
        check_sequences(req, max_jobs)
    sp, ctx = backend.tokenizer, backend.context_length
    if isinstance(req, ChatRequest):
        echo, logprobs = False, ((req.top_logprobs or 0) if req.logprobs else None)

        try:
            # a rendering longer than the context can hold is refused as it grows (tasks.chat_template's size limit)
            style = backend.prompt_style  # the artifact's (tasks/prompts.py): chat template or instruction
            piece = longest_piece(sp) if style == "chat_template" else 1
            cap = dict(
                max_chars=ctx * piece,
                max_chars_why=f"more than the model's context of {ctx} tokens can hold, "
                f"at most {piece} characters a token; shorten the messages",
            )
            ps, field = [Prompt(chat_prompt_ids(sp, [m.turn for m in req.messages], style, **cap), 0, None)], "messages"
        except TokenizerError as exc:  # the model's template refused the conversation (e.g. its raise_exception)
            raise ApiError(400, f"messages: {exc}", "messages") from None
    else:
        echo, logprobs = req.echo, req.alternatives
        ps, field = prompts(req.prompt, backend, prefix), "prompt"
    longest = max(ps, key=lambda p: len(p.ids))
    where = field if len(ps) == 1 else f"{field}[{ps.index(longest)}]"
    n_ids = len(longest.ids)
    if n_ids > ctx or (n_ids == ctx and not echo):
        raise ApiError(
            400,
            f"{where}: the prompt is {n_ids} tokens but the model's context is {ctx} tokens, "
            f"and at least one must be left for the completion; shorten the {field}",
            where,
            code="context_length_exceeded",
        )
    room = ctx - n_ids
    mt_name = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(req, mt_name)
    lo = 0 if echo else 1
    if max_tokens is None:
        max_tokens = room if chat else min(16, room)
    elif max_tokens < lo:
        raise ApiError(
            400,
            f"{mt_name} must be at least {lo}, got {max_tokens}{'' if chat or echo else ' (0 only with echo: true)'}",
            mt_name,
        )
    if max_tokens > room:
        raise ApiError(
            400,
            f"{mt_name} is {max_tokens} but the model's context is {ctx} tokens and the prompt "
            f"uses {n_ids}; set {mt_name} to at most {room}",
            mt_name,
            code="context_length_exceeded",
        )
    sampling = Sampling(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k if req.top_k and req.top_k > 0 else None,
        seed=req.seed,
        stop=req.stops,
        logprobs=logprobs,
    )
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return Parsed(ps, sampling, req.stream, include_usage, n=req.n, echo=echo, logprobs=logprobs, model=model)
