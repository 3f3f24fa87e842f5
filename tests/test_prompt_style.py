"""The prompt style is recorded beside the weights (LitGPT's save_prompt_style) and the server reads it from there:
tasks/prompts.py `prompt_style`, tasks/store/model_artifact.py `write_model` / `load_prompt_style`."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import train_tiny_hf_tokenizer, train_tiny_tokenizer

from model.config import ModelConfig
from tasks.prompts import PROMPT_STYLE_FILE, chat_prompt_ids, style_record
from tasks.serving.parsing import parse_request
from tasks.store.model_artifact import load_prompt_style, write_model
from tasks.tokenizer import load_tokenizer
from tasks.tokenizer_error import TokenizerError

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a cat?"}]


def _artifact(out, tokenizer_model):
    mc = ModelConfig.from_name("tiny")
    out.mkdir(parents=True)
    write_model(
        out,
        name="llama",
        config=mc,
        weights={"w": np.zeros(1, np.float32)},
        tokenizer_model=tokenizer_model,
        tokenizer_info={},
        seq_length=64,
    )
    return out, load_tokenizer(out)


def _served_ids(art, tok) -> list[int]:
    backend = SimpleNamespace(tokenizer=tok, context_length=4096, prompt_style=load_prompt_style(art, tok))
    return parse_request({"model": "m", "messages": MESSAGES}, chat=True, model_id="m", backend=backend).prompt_ids


def test_model_artifacts_record_their_prompt_style_and_the_server_renders_by_it(tmp_path):
    chat, tok = _artifact(tmp_path / "chat", train_tiny_hf_tokenizer(tmp_path / "hf"))
    assert json.loads((chat / PROMPT_STYLE_FILE).read_text()) == {"style": "chat_template"}
    turns = [(m["role"], m["content"]) for m in MESSAGES]
    assert _served_ids(chat, tok) == tok.encode(tok.render_chat(MESSAGES, add_generation_prompt=True))
    # the record, not the tokenizer, decides: an artifact that says "instruction" is asked in the instruction template
    (chat / PROMPT_STYLE_FILE).write_text(json.dumps(style_record("instruction")))
    instruction = _served_ids(chat, tok)
    assert instruction == chat_prompt_ids(tok, turns, "instruction") != chat_prompt_ids(tok, turns, "chat_template")
    assert tok.decode(instruction).startswith("### System:")

    sp_art, sp = _artifact(tmp_path / "sp", train_tiny_tokenizer(tmp_path / "tok.model", 512))
    record = json.loads((sp_art / PROMPT_STYLE_FILE).read_text())
    assert record["style"] == "instruction" and "{prompt}" in record["prompt"]
    assert _served_ids(sp_art, sp) == chat_prompt_ids(sp, turns, "instruction")


@pytest.mark.parametrize(
    "content, why",
    [
        ("{", "not JSON"),
        ('{"style": "alpaca"}', "style must be one of chat_template, instruction"),
        ('{"style": "chat_template"}', "has no chat template"),
        ('{"style": "instruction", "prompt": "Q: {prompt}\\nA: ", "system": ""}', "other than this version's"),
    ],
)
def test_a_bad_prompt_style_record_is_one_error_naming_the_file(tmp_path, content, why):
    art, sp = _artifact(tmp_path / "sp", train_tiny_tokenizer(tmp_path / "tok.model", 512))
    (art / PROMPT_STYLE_FILE).write_text(content)
    with pytest.raises(TokenizerError, match=why) as exc:
        load_prompt_style(art, sp)
    assert str(art / PROMPT_STYLE_FILE) in str(exc.value)


def test_an_artifact_from_before_the_record_gets_the_style_its_tokenizer_implies(tmp_path):
    art, tok = _artifact(tmp_path / "chat", train_tiny_hf_tokenizer(tmp_path / "hf"))
    (art / PROMPT_STYLE_FILE).unlink()
    assert load_prompt_style(art, tok) == "chat_template"
