"""The tokenizer room (tasks/tokenizer.py) and GGUF files (model/gguf.py) on tiny models: both backends behind one
interface, chat templates, tokenizer.json from GGUF metadata, GGUF weights written and read back, and the errors
for bad input. The real model (SmolLM2-135M) is in tests/test_smollm2.py (slow tier)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers import CHATML, SHAKESPEARE, train_tiny_hf_tokenizer, train_tiny_tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces\n\nand blank lines\t tab",
    "digits 12345 and 3.14159, x86",
    "CJK 你好世界, emoji 😀👍🏽, naïve café",
    "<|im_start|>user\nhi<|im_end|>\n",
    "don't I'll we're",
]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return train_tiny_hf_tokenizer(tmp_path_factory.mktemp("hf") / "tok")


@pytest.fixture(scope="module")
def sp_file(tmp_path_factory):
    return train_tiny_tokenizer(tmp_path_factory.mktemp("sp") / "tokenizer.model", 512)


def test_byte_level_bpe_round_trips_any_text_and_counts_bytes(hf_dir):
    from tasks.tokenizer import load_tokenizer

    tok = load_tokenizer(hf_dir)
    assert tok.kind == "hf" and tok.vocab_size == 512
    assert (tok.bos_id(), tok.eos_id(), tok.pad_id(), tok.unk_id()) == (1, 2, 2, 0)  # from tokenizer_config.json
    tb = tok.token_bytes()
    for text in TEXTS + [SHAKESPEARE.read_text(encoding="utf-8")[:3000]]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        if "<|" not in text:  # special tokens stand for no bytes of text
            assert int(tb[ids].sum()) == len(text.encode("utf-8"))
    # special tokens in text are the special ids, as transformers encodes them
    assert tok.encode("<|im_start|>user")[0] == 1
    # no post-processor: the tokenizer's own encoding adds nothing (SmolLM2's case)
    assert tok.prompt_ids("ROMEO:") == tok.encode("ROMEO:")


def test_sentencepiece_backend_behind_the_same_interface(sp_file):
    from tasks.tokenizer import load_tokenizer

    tok = load_tokenizer(sp_file)
    assert tok.kind == "sentencepiece" and tok.vocab_size == 512 and tok.chat_template is None
    assert tok.prompt_ids("ROMEO:") == [tok.eos_id()] + tok.encode("ROMEO:")  # a document starts after EOS
    text = "First Citizen: Before we proceed any further, hear me speak."  # (this model folds whitespace)
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch(["a b", "c"]) == [tok.encode("a b"), tok.encode("c")]


def test_sha256_covers_every_tokenizer_file(hf_dir, tmp_path):
    import shutil

    from tasks.tokenizer import load_tokenizer

    a = load_tokenizer(hf_dir).sha256
    copy = tmp_path / "copy"
    shutil.copytree(hf_dir, copy)
    assert load_tokenizer(copy).sha256 == a  # names and bytes, not paths
    cfg = json.loads((copy / "tokenizer_config.json").read_text())
    cfg["chat_template"] += " "
    (copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_tokenizer(copy).sha256 != a


def test_chat_template_renders_like_transformers(hf_dir):
    from transformers import PreTrainedTokenizerFast

    from tasks.tokenizer import load_tokenizer

    tok = load_tokenizer(hf_dir)
    ref = PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who art thou?"}]
    for gen in (True, False):
        want = ref.apply_chat_template(msgs, chat_template=CHATML, tokenize=False, add_generation_prompt=gen)
        assert tok.render_chat(msgs, add_generation_prompt=gen) == want
    assert (
        tok.encode(tok.render_chat(msgs))
        == ref.apply_chat_template(msgs, chat_template=CHATML, tokenize=True, add_generation_prompt=True)["input_ids"]
    )


def test_a_template_that_fails_to_render_is_one_clear_error(tmp_path):
    from tasks.tokenizer import check_chat_template, load_tokenizer
    from tasks.tokenizer_error import TokenizerError

    d = train_tiny_hf_tokenizer(tmp_path / "bad", chat_template="{{ messages[0]['content'] | no_such_filter }}")
    with pytest.raises(TokenizerError, match="chat template fails to render"):
        check_chat_template(load_tokenizer(d))
    d = train_tiny_hf_tokenizer(tmp_path / "raises", chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TokenizerError, match="roles must alternate"):
        check_chat_template(load_tokenizer(d))


def test_a_special_token_missing_from_the_vocabulary_names_the_file(hf_dir, tmp_path):
    import shutil

    from tasks.tokenizer import load_tokenizer
    from tasks.tokenizer_error import TokenizerError

    d = tmp_path / "t"
    shutil.copytree(hf_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["eos_token"] = "</s>"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json: eos_token '</s>' is not in"):
        load_tokenizer(d)


def test_chat_example_trains_the_answer_and_its_end_of_turn_only(hf_dir):
    from tasks.prompts import chat_example
    from tasks.tokenizer import load_tokenizer

    tok = load_tokenizer(hf_dir)
    msgs = [{"role": "user", "content": "Speak."}, {"role": "assistant", "content": "I will."}]
    ids, trained = chat_example(tok, msgs)
    assert ids == tok.encode(tok.render_chat(msgs, add_generation_prompt=False))
    answer = tok.decode([i for i, t in zip(ids, trained) if t])
    assert answer == "I will.<|im_end|>\n"  # the answer, the template's end-of-turn (EOS) and its newline


# ----------------------------------------------------------------------------- GGUF


def _tiny(vocab: int, tie: bool):
    from model.config import ModelConfig
    from model.llama import LlamaForCausalLM

    mc = ModelConfig.from_name("tiny", vocab_size=vocab, tie_embeddings=tie, num_kv_heads=2)
    net = LlamaForCausalLM(mc, seed=3)
    return mc, {p.name: p.asnumpy() for p in net.trainable_params()}


@pytest.mark.parametrize("tie", [True, False])
def test_gguf_weights_round_trip_per_type(tmp_path, hf_dir, tie):
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    from model.gguf import read_gguf, write_gguf
    from tasks.deploy.gguf_export import _gguf_name, tokenizer_meta
    from tasks.tokenizer import load_tokenizer

    mc, w = _tiny(512, tie)
    meta = tokenizer_meta(load_tokenizer(hf_dir))
    for qtype in ("F32", "F16", "Q8_0"):
        path = tmp_path / f"m-{qtype}.gguf"
        written = write_gguf(path, mc, w, meta, qtype=qtype)
        _, cfg, back, types = read_gguf(path)
        assert cfg == mc and set(back) == set(w) and types == written
        kinds = {_gguf_name(k): kind for k, kind in ((k, written[_gguf_name(k)]) for k in w)}
        if qtype == "Q8_0":  # rows of 172 (tiny's intermediate size) are no multiple of Q8_0's 32: F16
            assert kinds["blk.0.ffn_down.weight"] == "F16" and kinds["blk.0.ffn_up.weight"] == "Q8_0"
        for k, v in w.items():
            kind = kinds[_gguf_name(k)]
            assert kind == ("F32" if v.ndim == 1 else qtype if qtype != "Q8_0" or v.shape[1] % 32 == 0 else "F16")
            if kind == "F32":  # norms always stay F32
                np.testing.assert_array_equal(back[k], v)
            elif kind == "F16":
                np.testing.assert_array_equal(back[k], v.astype(np.float16).astype(np.float32))
            else:  # exactly Q8_0's rounding (q/k rows in llama.cpp's order inside the file, ours outside)
                want = quants.dequantize(quants.quantize(v, Q.Q8_0), Q.Q8_0).reshape(v.shape)
                np.testing.assert_array_equal(back[k], want)


def test_q_and_k_rows_are_stored_in_llama_cpps_interleaved_order():
    """llama.cpp's converter: reshape(n_head, 2, half, ...) -> swap -> rows; reading undoes it exactly."""
    from model.gguf import _permute, _unpermute

    w = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)  # 2 heads of 8 rows
    p = _permute(w, 2)
    np.testing.assert_array_equal(p[:4, 0], [0, 12, 3, 15])  # rows 0, 4, 1, 5 of head 0 (half = 4)
    np.testing.assert_array_equal(_unpermute(p, 2), w)


