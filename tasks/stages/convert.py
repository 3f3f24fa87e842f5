"""The convert stage: a Hugging Face LLaMA directory <-> a model artifact.

    path = from_hf("hf/TinyLlama", store)          # <root>/convert/<key>/, a model artifact (like pretrain's)
    to_hf(path, "out/hf-llama")                    # config.json + model.safetensors + tokenizer.model

    msllm convert --from-hf DIR                    # prints the artifact path last
    msllm convert --to-hf ARTIFACT DIR

The HF directory must hold config.json, model.safetensors (or sharded
model-*.safetensors with model.safetensors.index.json; no pickle files) and
the SentencePiece tokenizer.model. The artifact is keyed by the sha256 of those
raw files (recorded as its inputs, so lineage reaches them) and the stage's
code; it can be continued-pretrained (`pretrain.init_from`), finetuned,
evaluated and exported like any pretrain artifact. The key mapping, config
translation and shape checks live in model/convert.py.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import numpy as np

from model.convert import ConversionError, config_from_hf, config_to_hf, hf_to_native, native_to_hf
from tasks.store.artifacts import ArtifactStore, raw_file_input
from tasks.stages import code_version

STAGE = "convert"
INDEX = "model.safetensors.index.json"


def _np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

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
    hint = " (pickle .bin checkpoints are not read: re-save with safe_serialization)" if any(hf_dir.glob("*.bin")) else ""
    raise FileNotFoundError(f"{hf_dir}: no model.safetensors or {INDEX}{hint}")


def read_hf_tensors(hf_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of the directory's safetensors file(s), by HF key; a key in two shards raises."""
    from tasks.training.checkpoint import read_tensors

    files = weight_files(hf_dir)
    sharded = not (hf_dir / "model.safetensors").is_file()
    weight_map = json.loads((hf_dir / INDEX).read_text())["weight_map"] if sharded else None
    out: dict[str, np.ndarray] = {}
    for f in files:
        for k, v in read_tensors(f, "re-download or re-save the HF checkpoint").items():
            if k in out:
                raise ConversionError(f"{k}: found in more than one shard ({f.name} and another)")
            if sharded and weight_map.get(k) != f.name:
                raise ConversionError(f"{k}: in {f.name} but {INDEX} maps it to {weight_map.get(k)}")
            out[k] = v
    if sharded and set(weight_map) - set(out):
        raise ConversionError(f"{INDEX} lists keys no shard holds: {', '.join(sorted(set(weight_map) - set(out)))}")
    return out


def _source_dtype(tensors: dict[str, np.ndarray]) -> str:
    kinds = {str(v.dtype) for v in tensors.values()}
    return kinds.pop() if len(kinds) == 1 else "float32"


# ----------------------------------------------------------------------------- HF -> artifact


def from_hf(hf_dir: str | os.PathLike, store: ArtifactStore, pipeline: str | None = None) -> Path:
    """The convert artifact of an HF LLaMA directory, converting it unless the store already has it."""
    import sentencepiece as spm

    from tasks.store.model_artifact import tokenizer_info, write_model

    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir}: no config.json; pass a Hugging Face LlamaForCausalLM directory")
    tok = hf_dir / "tokenizer.model"
    if not tok.is_file():
        raise FileNotFoundError(f"{hf_dir}: no tokenizer.model; the artifact needs the SentencePiece model the "
                                "weights were trained with (copy it into the directory)")
    files = [hf_dir / "config.json", *weight_files(hf_dir), tok]
    if (hf_dir / INDEX).is_file() and not (hf_dir / "model.safetensors").is_file():
        files.insert(1, hf_dir / INDEX)
    inputs = [raw_file_input(f) for f in files]
    config = {"from": "hf"}
    key = store.key(STAGE, config, inputs, code_version(STAGE))
    hit = store.lookup(STAGE, key)
    if hit is not None:
        return hit

    hf_config = json.loads((hf_dir / "config.json").read_text())
    cfg = config_from_hf(hf_config)
    hf_tensors = read_hf_tensors(hf_dir)
    weights = hf_to_native(hf_tensors, cfg)
    sp = spm.SentencePieceProcessor(model_file=str(tok))
    if sp.get_piece_size() > cfg.vocab_size:
        raise ConversionError(f"{tok}: {sp.get_piece_size()} pieces but config.json vocab_size is {cfg.vocab_size}; "
                              "this is not the model's tokenizer")
    source = {"format": "hf", "dir": str(hf_dir.resolve()), "dtype": _source_dtype(hf_tensors)}
    with store.build(STAGE, key, pipeline=pipeline, config=config, inputs=inputs, code=code_version(STAGE)) as b:
        write_model(b.dir, name="llama", config=cfg, weights=weights, tokenizer_model=tok,
                    tokenizer_info=tokenizer_info(sp), seq_length=cfg.max_seq_length, extra={"source": source})
        b.metrics.update(parameters=cfg.num_parameters, source_dtype=source["dtype"], tensors=len(hf_tensors))
    return b.path


# ----------------------------------------------------------------------------- artifact -> HF


def to_hf(artifact: str | os.PathLike, out_dir: str | os.PathLike, dtype: str | None = None) -> Path:
    """Write an HF LlamaForCausalLM directory (config.json, model.safetensors, tokenizer.model) from a model artifact.

    dtype: float32, bfloat16 or float16; default the dtype the artifact was converted from
    (float32 for trained artifacts). Written into a temp dir beside out_dir, then renamed;
    out_dir must not exist or be empty.
    """
    from safetensors.numpy import save_file

    from tasks.training.checkpoint import load_weights
    from tasks.store.model_artifact import model_config, read_info

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
    hf_config.update({k: (v if v is not None and v >= 0 else None) for k, v in (
        ("bos_token_id", tok.get("bos_id")), ("eos_token_id", tok.get("eos_id")), ("pad_token_id", tok.get("pad_id")))})

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".tmp-{out_dir.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        save_file(hf, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        shutil.copy2(artifact / "tokenizer.model", tmp / "tokenizer.model")
        if out_dir.exists():
            out_dir.rmdir()
        os.rename(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
