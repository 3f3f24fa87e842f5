"""Crafted GGUF files and HF directories against convert, and non-finite weights against every loader (issue 35).

A tiny valid llama GGUF (F32, 1 layer, a byte-level BPE tokenizer trained here) is written with model/gguf.py and
then patched in place with the `gguf` package's own reader (mode "r+": a field's bytes are a writable view of the
file), as a crafted file would be: a tensor offset moved off the alignment, a tensor laid over another, a
metadata value changed, a token's bytes made invalid UTF-8. Each must be refused with one line naming the file and
the tensor or key, leaving nothing in the store; a model whose weights hold NaN/Inf is refused by convert (GGUF
and HF), predict, serve and export, naming the tensor.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import run_stage, train_tiny_hf_tokenizer

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return train_tiny_hf_tokenizer(tmp_path_factory.mktemp("tok") / "tok", vocab_size=300)


@pytest.fixture(scope="module")
def tmeta(tok_dir) -> dict:
    from tasks.deploy.gguf_export import tokenizer_meta
    from tasks.tokenizer import load_tokenizer

    return tokenizer_meta(load_tokenizer(tok_dir))


def _cfg(vocab: int):
    from fuzz.seeds import tiny_config  # the fuzzers' seed model is this one

    return tiny_config(vocab)


def _weights(cfg, seed: int = 0) -> dict[str, np.ndarray]:
    from model.convert import key_pairs

    rng = np.random.default_rng(seed)
    return {
        ours: (1.0 + 0.1 * rng.standard_normal(shape) if len(shape) == 1 else 0.1 * rng.standard_normal(shape)).astype(
            np.float32
        )
        for _, ours, shape in key_pairs(cfg)
    }


def _gguf(path: Path, tmeta: dict, *, weights=None, qtype: str = "F32", **meta_changes) -> Path:
    """A tiny llama GGUF; meta_changes: tokenizer.ggml.* keys replaced (None: left out)."""
    from model.gguf import write_gguf

    cfg = _cfg(len(tmeta["tokenizer.ggml.tokens"]))
    meta = dict(tmeta)
    for k, v in meta_changes.items():
        k = k.replace("__", ".")
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v
    write_gguf(path, cfg, weights if weights is not None else _weights(cfg), meta, qtype=qtype)
    return path


def _patch(path: Path, fn) -> None:
    """Change the file in place through gguf's reader: fn(reader) edits the views of its fields."""
    import gguf

    r = gguf.GGUFReader(str(path), "r+")
    fn(r)
    r.data.flush()
    del r


def _tensor(r, name: str):
    return next(t for t in r.tensors if t.name == name)


def _convert(capsys, store_root: Path, *args: str) -> tuple[int, str]:
    from tasks import cli

    rc = cli.main(["convert", "--artifacts", str(store_root), *args])
    return rc, capsys.readouterr().err


def _one_line(err: str) -> str:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


def _left_behind(root: Path) -> list[str]:
    d = root / "convert"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


# ----------------------------------------------------------------------------- the tensor layout


def test_the_untouched_file_converts(tmp_path, tmeta, capsys):
    f = _gguf(tmp_path / "ok.gguf", tmeta)
    rc, err = _convert(capsys, tmp_path / "a", "--from-gguf", str(f))
    assert rc == 0, err


@pytest.mark.parametrize("shift", [2, 4, 16])
def test_an_unaligned_tensor_offset_is_refused_naming_the_tensor(tmp_path, tmeta, capsys, shift):
    """+2 bytes reads float32s across element boundaries (NaN/Inf, 3.4e38: the issue's case); +4 and +16 read every
    value one or four elements along, all finite: a silently shifted embedding. Both are off the 32-byte alignment."""
    f = _gguf(tmp_path / "shifted.gguf", tmeta)

    def shift_embd(r):
        _tensor(r, "token_embd.weight").field.parts[-1][0] += shift

    _patch(f, shift_embd)
    rc, err = _convert(capsys, tmp_path / "a", "--from-gguf", str(f))
    line = _one_line(err)
    assert rc == 1 and "shifted.gguf" in line and "token_embd.weight" in line, line
    assert f"offset {shift} " in line and "not a multiple of the alignment 32" in line, line
    assert _left_behind(tmp_path / "a") == []


