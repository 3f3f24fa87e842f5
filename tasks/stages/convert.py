"""The convert stage: a Hugging Face LLaMA directory or a GGUF file <-> a model artifact.

    path = prepare("convert", store, source=Path("hf/TinyLlama")).run()   # <root>/convert/<key>/, a model artifact
    path = prepare("convert", store, source=Path("SmolLM2.Q4_1.gguf")).run()  # dequantized to float32
    to_hf(path, "out/hf-llama")   # config.json + model.safetensors + the tokenizer files

    msllm convert --from-hf DIR                    # prints the artifact path last
    msllm convert --from-gguf FILE
    msllm convert --to-hf ARTIFACT DIR

The HF directory must hold config.json, model.safetensors (or sharded
model-*.safetensors with model.safetensors.index.json; no pickle files) and
the tokenizer: a SentencePiece tokenizer.model, or a tokenizer.json (with
tokenizer_config.json for its special tokens, and the chat template in
chat_template.jinja or tokenizer_config.json). A GGUF file carries all of it
(llama.* metadata, tokenizer.ggml.*, tokenizer.chat_template; model/gguf.py
reads it). The artifact is keyed by the sha256 of those raw files (recorded as
its inputs, so lineage reaches them) and the stage's code; it can be continued-pretrained (`pretrain.init_from`),
finetuned, evaluated and exported like any pretrain artifact. The key mapping, config
translation and shape checks live in model/convert.py.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from model.convert import (
    ConversionError,
    check_layer_count,
    config_from_hf,
    config_to_hf,
    hf_to_native,
    native_to_hf,
    nonfinite,
)
from tasks.stages import code_version
from tasks.store.artifacts import ArtifactStore, raw_file_input
from tasks.store.model_artifact import model_config, read_info, write_model
from tasks.store.tensors import load_weights, read_tensors
from tasks.tokenizer import (
    check_chat_template,
    copy_tokenizer_files,
    hf_files_from_gguf,
    load_tokenizer,
    tokenizer_files,
)
from tasks.tokenizer_error import TokenizerError

STAGE = "convert"
INDEX = "model.safetensors.index.json"


def _np_dtype(name: str):
    if name == "bfloat16":
        return ml_dtypes.bfloat16
    if name not in ("float32", "float16"):
        raise ConversionError(f"dtype {name!r}: choose float32, bfloat16 or float16")
    return np.dtype(name)


def weight_files(hf_dir: Path) -> list[Path]:
    """The safetensors files of an HF directory: model.safetensors, else the shards its index lists."""
    if (hf_dir / "model.safetensors").is_file():
        return [hf_dir / "model.safetensors"]
    if (hf_dir / INDEX).is_file():
        shards = sorted(set(json.loads((hf_dir / INDEX).read_text())["weight_map"].values()))
        for s in shards:
            if not (hf_dir / s).is_file():
                raise FileNotFoundError(f"{hf_dir / INDEX} lists {s}, which is missing")
        return [hf_dir / s for s in shards]
    hint = (
        " (pickle .bin checkpoints are not read: re-save with safe_serialization)" if any(hf_dir.glob("*.bin")) else ""
    )
    raise FileNotFoundError(f"{hf_dir}: no model.safetensors or {INDEX}{hint}")


def read_hf_tensors(hf_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of the directory's safetensors file(s), by HF key; a key in two shards raises."""
    files = weight_files(hf_dir)
    sharded = not (hf_dir / "model.safetensors").is_file()
    weight_map = json.loads((hf_dir / INDEX).read_text())["weight_map"] if sharded else None
    out: dict[str, np.ndarray] = {}
    for f in files:
        for k, v in read_tensors(f, "re-download or re-save the HF checkpoint").items():
            if bad := nonfinite(k, v):
                raise ConversionError(f"{f}: {bad}; the checkpoint is corrupt: re-download or re-save it")
            if k in out:
                raise ConversionError(f"{k}: found in more than one shard ({f.name} and another)")
            if sharded and weight_map.get(k) != f.name:
                raise ConversionError(f"{k}: in {f.name} but {INDEX} maps it to {weight_map.get(k)}")
            out[k] = v
    if sharded and set(weight_map) - set(out):
        raise ConversionError(f"{INDEX} lists keys no shard holds: {', '.join(sorted(set(weight_map) - set(out)))}")
    return out


