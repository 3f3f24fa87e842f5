"""Conversations as a model's own chat template renders them, with the assistant's tokens marked for the loss.

    tokens, trained = chat_example(tok, [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}])

Used by the finetune stage for a model whose tokenizer has a chat template (a tokenizer.json model such as
SmolLM2-Instruct); the server renders its chat prompts with the same template (`Tokenizer.render_chat`), so a
finetuned model is asked exactly as it was trained. Models trained here without a template keep the finetune
stage's instruction template (tasks/stages/finetune.py).

The whole conversation is rendered once and tokenized once (as transformers' `apply_chat_template` does, with
no added special tokens); each assistant turn's span is where the rendering of the conversation up to it
(`add_generation_prompt=True`) ends and the rendering through it ends, so the template's own end-of-turn
tokens after the answer (`<|im_end|>` for ChatML) are trained too: the model learns to stop. A token is trained
when its first character lies inside such a span.
"""

from __future__ import annotations

from typing import Any


def chat_spans(tok, messages: list[dict[str, str]], where: str) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, [(start, end) character spans of the assistant turns])."""
    from tasks.tokenizer import TokenizerError

    full = tok.render_chat(messages, add_generation_prompt=False)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = tok.render_chat(messages[:k], add_generation_prompt=True)
        through = tok.render_chat(messages[:k + 1], add_generation_prompt=False)
        if not (through.startswith(head) and full.startswith(through)):
            raise TokenizerError(f"{where}: the chat template does not render the conversation as a growing prefix "
                                 "(each turn appended to the previous ones), so the assistant's tokens cannot be "
                                 "located; use a template that does, or finetune.format: text")
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
