"""HF LlamaForCausalLM <-> model artifact conversion (model/convert.py, tasks/stages/convert.py).

Parity against the reference implementation: random transformers models (MHA untied,
GQA tied + sharded, GQA saved in bf16) are saved with save_pretrained, converted, and
their logits compared with ours on random ids; converting back must give every tensor
bit for bit, and transformers must load the result.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from model.convert import ConversionError, config_from_hf, hf_to_native, key_pairs, native_to_hf  # noqa: E402
from tasks.stages.convert import read_hf_tensors, to_hf  # noqa: E402
from tasks.store.artifacts import ArtifactStore  # noqa: E402
from tests.helpers import convert_hf, logit_tol, train_tiny_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
VOCAB = 512

CASES = {
    # name: (LlamaConfig overrides, save dtype, max_shard_size)
    "mha-untied": (dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False), torch.float32, None),
    "gqa-tied-sharded": (
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rms_norm_eps=1e-5),
        torch.float32,
        "100KB",
    ),
    "gqa-bf16": (
        dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=500000.0),
        torch.bfloat16,
        None,
    ),
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.model", VOCAB)


def _hf_model(overrides: dict, seed: int):
    """A random LlamaForCausalLM in eval mode whose weights (norms too) are far from the default init."""
    overrides = dict(overrides)
    theta = overrides.pop("rope_theta", 10000.0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        attn_implementation="eager",
        **overrides,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory, tokenizer):
    """(torch reference model in fp32, its HF dir, the convert artifact, the store)."""
    overrides, dtype, shard = CASES[request.param]
    model = _hf_model(overrides, seed=len(request.param))
    hf_dir = tmp_path_factory.mktemp(request.param) / "hf"
    model.to(dtype).save_pretrained(hf_dir, max_shard_size=shard or "5GB")
    # The reference reads the saved (maybe bf16-rounded) weights into fp32, as the converter does;
    # a fresh load also recomputes RoPE's inv_freq in fp32 (model.to(bf16) rounded that buffer).
    model = transformers.LlamaForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    shutil.copy(tokenizer, hf_dir / "tokenizer.model")
    store = ArtifactStore(hf_dir.parent / "artifacts")
    return {
        "name": request.param,
        "model": model,
        "dtype": dtype,
        "hf_dir": hf_dir,
        "store": store,
        "artifact": convert_hf(hf_dir, store, pipeline="test"),
    }


def test_logits_match_transformers(case):
    import mindspore as ms

    from tasks.modeling.build import load_network

    if case["name"] == "gqa-tied-sharded":
        assert (case["hf_dir"] / "model.safetensors.index.json").is_file()  # really sharded
    ids = np.random.default_rng(0).integers(0, VOCAB, size=(2, 48))
    with torch.no_grad():
        ref = case["model"](torch.tensor(ids)).logits.numpy()
    net, info = load_network(case["artifact"])
    ours = net(ms.Tensor(ids.astype(np.int32))).asnumpy()
    diff = float(np.abs(ours - ref).max())
    print(f"{case['name']}: max |logit diff| = {diff:.3g} (logit std {ref.std():.3g})")
    assert ref.std() > 0.5  # the comparison is not trivially small
    assert diff <= logit_tol(net.config, ids.shape[1], float(np.abs(ref).max()))  # PyTorch's kernels against ours


def test_artifact_is_self_describing_with_tokenizer_lineage(case):
    from tasks.store.disk import sha256_file

    info = json.loads((case["artifact"] / "model.json").read_text())
    hf_cfg = case["model"].config
    assert info["model"]["num_kv_heads"] == hf_cfg.num_key_value_heads
    assert info["model"]["tie_embeddings"] == hf_cfg.tie_word_embeddings
    assert info["tokenizer"]["vocab_size"] == VOCAB
    m = ArtifactStore.read_manifest(case["artifact"])
    assert m["stage"] == "convert"
    tok_sha = sha256_file(case["hf_dir"] / "tokenizer.model")
    assert any(i["path"].endswith("tokenizer.model") and i["sha256"] == tok_sha for i in m["inputs"])
    assert sha256_file(case["artifact"] / "tokenizer.model") == tok_sha
    assert convert_hf(case["hf_dir"], case["store"]) == case["artifact"]  # cached by content


def test_round_trip_is_exact_and_loads_in_transformers(case, tmp_path):
    from safetensors.numpy import load_file

    out = to_hf(case["artifact"], tmp_path / "back")
    back = load_file(str(out / "model.safetensors"))
    original = read_hf_tensors(case["hf_dir"])
    assert sorted(back) == sorted(original)
    for k, v in original.items():
        assert back[k].dtype == v.dtype and np.array_equal(back[k], v), k
    # and against the state dict (lm_head shares the embedding when tied)
    for k, v in case["model"].state_dict().items():
        k2 = "model.embed_tokens.weight" if k == "lm_head.weight" and k not in back else k
        assert np.array_equal(back[k2].astype(np.float32), v.to(case["dtype"]).float().numpy()), k
    assert (out / "tokenizer.model").read_bytes() == (case["hf_dir"] / "tokenizer.model").read_bytes()

    reloaded = transformers.LlamaForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = torch.tensor(np.random.default_rng(1).integers(0, VOCAB, size=(1, 32)))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, case["model"](ids).logits)
    cfg = json.loads((out / "config.json").read_text())
    assert config_from_hf(cfg) == config_from_hf(json.loads((case["hf_dir"] / "config.json").read_text()))


# ----------------------------------------------------------------------------- errors (no files needed)


def _tiny_hf():
    cfg = config_from_hf(
        dict(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=16,
            tie_word_embeddings=False,
        )
    )
    rng = np.random.default_rng(0)
    native = {p: rng.normal(size=s).astype(np.float32) for _, p, s in key_pairs(cfg)}
    return cfg, native_to_hf(native, cfg), native


def test_tables_round_trip_every_key_once():
    cfg, hf, native = _tiny_hf()
    assert len(hf) == len(native) == 1 + 2 * 9 + 1 + 1
    back = hf_to_native(hf, cfg)
    assert sorted(back) == sorted(native) and all(np.array_equal(back[k], native[k]) for k in native)


def test_missing_key_is_named():
    cfg, hf, _ = _tiny_hf()
    del hf["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ConversionError, match=r"missing keys: model\.layers\.1\.mlp\.up_proj\.weight"):
        hf_to_native(hf, cfg)


def test_extra_key_is_named():
    cfg, hf, _ = _tiny_hf()
    hf["model.layers.2.mlp.up_proj.weight"] = hf["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ConversionError, match=r"unused keys: model\.layers\.2\.mlp\.up_proj\.weight"):
        hf_to_native(hf, cfg)


def test_wrong_shape_is_named():
    cfg, hf, _ = _tiny_hf()
    hf["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 16), np.float32)  # MHA-shaped k in a GQA model
    with pytest.raises(
        ConversionError,
        match=r"model\.layers\.0\.self_attn\.k_proj\.weight: shape \(16, 16\) "
        r"expected \(8, 16\)",
    ):
        hf_to_native(hf, cfg)


def test_tied_lm_head_copy_is_accepted_only_when_equal():
    cfg, hf, _ = _tiny_hf()
    cfg.tie_embeddings = True
    del hf["lm_head.weight"]
    assert "lm_head.weight" not in hf_to_native(hf, cfg)
    hf["lm_head.weight"] = hf["model.embed_tokens.weight"].copy()
    assert "lm_head.weight" not in hf_to_native(hf, cfg)
    hf["lm_head.weight"] = hf["lm_head.weight"] + 1
    with pytest.raises(ConversionError, match="lm_head.weight: differs"):
        hf_to_native(hf, cfg)


@pytest.mark.parametrize(
    "field,value,msg",
    [
        ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "rope_scaling.rope_type='llama3'"),
        ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4}, "rope_parameters.rope_type='yarn'"),
        ("hidden_act", "gelu", "hidden_act='gelu'"),
        ("attention_bias", True, "attention_bias=True"),
        ("head_dim", 8, "head_dim=8"),
    ],
)
def test_unsupported_config_is_rejected(field, value, msg):
    hf = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4)
    with pytest.raises(ConversionError, match=re.escape(msg)):
        config_from_hf({**hf, field: value})


def test_config_reads_old_and_new_rope_fields():
    hf = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4)
    assert config_from_hf({**hf, "rope_theta": 5e5, "rope_scaling": None}).rope_theta == 5e5
    assert config_from_hf({**hf, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}).rope_theta == 1e6
    assert config_from_hf(hf).num_kv_heads == 4


def test_directory_without_tokenizer_is_refused(case, tmp_path):
    d = tmp_path / "hf"
    shutil.copytree(case["hf_dir"], d)
    (d / "tokenizer.model").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer.model"):
        convert_hf(d, ArtifactStore(tmp_path / "a"))


# ----------------------------------------------------------------------------- into the pipeline


def test_cli_and_continued_pretraining_start_from_the_converted_model(case, tmp_path, capsys):
    """`msllm convert` both ways, and the pretrain stage builds the converted network for continued training."""
    if case["name"] != "gqa-tied-sharded":
        pytest.skip("one case is enough")
    from tasks import cli
    from tasks.config.loader import resolve_pipeline
    from tasks.stages.pretrain import network

    root = str(case["store"].root)
    assert cli.main(["convert", "--artifacts", root, "--from-hf", str(case["hf_dir"])]) == 0
    art = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert art == case["artifact"]
    assert cli.main(["convert", "--artifacts", root, "--to-hf", str(art), str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(tmp_path / "out")
    assert cli.main(["convert", "--artifacts", root, "--to-hf", str(art), str(tmp_path / "out")]) == 1  # not empty

    cfg = resolve_pipeline(REPO / "pipelines.yaml", "tiny", [f"pretrain.init_from={art}"])
    built = network(cfg, art)
    net, mc = built.net, built.config
    assert mc.tie_embeddings and mc.num_kv_heads == 2 and mc.hidden_size == 64
    native = hf_to_native(read_hf_tensors(case["hf_dir"]), mc)
    assert all(np.array_equal(p.asnumpy(), native[p.name]) for p in net.trainable_params())


@pytest.mark.slow
def test_converted_model_runs_through_continued_pretraining_eval_and_export(case, capsys):
    """The acceptance path, through the CLI: data (base tokenizer) -> train (init_from) -> eval -> export (~40 s)."""
    if case["name"] != "gqa-tied-sharded":
        pytest.skip("one case is enough")
    from tasks import cli

    common = [
        "--config",
        str(REPO / "pipelines.yaml"),
        "--pipeline",
        "tiny",
        "--artifacts",
        str(case["store"].root),
        "--set",
        f"pretrain.init_from={case['artifact']}",
        "--set",
        "pretrain.train.loop.max_steps=4",
        "--set",
        "pretrain.train.loop.eval_steps=2",
        "--set",
        "checkpoint.save_steps=2",
        "--set",
        "eval.limit=4",
    ]

    def run(*argv: str) -> Path:
        assert cli.main([*argv, *common]) == 0, capsys.readouterr().err
        return Path(capsys.readouterr().out.strip().splitlines()[-1])

    data = run("data")
    assert (data / "tokenizer.model").read_bytes() == (case["artifact"] / "tokenizer.model").read_bytes()
    trained = run("train", "--from", str(data))
    m = ArtifactStore.read_manifest(trained)
    assert m["metrics"]["continued_from"] == str(case["artifact"]) and m["metrics"]["steps"] == 4
    assert run("eval", "--from", str(trained)).parent.name == "eval"
    assert run("export", "--from", str(trained)).parent.name == "export"


# ----------------------------------------------------------------------------- tokenizer.json models and GGUF files


def _hf_tokenizer_dir(case, tmp_path: Path, **tok_kwargs) -> Path:
    """The case's HF directory with a byte-level BPE tokenizer.json (+ tokenizer_config.json, chat template)
    instead of tokenizer.model: the layout of SmolLM2, Llama 3, Qwen."""
    from tests.helpers import train_tiny_hf_tokenizer

    d = tmp_path / "hf-json"
    shutil.copytree(case["hf_dir"], d)
    (d / "tokenizer.model").unlink()
    train_tiny_hf_tokenizer(d, **{"vocab_size": VOCAB, **tok_kwargs})
    return d


def _left_behind(store: ArtifactStore) -> list[str]:
    """Everything under the store's convert/ directory (a failed conversion must leave nothing, temp dirs included)."""
    d = store.root / "convert"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def test_a_tokenizer_json_directory_converts_and_round_trips(case, tmp_path):
    if case["name"] != "gqa-tied-sharded":
        pytest.skip("one case is enough")
    from tasks.store.model_artifact import load_tokenizer, read_info

    d = _hf_tokenizer_dir(case, tmp_path)
    store = ArtifactStore(tmp_path / "a")
    art = convert_hf(d, store)
    tok = read_info(art)["tokenizer"]
    assert tok["type"] == "hf" and tok["chat_template"] and (tok["bos_id"], tok["eos_id"]) == (1, 2)
    assert not (art / "tokenizer.model").exists()
    assert (art / "tokenizer.json").read_bytes() == (d / "tokenizer.json").read_bytes()
    # the key covers the tokenizer's bytes: another chat template is another artifact
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = cfg["chat_template"].replace("<|im_start|>", "<|im_start|> ")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert convert_hf(d, store) != art
    out = to_hf(art, tmp_path / "back")  # transformers loads weights and tokenizer
    ref = transformers.AutoTokenizer.from_pretrained(out)
    text = "Hello, world: 12 CJK 你好 😀"
    assert ref(text)["input_ids"] == load_tokenizer(art).encode(text)
    assert transformers.LlamaForCausalLM.from_pretrained(out).config.vocab_size == VOCAB


