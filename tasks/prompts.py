"""Prompt formats: how a model is asked, in training and in serving alike (LitGPT keeps these in `prompts.py`).

Two formats, chosen by the model's tokenizer:

- a chat template (a tokenizer.json model such as SmolLM2-Instruct): `chat_example` renders a conversation
  with the model's own template and marks the assistant's tokens for the loss; the server renders its chat
  prompts with the same template (`chat_prompt_ids`), so a finetuned model is asked exactly as it was trained.
- without one (models trained here), the instruction template TEMPLATE: a record becomes (text, kind)
  segments (`to_segments`), each tokenized on its own (`encode_segments`), so the prompt/response boundary
  is exact; `prompt_ids` / `chat_prompt_ids` give generation the same prompt tokens:

      ### Instruction:\n{prompt}\n\n### Response:\n{response}</s>

    tokens, trained = chat_example(tok, [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}])
    ids = chat_prompt_ids(tok, [("user", "Hi")], style)   # the prompt, ending where the assistant's answer begins

The style a model is asked in is recorded beside its weights (LitGPT's `save_prompt_style`): every model artifact
holds `prompt_style.json` (`prompt_style(tok)`, written by tasks/store/model_artifact.py `write_model`, copied by
export), and the server reads it from there (`model_artifact.load_prompt_style`) instead of guessing.

Chat templates: the whole conversation is rendered once and tokenized once (as transformers'
`apply_chat_template` does, with no added special tokens); each assistant turn's span is where the rendering of
the conversation up to it (`add_generation_prompt=True`) ends and the rendering through it ends, so the
template's own end-of-turn tokens after the answer (`<|im_end|>` for ChatML) are trained too: the model learns
to stop. A token is trained when its first character lies inside such a span.
"""

from __future__ import annotations

from typing import Any

from tasks.tokenizer_error import TokenizerError


def chat_spans(tok, messages: list[dict[str, str]], where: str) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, [(start, end) character spans of the assistant turns])."""
    full = tok.render_chat(messages, add_generation_prompt=False)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = tok.render_chat(messages[:k], add_generation_prompt=True)
        through = tok.render_chat(messages[: k + 1], add_generation_prompt=False)
        if not (through.startswith(head) and full.startswith(through)):
            raise TokenizerError(
                f"{where}: the chat template does not render the conversation as a growing prefix "
                "(each turn appended to the previous ones), so the assistant's tokens cannot be "
                "located; use a template that does, or finetune.format: text"
            )
        spans.append((len(head), len(through)))
    return full, spans


def chat_example(tok, messages: list[dict[str, str]], where: str = "example") -> tuple[list[int], list[bool]]:
    """(token ids of the rendered conversation, per token whether the loss covers it)."""
    text, spans = chat_spans(tok, messages, where)
    ids, offsets = tok.encode_with_offsets(text)
    trained = [any(a <= s < b for a, b in spans) for s, _ in offsets]
    return ids, trained


def record_messages(record: Any, where: str) -> list[dict[str, str]]:
    """An instruction record ({prompt, response} or {messages}) as chat messages."""
    if isinstance(record, dict) and "messages" in record:
        return [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
    return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]


# ----------------------------------------------------------------------------- the instruction template

PROMPT_TEMPLATE = "### Instruction:\n{prompt}\n\n### Response:\n"
SYSTEM_TEMPLATE = "### System:\n{content}\n\n"
TEMPLATE = PROMPT_TEMPLATE + "{response}</s>"


# A segment is (text, kind): FIXED template text and PROMPT text carry no loss, RESPONSE text does.
# Only PROMPT segments shrink when an example is too long, so the response survives.
FIXED, PROMPT, RESPONSE = "fixed", "prompt", "response"


def _turn(prompt: str) -> list[tuple[str, str]]:
    head, tail = PROMPT_TEMPLATE.split("{prompt}")
    return [(head, FIXED), (prompt, PROMPT), (tail, FIXED)]


def to_segments(record: Any, where: str) -> list[tuple[str, str]]:
    """An instruction record as (text, kind) segments in order (see FIXED / PROMPT / RESPONSE)."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        msgs = record["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        segments: list[tuple[str, str]] = []
        for j, m in enumerate(msgs):
            role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None)
            if not isinstance(content, str):
                raise ValueError(f"{where}: messages[{j}] needs a string 'content'")
            if role == "system":
                head, tail = SYSTEM_TEMPLATE.split("{content}")
                segments += [(head, FIXED), (content, PROMPT), (tail, FIXED)]
            elif role == "user":
                segments += _turn(content)
            elif role == "assistant":
                segments.append((content, RESPONSE))
            else:
                raise ValueError(f"{where}: messages[{j}].role is {role!r}; expected system, user or assistant")
        if not any(kind == RESPONSE for _, kind in segments):
            raise ValueError(f"{where}: no assistant message, so nothing to train on")
        return segments
    prompt, response = record.get("prompt"), record.get("response")
    if not isinstance(prompt, str) or not isinstance(response, str):
        raise ValueError(
            f"{where}: expected string fields 'prompt' and 'response' (or chat 'messages'); got keys {sorted(record)}"
        )
    return [*_turn(prompt), (response, RESPONSE)]