def _json_object(path: Path) -> dict:
    """A JSON file that must hold an object (config.json); ConversionError naming the file otherwise."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConversionError(f"{path}: not valid JSON ({exc}); re-download or re-save it") from None
    if not isinstance(value, dict):
        kind = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(value), "null")
        raise ConversionError(
            f"{path}: holds a JSON {kind}, not an object; a Hugging Face config.json maps "
            "model_type, hidden_size, ... to values: re-download or re-save it"
        )
    return value


def _source_dtype(tensors: dict[str, np.ndarray]) -> str:
    kinds = {str(v.dtype) for v in tensors.values()}
    return kinds.pop() if len(kinds) == 1 else "float32"


# ----------------------------------------------------------------------------- HF -> artifact


def _check_tokenizer(tok, vocab_size: int, where: Path) -> None:
    """The tokenizer must fit the embedding and its chat template must render (before anything is written)."""
    if tok.vocab_size > vocab_size:
        raise ConversionError(
            f"{where}: the tokenizer has {tok.vocab_size} tokens but the model's vocab_size is "
            f"{vocab_size}; this is not the model's tokenizer"
        )
    if tok.eos_id() < 0:
        raise ConversionError(
            f"{where}: the tokenizer names no EOS token (eos_token in tokenizer_config.json); "
            "generation could not stop: add it"
        )
    check_chat_template(tok)


def from_hf(hf_dir: str | os.PathLike, store: ArtifactStore, pipeline: str | None = None, *, keyed: tuple) -> Path:
    """The convert artifact of an HF LLaMA directory, converting it unless the store already has it.

    The tokenizer is the directory's tokenizer.model (SentencePiece) or, without one, its tokenizer.json with
    tokenizer_config.json and chat_template.jinja where present; generation_config.json is kept too.
    `keyed`: `stage_key(store, hf_dir, "hf")`, from `run`.
    """
    hf_dir = Path(hf_dir)
    key, inputs, config = keyed
    tok_files, gen_cfg = tokenizer_files(hf_dir), hf_dir / "generation_config.json"
    hit = store.lookup(STAGE, key)
    if hit is not None:
        return hit
    with store.claim(STAGE, key) as hit:  # one conversion per key: an identical run waits, then uses what it published
        return hit or _convert_hf(hf_dir, store, pipeline, key, inputs, config, tok_files, gen_cfg)


def _convert_hf(
    hf_dir: Path,
    store: ArtifactStore,
    pipeline: str | None,
    key: str,
    inputs: list,
    config: dict,
    tok_files: list,
    gen_cfg: Path,
) -> Path:
    """Convert the HF directory and publish its artifact `key` (under the stage lock: `from_hf`)."""
    hf_config = _json_object(hf_dir / "config.json")
    cfg = config_from_hf(hf_config)
    try:
        tok = load_tokenizer(hf_dir)
        _check_tokenizer(tok, cfg.vocab_size, tok_files[0])
    except TokenizerError as exc:
        raise ConversionError(str(exc)) from None
    hf_tensors = read_hf_tensors(hf_dir)
    check_layer_count(
        cfg.num_layers,
        hf_tensors,
        "model.layers.",
        f"{hf_dir / 'config.json'}: num_hidden_layers",
        "re-download or re-save the checkpoint",
    )
    weights = hf_to_native(hf_tensors, cfg)
    source = {"format": "hf", "dir": str(hf_dir.resolve()), "dtype": _source_dtype(hf_tensors)}
    with store.build(STAGE, key, pipeline=pipeline, config=config, inputs=inputs, code=code_version(STAGE)) as b:
        write_model(
            b.dir,
            name="llama",
            config=cfg,
            weights=weights,
            tokenizer_model=hf_dir,
            tokenizer_info=tok.info(),
            seq_length=cfg.max_seq_length,
            extra={"source": source},
        )
        if gen_cfg.is_file():
            shutil.copy2(gen_cfg, b.dir / gen_cfg.name)
        b.metrics.update(parameters=cfg.num_parameters, source_dtype=source["dtype"], tensors=len(hf_tensors))
    return b.path


def from_gguf(gguf_file: str | os.PathLike, store: ArtifactStore, pipeline: str | None = None, *, keyed: tuple) -> Path:
    """The convert artifact of a llama GGUF file: weights dequantized to float32 (F32, F16, BF16, Q8_0, Q4_0, Q4_1,
    ...), the config from its llama.* metadata, the tokenizer rebuilt as a tokenizer.json from tokenizer.ggml.*
    (with the chat template). Keyed by the file's sha256 (its raw input, so lineage reaches it); `keyed`:
    `stage_key(store, gguf_file, "gguf")`, from `run`."""
    src = Path(gguf_file)
    key, inputs, config = keyed
    hit = store.lookup(STAGE, key)
    if hit is not None:
        return hit
    with store.claim(STAGE, key) as hit:  # one conversion per key: an identical run waits, then uses what it published
        return hit or _convert_gguf(src, store, pipeline, key, inputs, config)


def _convert_gguf(src: Path, store: ArtifactStore, pipeline: str | None, key: str, inputs: list, config: dict) -> Path:
    """Convert the GGUF file and publish its artifact `key` (under the stage lock: `from_gguf`)."""
    from model.gguf import GGUFError, config_from_meta, read_gguf, read_metadata  # lazy: gguf, for GGUF sources only

    try:
        opened = read_metadata(src)  # layout checked: every tensor aligned, inside the data section, apart
        cfg = config_from_meta(opened[1], str(src))  # the architecture first: a qwen2 file is named as such
        tok_files = hf_files_from_gguf(opened[1], str(src))  # then the tokenizer, before any tensor is dequantized
    except (GGUFError, TokenizerError) as exc:
        raise ConversionError(str(exc)) from None
    with tempfile.TemporaryDirectory(prefix="msllm-gguf-tokenizer-") as td:
        tok_dir = Path(td)
        for name, content in tok_files.items():
            (tok_dir / name).write_text(json.dumps(content, ensure_ascii=False), encoding="utf-8")
        try:
            tok = load_tokenizer(tok_dir)
            _check_tokenizer(tok, cfg.vocab_size, src)
        except TokenizerError as exc:  # named by the GGUF file, not by this temp directory
            raise ConversionError(_from_gguf_metadata(str(exc), tok_dir, src)) from None
        try:
            meta, cfg, weights, types = read_gguf(src, opened)  # dequantized, every value finite
        except GGUFError as exc:
            raise ConversionError(str(exc)) from None
        source = {
            "format": "gguf",
            "file": str(src.resolve()),
            "name": meta.get("general.name"),
            "tensor_types": dict(sorted(Counter(types.values()).items())),
            "dtype": "float32",
        }
        with store.build(STAGE, key, pipeline=pipeline, config=config, inputs=inputs, code=code_version(STAGE)) as b:
            write_model(
                b.dir,
                name="llama",
                config=cfg,
                weights=weights,
                tokenizer_model=tok_dir,
                tokenizer_info=tok.info(),
                seq_length=cfg.max_seq_length,
                extra={"source": source},
            )
            b.metrics.update(
                parameters=cfg.num_parameters,
                source_dtype="gguf",
                tensors=len(types),
                tensor_types=source["tensor_types"],
            )
    return b.path


def _from_gguf_metadata(message: str, tok_dir: Path, src: Path) -> str:
    """A tokenizer error about the tokenizer.json rebuilt in `tok_dir`, said of the GGUF file and its keys."""
    text = message.replace(f"{tok_dir}{os.sep}", "").replace(str(tok_dir), "").lstrip(": ")
    text = text.replace("chat_template.jinja or tokenizer_config.json's chat_template", "tokenizer.chat_template")
    if text.startswith(f"{src}:"):
        return text
    return f"{src}: the tokenizer rebuilt from its tokenizer.ggml.* metadata: {text}"


def source_kind(path: str | os.PathLike) -> str | None:
    """What `path` is to convert: "gguf" (a .gguf file), "hf" (a directory with config.json that is not an
    artifact), or None (anything else: an artifact of the store, by path, stage/key or key)."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return "gguf"
    if p.is_dir() and (p / "config.json").is_file() and not (p / "manifest.json").is_file():
        return "hf"
    return None