def test_a_tensor_laid_over_another_is_refused(tmp_path, tmeta):
    from model.gguf import GGUFError, read_gguf

    f = _gguf(tmp_path / "overlap.gguf", tmeta)

    def overlay(r):  # aligned and inside the file, but on top of the embedding's bytes
        _tensor(r, "blk.0.attn_k.weight").field.parts[-1][0] = _tensor(r, "token_embd.weight").field.parts[-1][0]

    _patch(f, overlay)
    with pytest.raises(
        GGUFError,
        match=r"overlap\.gguf: tensor blk\.0\.attn_k\.weight .*overlaps tensor "
        r"token_embd\.weight",
    ):
        read_gguf(f)


def test_a_tensor_past_the_end_of_the_file_is_refused(tmp_path, tmeta):
    from model.gguf import GGUFError, read_metadata

    f = _gguf(tmp_path / "past.gguf", tmeta)
    size = f.stat().st_size

    def move(r):
        _tensor(r, "output_norm.weight").field.parts[-1][0] = (size // 32) * 32

    _patch(f, move)
    with pytest.raises(GGUFError, match=r"past\.gguf: (tensor output_norm\.weight|not a readable GGUF)"):
        read_metadata(f)


# ----------------------------------------------------------------------------- non-finite weights


@pytest.mark.parametrize("qtype,value", [("F32", np.nan), ("F16", np.inf), ("F32", -np.inf)])
def test_a_non_finite_gguf_weight_is_refused_naming_the_tensor(tmp_path, tmeta, capsys, qtype, value):
    cfg = _cfg(len(tmeta["tokenizer.ggml.tokens"]))
    w = _weights(cfg)
    w["layers.0.mlp.down_proj.weight"][3, 5] = value
    f = _gguf(tmp_path / "nan.gguf", tmeta, weights=w, qtype=qtype)
    rc, err = _convert(capsys, tmp_path / "a", "--from-gguf", str(f))
    line = _one_line(err)
    assert rc == 1 and "nan.gguf" in line and "tensor blk.0.ffn_down.weight holds 1 NaN/Inf value" in line, line
    assert _left_behind(tmp_path / "a") == []


def _hf_dir(tmp_path: Path, tok_dir: Path, weights=None) -> Path:
    from safetensors.numpy import save_file

    from model.convert import config_to_hf, native_to_hf
    from tasks.tokenizer import load_tokenizer

    d = tmp_path / "hf"
    shutil.copytree(tok_dir, d)
    cfg = _cfg(load_tokenizer(tok_dir).vocab_size)
    (d / "config.json").write_text(json.dumps(config_to_hf(cfg)))
    save_file(native_to_hf(weights if weights is not None else _weights(cfg), cfg), str(d / "model.safetensors"))
    return d


def test_a_non_finite_hf_weight_is_refused_naming_the_tensor_and_file(tmp_path, tok_dir, capsys):
    from tasks.tokenizer import load_tokenizer

    w = _weights(_cfg(load_tokenizer(tok_dir).vocab_size))
    w["layers.0.self_attn.v_proj.weight"][0, 0] = np.nan
    d = _hf_dir(tmp_path, tok_dir, w)
    rc, err = _convert(capsys, tmp_path / "a", "--from-hf", str(d))
    line = _one_line(err)
    assert rc == 1 and str(d / "model.safetensors") in line, line
    assert "tensor model.layers.0.self_attn.v_proj.weight holds 1 NaN/Inf value" in line, line
    assert _left_behind(tmp_path / "a") == []


@pytest.fixture(scope="module")
def nan_model(tmp_path_factory, tok_dir) -> Path:
    """A model artifact whose embedding holds a NaN, published the way an older convert did (no check on write)."""
    from tasks.store.artifacts import ArtifactStore
    from tasks.store.model_artifact import write_model
    from tasks.tokenizer import load_tokenizer

    tok = load_tokenizer(tok_dir)
    cfg = _cfg(tok.vocab_size)
    w = _weights(cfg)
    w["embed_tokens.weight"][7, 1] = np.nan
    w["embed_tokens.weight"][9, 2] = np.inf
    store = ArtifactStore(tmp_path_factory.mktemp("nan") / "artifacts")
    key = store.key("convert", {"nan": True}, [], "test")
    with store.build("convert", key, pipeline="tiny", config={}, inputs=[], code="test") as b:
        write_model(
            b.dir,
            name="llama",
            config=cfg,
            weights=w,
            tokenizer_model=tok_dir,
            tokenizer_info=tok.info(),
            seq_length=cfg.max_seq_length,
        )
    return b.path


NAN_LINE = "tensor embed_tokens.weight holds 2 NaN/Inf values"


def test_loading_a_non_finite_model_is_refused_naming_the_tensor_and_file(nan_model):
    from tasks.modeling.build import load_network
    from tasks.store.tensors import CheckpointError, load_weights

    for load in (load_weights, load_network):
        with pytest.raises(CheckpointError, match=re.escape(f"{nan_model / 'model.safetensors'}: {NAN_LINE}")):
            load(nan_model)


def test_predict_refuses_a_non_finite_model_in_one_line(nan_model, capsys):
    """Before: predict answered "⁇ ⁇ ⁇" with exit 0."""
    from tasks import cli

    argv = [
        "predict",
        "--config",
        str(REPO / "pipelines.yaml"),
        "--pipeline",
        "tiny",
        "--artifacts",
        str(nan_model.parent.parent),
        "--from",
        str(nan_model),
        "Hello",
    ]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    errors = [ln for ln in err.strip().splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and NAN_LINE in errors[0] and "model.safetensors" in errors[0], err
    assert "Traceback" not in err


def test_serve_refuses_a_non_finite_model_in_one_line(nan_model):
    """Before: served it (a child process here, so that the old behaviour is a timeout, not a hung test)."""
    import subprocess
    import sys

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tasks.cli",
            "serve",
            "--artifacts",
            str(nan_model.parent.parent),
            str(nan_model),
            "--port",
            "0",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("error:")]
    assert r.returncode == 1 and len(errors) == 1, r.stderr
    assert NAN_LINE in errors[0] and "model.safetensors" in errors[0] and "Traceback" not in r.stderr, r.stderr


def test_export_refuses_a_non_finite_model_naming_the_tensor(nan_model):
    """Before: "max |Δlogit| nan > nan"."""
    from tasks.config.loader import resolve_pipeline
    from tasks.store.artifacts import ArtifactStore
    from tasks.store.tensors import CheckpointError

    cfg = resolve_pipeline(REPO / "pipelines.yaml", "tiny", ["export.formats=[gguf]"])
    with pytest.raises(CheckpointError, match=re.escape(NAN_LINE)):
        run_stage("export", cfg, ArtifactStore(nan_model.parent.parent), nan_model, progress=False, isolate=False)


def test_the_export_check_names_the_tensor_when_logits_are_not_finite(tmp_path):
    """Finite weights whose logits overflow float32 (3.4e38, the largest float32, as in the issue's embedding), or a
    NaN set on the network after loading: the check names the tensor instead of comparing NaN with NaN."""
    import mindspore as ms

    from model.llama import LlamaForCausalLM
    from tasks.deploy.checks import ExportCheckFailed, Reference

    net = LlamaForCausalLM(_cfg(64), seed=0)
    net.set_train(False)
    params = {p.name: p for p in net.trainable_params()}
    x = np.array([[1, 2, 3]], np.int32)
    assert np.isfinite(Reference(net)(x)).all()
    norm = params["norm.weight"]
    norm.set_data(ms.Tensor(np.full(norm.shape, 3.4e38, np.float32)))
    with pytest.raises(
        ExportCheckFailed,
        match=r"MindSpore's logits are NaN/Inf though every weight is finite: "
        r"the largest, \|3\.4e\+38\| in norm\.weight",
    ):
        Reference(net)(x)
    w = params["layers.0.mlp.up_proj.weight"]
    bad = w.asnumpy()
    bad[0, 0] = np.nan
    w.set_data(ms.Tensor(bad))
    with pytest.raises(ExportCheckFailed, match=r"tensor layers\.0\.mlp\.up_proj\.weight holds 1 NaN/Inf value"):
        Reference(net)(x)


# ----------------------------------------------------------------------------- metadata: one line naming the key


def _set(key: str, value):
    def fn(r):
        r.fields[key].parts[-1][0] = value

    return fn


def _bad_utf8_token(i: int):
    def fn(r):
        f = r.fields["tokenizer.ggml.tokens"]
        f.parts[f.data[i]][0] = 0xFF

    return fn


CASES = {
    # name: (tokenizer metadata changes, in-place patch, words of the one line)
    "no tokens": ({"tokenizer__ggml__tokens": None}, None, "metadata tokenizer.ggml.tokens is missing"),
    "int merges": ({"tokenizer__ggml__merges": [1, 2, 3]}, None, "tokenizer.ggml.merges[0] is 1, not a string"),
    "merge of unknown tokens": (
        {"tokenizer__ggml__merges": ["zz qq"]},
        None,
        "tokenizer.ggml.merges[0] 'zz qq': 'zz' is not in tokenizer.ggml.tokens",
    ),
    "int tokens": ({"tokenizer__ggml__tokens": list(range(300))}, None, "tokenizer.ggml.tokens[0] is 0, not a string"),
    "short token types": (
        {"tokenizer__ggml__token_type": [1, 1, 3]},
        None,
        "tokenizer.ggml.token_type has 3 entries, tokenizer.ggml.tokens 300",
    ),
    "bos 10^6": (
        {"tokenizer__ggml__add_bos_token": True},
        _set("tokenizer.ggml.bos_token_id", 10**6),
        "tokenizer.ggml.bos_token_id=1000000 is outside the vocabulary (300 tokens)",
    ),
    "eos 10^6": (
        {},
        _set("tokenizer.ggml.eos_token_id", 10**6),
        "tokenizer.ggml.eos_token_id=1000000 is outside the vocabulary (300 tokens)",
    ),
    "head_count 0": (
        {},
        _set("llama.attention.head_count", 0),
        "llama.attention.head_count=0 must be a positive whole number",
    ),
    "block_count 0": ({}, _set("llama.block_count", 0), "llama.block_count=0 must be a positive whole number"),
    # before: the expected tensor list built for every claimed layer, killed at 4 GB after ~50 s (issue 53)
    "block_count 10^9": (
        {},
        _set("llama.block_count", 10**9),
        "llama.block_count=1000000000 layers, but the tensors hold 1 (blk.0 … blk.0)",
    ),
    "block_count 2": ({}, _set("llama.block_count", 2), "llama.block_count=2 layers, but the tensors hold 1"),
    "head_count_kv 3": (
        {},
        _set("llama.attention.head_count_kv", 3),
        "llama.attention.head_count=2 is not a multiple of llama.attention.head_count_kv=3",
    ),
    "NaN rope base": (
        {},
        _set("llama.rope.freq_base", np.nan),
        "llama.rope.freq_base=nan must be a positive finite number",
    ),
    "invalid UTF-8 token": ({}, _bad_utf8_token(100), "tokenizer.ggml.tokens[100] is not valid UTF-8"),
    "duplicate token": (
        {"tokenizer__ggml__tokens": ["<|endoftext|>"] * 2 + [f"t{i}" for i in range(298)]},
        None,
        "tokenizer.ggml.tokens[1] '<|endoftext|>' repeats tokenizer.ggml.tokens[0]",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_gguf_metadata_is_one_line_naming_the_key_and_file(tmp_path, tmeta, capsys, case):
    """Before: KeyError, AttributeError, IndexError, ZeroDivisionError tracebacks; "tokens not present" for invalid
    UTF-8; tokenizer errors naming the store's temp directory."""
    changes, patch, words = CASES[case]
    f = _gguf(tmp_path / "crafted.gguf", tmeta, **changes)
    if patch is not None:
        _patch(f, patch)
    rc, err = _convert(capsys, tmp_path / "a", "--from-gguf", str(f))
    line = _one_line(err)
    assert rc == 1 and str(f) in line and words in line, line
    assert "_tokenizer" not in line and ".tmp" not in line, line
    assert _left_behind(tmp_path / "a") == []


@pytest.mark.parametrize(
    "name,content,words",
    [
        ("tokenizer_config.json", [1, 2], "tokenizer_config.json: holds a JSON array, not an object"),
        ("config.json", ["llama"], "config.json: holds a JSON array, not an object"),
    ],
)
def test_hf_json_files_that_are_not_objects_are_one_line(tmp_path, tok_dir, capsys, name, content, words):
    """Before: AttributeError ('list' object has no attribute 'get')."""
    d = _hf_dir(tmp_path, tok_dir)
    (d / name).write_text(json.dumps(content))
    rc, err = _convert(capsys, tmp_path / "a", "--from-hf", str(d))
    line = _one_line(err)
    assert rc == 1 and str(d / name) in line and words in line, line
    assert _left_behind(tmp_path / "a") == []


@pytest.mark.parametrize("layers", [10**9, 10**6, 2])
def test_hf_config_claiming_more_layers_than_its_tensors_is_one_line(tmp_path, tok_dir, capsys, layers):
    """config.json's num_hidden_layers against the layers the safetensors hold, before anything is sized by it.
    Before: 10^9 (or 10^6) layers beside one layer's tensors ran at 100% CPU past 4 GB of RSS until killed."""
    import resource

    d = _hf_dir(tmp_path, tok_dir)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": layers}))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rc, err = _convert(capsys, tmp_path / "a", "--from-hf", str(d))
    line = _one_line(err)
    assert rc == 1 and str(d / "config.json") in line, line
    assert f"num_hidden_layers={layers} layers, but the tensors hold 1 (model.layers.0 … model.layers.0)" in line, line
    assert _left_behind(tmp_path / "a") == []
    # bounded work: the process's peak grew by less than 100 MB (the tiny model is ~100 KB)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 * 1024, "the claim was sized"


@pytest.mark.parametrize("qtype, fmt", [("F16", "fp16"), ("Q8_0", "q8_0")])
def test_a_gguf_loaded_in_its_own_format_holds_the_files_weights_bit_for_bit(tmp_path, tmeta, qtype, fmt):
    """An F16 or Q8_0 GGUF, converted (`msllm convert --from-gguf`: a float32 artifact) and loaded in its own format
    (`load_network(..., weights=)`, as eval, predict and `msllm serve --weights` load it): every weight matrix in
    memory is the file's own bytes (q/k rows in llama.cpp's order inside the file, ours outside). binary16 widens to
    float32 exactly; a Q8_0 block dequantizes to q * d exactly, and quantizing that again gives d (its largest |q|
    is 127, as llama.cpp's and gguf-py's quantizers write every block) and the same q. So a hub's GGUF serves in about
    its own size, no float32 copy, with nothing rounded twice."""
    import gguf

    from model.config import ModelConfig
    from model.fused_decode import build_decode_kernel, matrix_names
    from model.gguf import _permute, write_gguf
    from tasks.deploy.gguf_export import _gguf_name
    from tasks.modeling.build import load_network
    from tasks.store.artifacts import ArtifactStore
    from tests.helpers import convert_gguf

    if build_decode_kernel(True) is None:
        pytest.skip("the fused decode kernel does not build here: stored formats need it")
    cfg = ModelConfig(
        vocab_size=len(tmeta["tokenizer.ggml.tokens"]),
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_seq_length=64,
        tie_embeddings=False,
    )
    path = tmp_path / f"m.{qtype}.gguf"
    types = write_gguf(path, cfg, _weights(cfg, seed=5), dict(tmeta), qtype=qtype)
    art = convert_gguf(path, ArtifactStore(tmp_path / "store"))
    net, _ = load_network(art, weights=fmt)
    stored = {m: p.asnumpy() for m, p in zip(matrix_names(net), _operands(net.stored_weights), strict=True)}
    raw = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(path)).tensors}
    for name, mine in stored.items():
        g = _gguf_name(name)
        assert types[g] == qtype, (g, types[g])
        heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads if "k_proj" in name else 0
        if heads:
            mine = _permute(mine, heads)
        np.testing.assert_array_equal(mine.view(np.uint8), raw[g].view(np.uint8).reshape(mine.shape[0], -1), g)


def _operands(stored) -> list:
    """A DecodeWeights' matrices in `matrix_names` order: the embedding, the head (untied), each layer's seven."""
    return [stored.embed, stored.head, *stored.mats]