def encode_segments(
    sp, segments: list[tuple[str, str]], eos_id: int, max_tokens: int | None = None
) -> tuple[list[int], list[bool], bool]:
    """(token ids, per token whether it is trained, whether a prompt was shortened).

    Each segment is encoded on its own (so the prompt/response boundary is exact) and
    each response is closed by EOS (trained too: the model learns to stop). When the
    total exceeds `max_tokens`, prompt segments lose tokens from their end, first
    prompt first; whatever is still too long is left for `pack_example` to cut.
    """
    encoded = [
        list(ids) + ([eos_id] if kind == RESPONSE else [])
        for (_, kind), ids in zip(segments, sp.encode_batch([text for text, _ in segments]))
    ]
    excess = sum(map(len, encoded)) - max_tokens if max_tokens is not None else 0
    shortened = excess > 0
    for ids, (_, kind) in zip(encoded, segments):
        if excess > 0 and kind == PROMPT:
            cut = min(excess, len(ids))
            del ids[len(ids) - cut :]
            excess -= cut
    tokens = [t for ids in encoded for t in ids]
    trained = [kind == RESPONSE for ids, (_, kind) in zip(encoded, segments) for _ in ids]
    return tokens, trained, shortened


def prompt_ids(sp, prompt: str) -> list[int]:
    """Token ids of a prompt rendered exactly as in training, ending where the response begins (for generation)."""
    if sp.chat_template is not None:
        return sp.encode(sp.render_chat([{"role": "user", "content": prompt}], add_generation_prompt=True))
    tokens, _, _ = encode_segments(sp, _turn(prompt), sp.eos_id())
    return tokens


PROMPT_STYLE_FILE = "prompt_style.json"
STYLES = ("chat_template", "instruction")
"""chat_template: the tokenizer's own template renders every conversation; instruction: TEMPLATE (models trained
here without one)."""


def style_record(style: str) -> dict[str, Any]:
    """What `prompt_style.json` holds for `style`: the style and, for the instruction template, its text (so a
    reader of the artifact sees exactly how the model is asked)."""
    if style == "chat_template":
        return {"style": "chat_template"}
    return {"style": "instruction", "prompt": PROMPT_TEMPLATE, "system": SYSTEM_TEMPLATE}


def prompt_style(tok) -> dict[str, Any]:
    """The record for a model trained here with tokenizer `tok`: its chat template when it has one, else the
    instruction template (what the finetune stage trains with)."""
    return style_record("chat_template" if tok.chat_template is not None else "instruction")


def check_prompt_style(data: Any, tok, where: str) -> str:
    """The style of a `prompt_style.json`'s contents `data` (read from `where`), checked against the tokenizer:
    TokenizerError naming the file when it is malformed or asks for a chat template the tokenizer lacks."""
    style = data.get("style") if isinstance(data, dict) else None
    if style not in STYLES:
        raise TokenizerError(f"{where}: style must be one of {', '.join(STYLES)}, got {style!r}; rebuild the artifact")
    if style == "chat_template" and tok.chat_template is None:
        raise TokenizerError(
            f"{where}: style chat_template but the artifact's tokenizer has no chat template; rebuild the artifact"
        )
    if style == "instruction" and (data.get("prompt"), data.get("system")) != (PROMPT_TEMPLATE, SYSTEM_TEMPLATE):
        raise TokenizerError(
            f"{where}: an instruction template other than this version's ({PROMPT_TEMPLATE!r}); rebuild the artifact"
        )
    return style


def chat_prompt_ids(tok, messages: list[tuple[str, str]], style: str | None = None, **limits: Any) -> list[int]:
    """Token ids of a conversation in prompt style `style` (the model artifact's, `STYLES`; None: the chat template
    when the tokenizer has one): rendered with the model's chat template (add_generation_prompt; encoded without
    added special tokens, as transformers' apply_chat_template; `limits`: tasks.chat_template.render_chat_template's)
    or with the instruction template, ending where the assistant's answer begins (the same tokens as the training
    examples up to their response)."""
    if style is None:
        style = "chat_template" if tok.chat_template is not None else "instruction"
    if style == "chat_template":
        return tok.encode(
            tok.render_chat([{"role": r, "content": c} for r, c in messages], add_generation_prompt=True, **limits)
        )
    # to_segments wants an assistant turn to train on: add an empty one and drop it again.
    record = {"messages": [{"role": r, "content": c} for r, c in messages] + [{"role": "assistant", "content": ""}]}
    segments = to_segments(record, "messages")[:-1]
    return encode_segments(tok, segments, tok.eos_id())[0]