def source_files(source: Path, kind: str) -> list[Path]:
    """The raw files a conversion reads (its inputs, hashed into the key): the GGUF file; or the HF directory's
    config.json, [the shard index,] safetensors, tokenizer files and generation_config.json."""
    if kind == "gguf":
        if not source.is_file():
            raise FileNotFoundError(f"{source}: no such GGUF file")
        return [source]
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"{source}: no config.json; pass a Hugging Face LlamaForCausalLM directory")
    tok_files = tokenizer_files(source)
    if not tok_files:
        raise FileNotFoundError(
            f"{source}: no tokenizer.model or tokenizer.json; the artifact needs the tokenizer "
            "the weights were trained with (copy it into the directory)"
        )
    gen_cfg = source / "generation_config.json"
    files = [source / "config.json", *weight_files(source), *tok_files] + ([gen_cfg] if gen_cfg.is_file() else [])
    if (source / INDEX).is_file() and not (source / "model.safetensors").is_file():
        files.insert(1, source / INDEX)
    return files


def stage_key(
    store: ArtifactStore, source: str | os.PathLike, kind: str | None = None
) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """(key, inputs, config) of the convert artifact of a GGUF file or an HF directory (`kind`: "gguf" or "hf",
    default source_kind's): keyed by the sha256 of the raw files it reads and the stage's code."""
    source = Path(source)
    kind = kind or source_kind(source)
    if kind not in ("gguf", "hf"):
        raise FileNotFoundError(
            f"{source}: neither a .gguf file nor a Hugging Face directory (config.json); nothing to convert"
        )
    inputs = [raw_file_input(f) for f in source_files(source, kind)]
    config = {"from": kind}
    return store.key(STAGE, config, inputs, code_version(STAGE)), inputs, config