def test_tokenizer_json_rebuilt_from_gguf_metadata_encodes_the_same(tmp_path, hf_dir):
    from model.gguf import read_metadata, write_gguf
    from tasks.deploy.gguf_export import tokenizer_meta
    from tasks.tokenizer import hf_files_from_gguf, load_tokenizer

    tok = load_tokenizer(hf_dir)
    mc, w = _tiny(512, True)
    write_gguf(tmp_path / "m.gguf", mc, w, tokenizer_meta(tok), qtype="F16")
    _, meta = read_metadata(tmp_path / "m.gguf")
    assert meta["tokenizer.ggml.pre"] == "smollm" and meta["tokenizer.chat_template"] == CHATML
    out = tmp_path / "rebuilt"
    out.mkdir()
    for name, content in hf_files_from_gguf(meta, "m.gguf").items():
        (out / name).write_text(json.dumps(content))
    back = load_tokenizer(out)
    for text in TEXTS + [SHAKESPEARE.read_text(encoding="utf-8")[:5000]]:
        assert back.encode(text) == tok.encode(text)
    assert back.info() | {"sha256": None, "files": None} == tok.info() | {"sha256": None, "files": None}
    assert back.render_chat([{"role": "user", "content": "x"}]) == tok.render_chat([{"role": "user", "content": "x"}])


def test_gguf_of_another_architecture_and_truncated_files_are_clear_errors(tmp_path, hf_dir):
    import gguf

    from model.gguf import GGUFError, read_gguf, write_gguf
    from tasks.deploy.gguf_export import tokenizer_meta
    from tasks.tokenizer import load_tokenizer

    w = gguf.GGUFWriter(str(tmp_path / "falcon.gguf"), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="general.architecture='falcon'; only 'llama'"):
        read_gguf(tmp_path / "falcon.gguf")

    mc, wt = _tiny(512, True)
    good = tmp_path / "good.gguf"
    write_gguf(good, mc, wt, tokenizer_meta(load_tokenizer(hf_dir)), qtype="F16")
    data = good.read_bytes()
    for cut in (len(data) - 1000, 2000, 10):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(GGUFError, match="truncated|not a readable GGUF"):
            read_gguf(tmp_path / "cut.gguf")


def test_unknown_tokenizer_kinds_in_gguf_name_the_kind():
    from tasks.tokenizer import hf_files_from_gguf
    from tasks.tokenizer_error import TokenizerError

    with pytest.raises(TokenizerError, match="tokenizer.ggml.model='bert'"):
        hf_files_from_gguf({"tokenizer.ggml.model": "bert"}, "x.gguf")
    with pytest.raises(TokenizerError, match="tokenizer.ggml.pre='qwen2' is not a pre-tokenizer"):
        hf_files_from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2"}, "x.gguf")