@pytest.mark.parametrize("bad", ["vocab", "template"])
def test_a_bad_tokenizer_json_is_one_clear_error_and_leaves_nothing(case, tmp_path, bad):
    if case["name"] != "gqa-tied-sharded":
        pytest.skip("one case is enough")
    if bad == "vocab":
        d = _hf_tokenizer_dir(case, tmp_path, vocab_size=VOCAB + 88)
        msg = f"the tokenizer has {VOCAB + 88} tokens but the model's vocab_size is {VOCAB}"
    else:
        d = _hf_tokenizer_dir(case, tmp_path, chat_template="{% for m in messages %}{{ m.content | nope }}{% endfor %}")
        msg = "the chat template fails to render"
    store = ArtifactStore(tmp_path / "a")
    with pytest.raises(ConversionError, match=re.escape(msg)):
        convert_hf(d, store)
    assert _left_behind(store) == []


def test_gguf_of_another_architecture_or_truncated_via_the_cli(case, tmp_path, capsys):
    """One line naming the file and what is wrong, exit 1, nothing written."""
    if case["name"] != "gqa-tied-sharded":
        pytest.skip("one case is enough")
    import gguf

    from model.gguf import write_gguf
    from tasks import cli
    from tasks.deploy.gguf_export import tokenizer_meta
    from tasks.store.model_artifact import load_tokenizer, model_config
    from tasks.store.tensors import load_weights

    store = ArtifactStore(tmp_path / "a")
    art = convert_hf(_hf_tokenizer_dir(case, tmp_path), ArtifactStore(tmp_path / "src"))  # a tokenizer.json model
    w = gguf.GGUFWriter(str(tmp_path / "qwen.gguf"), "qwen2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    good = tmp_path / "good.gguf"
    write_gguf(good, model_config(art), load_weights(art), tokenizer_meta(load_tokenizer(art)), qtype="F16")
    (tmp_path / "cut.gguf").write_bytes(good.read_bytes()[:-4096])
    sp_vocab = tmp_path / "sp.gguf"  # a SentencePiece vocabulary (Llama 2's kind): not rebuilt, said so
    write_gguf(
        sp_vocab,
        model_config(case["artifact"]),
        load_weights(case["artifact"]),
        tokenizer_meta(load_tokenizer(case["artifact"])),
        qtype="F32",
    )
    for f, words in (
        ("qwen.gguf", "general.architecture='qwen2'; only 'llama'"),
        ("cut.gguf", "truncated"),
        ("sp.gguf", "tokenizer.ggml.model='llama' (a SentencePiece vocabulary)"),
    ):
        assert cli.main(["convert", "--artifacts", str(store.root), "--from-gguf", str(tmp_path / f)]) == 1
        err = capsys.readouterr().err
        assert words in err and f in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert _left_behind(store) == []
    # the complete file converts, and its weights are the artifact's F16-rounded ones
    assert cli.main(["convert", "--artifacts", str(store.root), "--from-gguf", str(good)]) == 0
    back = Path(capsys.readouterr().out.strip().splitlines()[-1])
    src = load_weights(art)
    assert all(
        np.array_equal(v, src[k].astype(np.float16).astype(np.float32)) if v.ndim == 2 else np.array_equal(v, src[k])
        for k, v in load_weights(back).items()
    )
    assert (
        ArtifactStore.read_manifest(back)["inputs"][0]["sha256"]
        == __import__("hashlib").sha256(good.read_bytes()).hexdigest()
    )  # keyed by the file's bytes: lineage reaches it


@pytest.mark.slow
def test_a_tokenizer_json_model_runs_through_every_stage_and_serves_chat(case, tmp_path, capsys):
    """A tokenizer.json-only LLaMA directory, as pretrain.init_from: converted, continued (the data stage tokenizes
    with its tokenizer.json, nothing retrained), LoRA-finetuned through its chat template, evaluated, exported
    (ONNX + genai files with its own tokenizer, GGUF) and served: chat completions through the chat template."""
    if case["name"] != "gqa-tied-sharded":
        pytest.skip("one case is enough")
    from tasks import cli
    from tasks.prompts import chat_example
    from tasks.store.model_artifact import load_tokenizer
    from tests.test_serving import Server

    d = _hf_tokenizer_dir(case, tmp_path)
    root = tmp_path / "art"
    common = [
        "--config",
        str(REPO / "pipelines.yaml"),
        "--pipeline",
        "tiny",
        "--artifacts",
        str(root),
        "--set",
        f"pretrain.init_from={d}",
        "--set",
        "pretrain.train.loop.max_steps=4",
        "--set",
        "pretrain.train.loop.eval_steps=2",
        "--set",
        "checkpoint.save_steps=2",
        "--set",
        "eval.limit=4",
        "--set",
        "finetune.train.loop.max_steps=4",
        "--set",
        "finetune.train.loop.eval_steps=2",
        "--set",
        "finetune.train.loop.save_steps=2",
        "--set",
        "export.formats=[onnx, gguf]",
        "--set",
        "export.gguf_types=[F16]",
    ]

    def run(*argv: str) -> Path:
        assert cli.main([*argv, *common]) == 0, capsys.readouterr().err
        return Path(capsys.readouterr().out.strip().splitlines()[-1])

    data = run("data")
    assert (data / "tokenizer.json").read_bytes() == (d / "tokenizer.json").read_bytes()
    assert not (data / "tokenizer.model").exists()
    trained = run("train", "--from", str(data))
    assert ArtifactStore.read_manifest(trained)["metrics"]["steps"] == 4
    tok = load_tokenizer(trained)
    assert tok.kind == "hf" and tok.chat_template is not None
    ft = run("finetune", "--from", str(trained))
    assert json.loads((ft / "adapter.json").read_text())["template"] == "chat_template of the tokenizer"
    ids, trained_mask = chat_example(tok, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])
    assert any(trained_mask) and not all(trained_mask)
    ev = run("eval", "--from", str(ft))
    assert ev.parent.name == "eval"
    ex = run("export", "--from", str(ft))
    files = {p.name for p in ex.iterdir()}
    assert {"model.onnx", "genai_config.json", "tokenizer.json", "tokenizer_config.json", "model.f16.gguf"} <= files
    assert (ex / "tokenizer.json").read_bytes() == (d / "tokenizer.json").read_bytes()
    v = ArtifactStore.read_manifest(ex)["verification"]
    assert v["greedy_tokens_match"] and v["gguf"]["files"]["F16"]["weights_equal_rounding"]
    srv = Server(ex, tmp_path)
    try:
        msgs = [{"role": "user", "content": "Who art thou?"}]
        r = srv.client().chat.completions.create(model=srv.model, messages=msgs, temperature=0, max_tokens=8)
        assert r.usage.prompt_tokens == len(tok.encode(tok.render_chat(msgs)))  # rendered by the chat template
    finally:
        srv.stop()