def run(
    store: ArtifactStore,
    source: str | os.PathLike,
    pipeline: str | None = None,
    progress: bool = True,
    *,
    kind: str | None = None,
    keyed: tuple,
) -> Path:
    """The convert artifact of a GGUF file or an HF directory (converted unless the store has it), with a log
    line on stderr saying what it read and what it wrote (`progress`).

    kind: "gguf" or "hf" (default: `source_kind`'s). keyed: what `stage_key` returned for these arguments,
    from the stage runner (tasks/stages/runner.py), which resolved the inputs, checked the machine and computed it
    once."""
    log = (lambda msg: print(f"convert: {msg}", file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    source = Path(source)
    kind = kind or source_kind(source)
    key = keyed[0]
    hit = store.lookup(STAGE, key)
    if hit is not None:
        log(f"cache hit {hit}")
        return hit
    what = f"GGUF file ({source.stat().st_size / 1e6:.1f} MB)" if kind == "gguf" else "Hugging Face directory"
    log(f"{source}: a {what}; converting to a model artifact")
    t0 = time.perf_counter()
    path = (from_gguf if kind == "gguf" else from_hf)(source, store, pipeline=pipeline, keyed=keyed)
    m = ArtifactStore.read_manifest(path)["metrics"]
    log(
        f"wrote {path}: {m.get('parameters', 0) / 1e6:.1f}M parameters from {m.get('source_dtype')} "
        f"({m.get('tensors')} tensors) in {time.perf_counter() - t0:.1f}s"
    )
    return path


# ----------------------------------------------------------------------------- artifact -> HF


def to_hf(artifact: str | os.PathLike, out_dir: str | os.PathLike, dtype: str | None = None) -> Path:
    """Write an HF LlamaForCausalLM directory (config.json, model.safetensors, the tokenizer files: tokenizer.model
    or tokenizer.json + tokenizer_config.json + chat template; generation_config.json when the source had one) from
    a model artifact, so transformers loads it (AutoModelForCausalLM / AutoTokenizer.from_pretrained).

    dtype: float32, bfloat16 or float16; default the dtype the artifact was converted from
    (float32 for trained artifacts). Written into a temp dir beside out_dir, then renamed;
    out_dir must not exist or be empty.
    """
    artifact, out_dir = Path(artifact), Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir}: exists and is not an empty directory; choose a new one")
    info = read_info(artifact)
    if info.get("name", "llama") != "llama":
        raise ConversionError(f"{artifact}: model {info['name']!r}; only llama converts to HF LlamaForCausalLM")
    cfg = model_config(artifact)
    dtype = dtype or info.get("source", {}).get("dtype", "float32")
    hf = native_to_hf(load_weights(artifact), cfg, _np_dtype(dtype))
    hf_config = config_to_hf(cfg, dtype)
    tok = info.get("tokenizer", {})
    hf_config.update(
        {
            k: (v if v is not None and v >= 0 else None)
            for k, v in (
                ("bos_token_id", tok.get("bos_id")),
                ("eos_token_id", tok.get("eos_id")),
                ("pad_token_id", tok.get("pad_id")),
            )
        }
    )

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".tmp-{out_dir.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        save_file(hf, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        copy_tokenizer_files(artifact, tmp)
        if (artifact / "generation_config.json").is_file():
            shutil.copy2(artifact / "generation_config.json", tmp / "generation_config.json")
        if out_dir.exists():
            out_dir.rmdir()
        os.rename(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
