"""The finetune stage: LoRA or full fine-tuning of a model artifact (merging the result: tasks/store/merge.py).

    path = run(cfg, store, base_artifact)     # supervised child process, cached by content
    merged = merge(store, path)               # tasks.store.merge: a model artifact (stage `merged`) for eval/export

Data (`finetune.sources`, tokenised with the base artifact's tokenizer.model):

- `format: instruction`: JSON Lines (or .jsonl.gz, or a .json list) of
  `{"prompt": ..., "response": ...}` or chat `{"messages": [{"role": "system"|"user"|"assistant",
  "content": ...}, ...]}`. Each example is rendered with TEMPLATE below and the loss
  covers the response tokens only (prompt, template and padding labels are -100):

      ### Instruction:\\n{prompt}\\n\\n### Response:\\n{response}</s>

  A system message renders as `### System:\\n{content}\\n\\n`; each user turn as the
  instruction part, each assistant turn as a response (trained, closed by EOS).
  No BOS: examples start like a document after EOS in the pretraining stream.
  Each segment is tokenised on its own, so the prompt/response boundary is exact;
  `prompt_ids(sp, prompt)` gives generation the same prompt tokens. An example
  longer than `finetune.seq_length` + 1 tokens loses prompt tokens first (from the
  end of the prompt), then is cut on the right; one left without response tokens is
  dropped. Shorter ones are padded (labels -100). The manifest counts each case.
- `format: text`: .txt files (one document each) or JSON Lines with `data.text_field`,
  tokenised, joined with EOS and cut into blocks of seq_length + 1 (every token trained):
  domain adaptation.

Training reuses `tasks.training.trainer.fit` (the one loop): only the LoRA matrices (or, with
`method: full`, every weight) are handed to it as `params`, so the base weights are
outside the optimizer and stay bit-identical. Checkpoints live in
`<root>/runs/finetune/<key>/`; a rerun of the same key resumes from the newest.

Artifact payload: adapter.safetensors (the LoRA matrices `<module>.lora_A` [r, in] and
`<module>.lora_B` [out, r]; with `method: full`, every weight), adapter.json (method,
rank, alpha, scaling, target modules, template, seq_length and the base artifact's
stage/key/digest/path), metrics.jsonl, loss_curve.png. No tokenizer and no base
weights: `merge()` takes both from the base artifact it names.
"""

from __future__ import annotations

import gzip
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from tasks.store.artifacts import ArtifactStore, atomic_write_json, raw_file_input
from tasks.stages import code_version
from tasks.config import ConfigError, PipelineConfig
from tasks.prompts import TEMPLATE, encode_segments, to_segments

STAGE = "finetune"
IGNORE = -100
_DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".txt")


# ----------------------------------------------------------------------------- reading examples


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.name.endswith(".gz") else open(path, encoding="utf-8")


def read_records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(where, record) for every JSON record of a .jsonl[.gz] or .json[.gz] file; `where` is `file:line`."""
    with _open_text(path) as f:
        if ".jsonl" in path.name:
            out = []
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        out.append((f"{path}:{i}", json.loads(line)))
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{path}:{i}: not valid JSON ({exc.msg})") from None
            return out
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    data = data if isinstance(data, list) else [data]
    return [(f"{path}[{i}]", r) for i, r in enumerate(data)]


def pack_example(tokens: list[int], trained: list[bool], seq_length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """(input_ids [T], labels [T], truncated): labels[t] = tokens[t+1] where that token is trained, else -100.

    Labels are aligned with the inputs (causal_lm_loss does not shift); padding and
    anything past seq_length + 1 tokens carry no loss.
    """
    t = np.asarray(tokens, np.int64)
    keep = np.asarray(trained, bool)
    ids = np.full(seq_length, pad_id, np.int32)
    labels = np.full(seq_length, IGNORE, np.int32)
    n = min(len(t) - 1, seq_length)
    if n > 0:
        ids[:n] = t[:n]
        labels[:n] = np.where(keep[1 : n + 1], t[1 : n + 1], IGNORE)
    return ids, labels, len(t) - 1 > seq_length


@dataclass
class Examples:
    """Packed examples of one split: input_ids and labels, both [n, seq_length] int32."""

    ids: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, idx: np.ndarray) -> "Examples":
        return Examples(self.ids[idx], self.labels[idx])


@dataclass
class FinetuneData:
    train: Examples
    valid: Examples | None
    stats: dict[str, Any] = field(default_factory=dict)


def instruction_examples(files: list[Path], sp, seq_length: int, eos_id: int, pad_id: int) -> tuple[Examples, dict[str, Any]]:
    from tasks.prompts import chat_example, record_messages

    ids, labels, shortened, truncated, dropped, lengths = [], [], 0, 0, 0, []
    for path in files:
        for where, rec in read_records(path):
            segments = to_segments(rec, where)  # validates the record either way
            if sp.chat_template is not None:  # the model's own template (a tokenizer.json model's)
                tokens, trained = chat_example(sp, record_messages(rec, where), where)
                short = False
                lengths.append(len(tokens))
            else:
                lengths.append(len(encode_segments(sp, segments, eos_id)[0]))
                tokens, trained, short = encode_segments(sp, segments, eos_id, max_tokens=seq_length + 1)
            x, y, cut = pack_example(tokens, trained, seq_length, pad_id)
            if not (y != IGNORE).any():
                dropped += 1  # no response token left inside seq_length
                continue
            shortened += short
            truncated += cut
            ids.append(x)
            labels.append(y)
    if not ids:
        raise ValueError(f"no usable instruction examples in {[str(f) for f in files]} (dropped {dropped} whose "
                         f"response did not fit finetune.seq_length={seq_length})")
    stats = {"examples": len(ids), "shortened_prompts": shortened, "truncated_responses": truncated,
             "dropped_examples": dropped, "mean_tokens": round(float(np.mean(lengths)), 1),
             "max_tokens": int(np.max(lengths))}
    return Examples(np.stack(ids), np.stack(labels)), stats


def read_documents(path: Path, text_field: str) -> list[str]:
    if path.suffix == ".txt":
        return [path.read_text(encoding="utf-8")]
    docs = []
    for where, rec in read_records(path):
        text = rec.get(text_field) if isinstance(rec, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"{where}: no string field {text_field!r} (set data.text_field)")
        docs.append(text)
    return docs


def text_examples(files: list[Path], sp, seq_length: int, eos_id: int, text_field: str) -> tuple[Examples, dict[str, Any]]:
    """Documents joined with EOS, cut into blocks of seq_length + 1 tokens (the tail is dropped); all trained."""
    docs = [d for f in files for d in read_documents(f, text_field)]
    stream = np.fromiter((t for ids in sp.encode_batch(docs) for t in (*ids, eos_id)), np.int64)
    n = len(stream) // (seq_length + 1)
    if n == 0:
        raise ValueError(f"finetune.sources hold {len(stream)} tokens, fewer than one block of {seq_length + 1}")
    blocks = stream[: n * (seq_length + 1)].reshape(n, seq_length + 1).astype(np.int32)
    return (Examples(np.ascontiguousarray(blocks[:, :-1]), np.ascontiguousarray(blocks[:, 1:])),
            {"documents": len(docs), "examples": n, "tokens": int(len(stream))})


def split(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, valid) indices: a seeded random `fraction` held out (at least one when fraction > 0 and n > 1)."""
    n_valid = 0 if fraction <= 0 or n < 2 else min(n - 1, max(1, round(n * fraction)))
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[n_valid:]), np.sort(perm[:n_valid])


def example_batches(ex: Examples, batch_size: int, seed: int, start_sample: int = 0, repeat: bool = True,
                    shuffle: bool = True, pad_id: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(input_ids [B, T], labels [B, T]) from global sample `start_sample` on.

    Sample k is example order_e[k mod n] of epoch e = k // n, where order_e is a
    permutation drawn from (seed, e), so any start position reproduces the stream a
    run from 0 would have seen (the `batches(start_sample)` contract of `fit`).
    Without repeat the last partial batch is filled with rows that carry no loss,
    keeping the batch shape (and the compiled graph) fixed.
    """
    n, t = ex.ids.shape
    orders: dict[int, np.ndarray] = {}

    def order(epoch: int) -> np.ndarray:
        if epoch not in orders:
            orders.clear()
            orders[epoch] = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
        return orders[epoch]

    s = start_sample
    while repeat or s < n:
        stop = s + batch_size if repeat else min(s + batch_size, n)
        idx = np.array([order(k // n)[k % n] for k in range(s, stop)])
        ids, labels = ex.ids[idx], ex.labels[idx]
        if len(idx) < batch_size:
            ids = np.concatenate([ids, np.full((batch_size - len(idx), t), pad_id, np.int32)])
            labels = np.concatenate([labels, np.full((batch_size - len(idx), t), IGNORE, np.int32)])
        yield ids, labels
        s = stop


def load_data(cfg: PipelineConfig, sp, seq_length: int) -> FinetuneData:
    ft = cfg.finetune
    files = source_files(cfg)
    eos = sp.eos_id()
    pad = sp.pad_id() if sp.pad_id() >= 0 else eos
    if ft.format == "instruction":
        allx, stats = instruction_examples(files, sp, seq_length, eos, pad)
    else:
        allx, stats = text_examples(files, sp, seq_length, eos, cfg.data.text_field)
    tr, va = split(len(allx), ft.validation_fraction, ft.seed)
    stats.update(train_examples=len(tr), valid_examples=len(va),
                 train_label_tokens=int((allx.labels[tr] != IGNORE).sum()))
    return FinetuneData(allx.take(tr), allx.take(va) if len(va) else None, stats)


# ----------------------------------------------------------------------------- keys, inputs, checks


def source_files(cfg: PipelineConfig) -> list[Path]:
    """finetune.sources expanded (files, directories, globs) to a sorted, de-duplicated file list."""
    from tasks.config import expand_source

    if not cfg.finetune.sources:
        raise ConfigError([f"pipelines.{cfg.name}.finetune.sources: empty; list the instruction (.jsonl) or text files"])
    files: list[Path] = []
    for i, src in enumerate(cfg.finetune.sources):
        found = []
        for p in expand_source(cfg, src):
            if p.is_dir():
                found += sorted(q for q in p.rglob("*") if q.is_file() and q.name.endswith(_DATA_SUFFIXES))
            elif p.is_file():
                found.append(p)
        if not found:
            raise ConfigError([f"pipelines.{cfg.name}.finetune.sources[{i}]: '{src}' matches no data file "
                               f"({', '.join(_DATA_SUFFIXES)}); fix the path"])
        for p in found:
            if not p.name.endswith(_DATA_SUFFIXES):
                raise ConfigError([f"pipelines.{cfg.name}.finetune.sources[{i}]: {p.name}: unsupported file type; "
                                   f"use one of {', '.join(_DATA_SUFFIXES)}"])
            if cfg.finetune.format == "instruction" and p.suffix == ".txt":
                raise ConfigError([f"pipelines.{cfg.name}.finetune.sources[{i}]: {p.name} is plain text but "
                                   "finetune.format is 'instruction'; set format: text or pass JSON Lines"])
        files += found
    return sorted({p.resolve() for p in files})


def seq_length_for(cfg: PipelineConfig, info: dict[str, Any]) -> int:
    max_len = info["model"]["max_seq_length"]
    return cfg.finetune.seq_length or min(info.get("seq_length") or max_len, max_len)


def check(cfg: PipelineConfig, info: dict[str, Any]) -> None:
    """Settings that depend on the base model or span keys; ConfigError naming the YAML path."""
    ft, p = cfg.finetune, f"pipelines.{cfg.name}.finetune"
    errs = []
    max_len = info["model"]["max_seq_length"]
    if ft.seq_length is not None and ft.seq_length > max_len:
        errs.append(f"{p}.seq_length: {ft.seq_length} exceeds the base model's max_seq_length={max_len}; lower it")
    if ft.warmup_steps > ft.max_steps:
        errs.append(f"{p}.warmup_steps: {ft.warmup_steps} > max_steps={ft.max_steps}; warmup must fit in the run")
    if ft.min_lr is not None and ft.min_lr > ft.lr:
        errs.append(f"{p}.min_lr: {ft.min_lr} > lr={ft.lr}; min_lr must be <= lr")
    if errs:
        raise ConfigError(errs)


def stage_key(cfg: PipelineConfig, store: ArtifactStore, base: Path) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """Content key over the finetune settings that shape the output, the base's digest and the data bytes."""
    inputs = [store.input_ref(base), *(raw_file_input(f) for f in source_files(cfg))]
    ft = cfg.section("finetune")
    ft.pop("sources")  # identified by their bytes among the inputs
    if ft["method"] == "full":
        ft.pop("lora")
    o = cfg.pretrain.optimizer
    section = {"finetune": ft, "optimizer": {"beta1": o.beta1, "beta2": o.beta2, "eps": o.eps,
                                             "grad_clip": cfg.pretrain.grad_clip,
                                             "max_nonfinite_steps": cfg.pretrain.max_nonfinite_steps}}
    if ft["format"] == "text":
        section["text_field"] = cfg.data.text_field
    if cfg.parallel.device_num > 1:  # data parallel multiplies the global batch
        section["parallel"] = cfg.layout_section()
    return store.key(STAGE, section, inputs, code_version(STAGE)), inputs, section


# ----------------------------------------------------------------------------- supervisor (parent)


def run(cfg: PipelineConfig, store: ArtifactStore, base_artifact: Path, *, progress: bool = True,
        isolate: bool = True, retries: int = 0, inject: dict | None = None) -> Path:
    """Return the finetune artifact for this base and data, training it in a child process if needed.

    `isolate=False` trains in this process (tests). `inject` (tests only) adds
    {"stop_after": k} / {"fault_steps": [...]} to the first attempt, as in pretrain.
    """
    from tasks.store.model_artifact import read_info
    from tasks.runtime.supervise import supervise

    base = store.inside(base_artifact)
    check(cfg, read_info(base))
    if cfg.parallel.tensor_parallel > 1:
        raise ValueError(
            f"parallel.tensor_parallel: {cfg.parallel.tensor_parallel} > 1 is for pretraining; fine-tuning runs data "
            "parallel only (LoRA adapters are not split across ranks); run this stage with "
            f"--set parallel.tensor_parallel=1 --set parallel.device_num={cfg.parallel.data_parallel}")
    key, _, _ = stage_key(cfg, store, base)
    hit = store.lookup(STAGE, key)
    if hit is not None:
        return hit
    spec = {"config": cfg.model_dump(mode="json"), "root": str(store.root), "base": str(base), "key": key,
            "progress": progress and sys.stderr.isatty()}  # a bar only where a terminal shows it
    return supervise(STAGE, store, key, spec, train, retries=retries, isolate=isolate, inject=inject,
                     parallel=cfg.parallel)


# ----------------------------------------------------------------------------- the child


def train(spec: dict[str, Any]) -> Path | None:
    """Train and publish the artifact (inside the child process, or in-process with isolate=False)."""
    from model.runtime import setup_mindspore

    from tasks.runtime.distributed import Mesh

    cfg = PipelineConfig.model_validate(spec["config"])
    setup_mindspore(cfg.parallel.device_target, seed=cfg.finetune.seed)
    mesh = (Mesh.init(cfg.parallel.data_parallel, 1, cfg.parallel.optimizer_shard) if cfg.parallel.device_num > 1
            else Mesh())
    return _train(cfg, ArtifactStore(spec["root"]), Path(spec["base"]), spec["key"], spec.get("progress", True),
                  stop_after=spec.get("stop_after"), fault_steps=spec.get("fault_steps", []), mesh=mesh)


def _loop_config(cfg: PipelineConfig, progress: bool):
    from tasks.training.trainer import LoopConfig

    ft, pt = cfg.finetune, cfg.pretrain
    return LoopConfig(
        max_steps=ft.max_steps, micro_batch_size=ft.micro_batch_size, lr=ft.lr,
        min_lr=ft.lr / 10 if ft.min_lr is None else ft.min_lr, warmup_steps=ft.warmup_steps, decay=ft.decay,
        beta1=pt.optimizer.beta1, beta2=pt.optimizer.beta2, eps=pt.optimizer.eps, weight_decay=ft.weight_decay,
        grad_clip=pt.grad_clip, log_steps=ft.log_steps, eval_steps=ft.eval_steps, eval_batches=ft.eval_batches,
        save_steps=ft.save_steps, keep_checkpoint_max=cfg.checkpoint.keep_checkpoint_max,
        resume=cfg.checkpoint.resume, max_nonfinite_steps=pt.max_nonfinite_steps, peak_flops=pt.peak_flops,
        progress=progress, fused_kernels=pt.fused_kernels,
    )


def _train(cfg: PipelineConfig, store: ArtifactStore, base: Path, key: str, progress: bool,
           stop_after: int | None = None, fault_steps: list[int] | None = None, mesh=None) -> Path | None:
    from model.config import ModelConfig
    from tasks.training.optim import causal_lm_loss_fn
    from model.lora import inject_lora, lora_state_dict, mark_only_lora_trainable, trainable_summary
    from tasks.store.tensors import save_tensors
    from tasks.store.model_artifact import load_model, load_tokenizer
    from tasks.runtime.distributed import Mesh
    from tasks.training.trainer import add_run_files, fit, native_kernels, run_outcome

    mesh = mesh or Mesh()
    # ---- setup: base model, data, what trains
    ft = cfg.finetune
    _, inputs, section = stage_key(cfg, store, base)
    base_ref = inputs[0]
    net, info = load_model(base, seed=ft.seed, fused_kernels=cfg.pretrain.fused_kernels)
    kernels = native_kernels(net, cfg.pretrain.fused_kernels)  # logged once; recorded in the manifest
    mc = ModelConfig.from_dict(info["model"])
    seq = seq_length_for(cfg, info)
    sp = load_tokenizer(base)
    data = load_data(cfg, sp, seq)
    pad = sp.pad_id() if sp.pad_id() >= 0 else sp.eos_id()
    print(f"[finetune] {ft.format} data: {data.stats}", file=sys.stderr)
    modules: list[str] = []
    if ft.method == "lora":
        lc = ft.lora
        modules = inject_lora(net, lc.target_modules, lc.rank, lc.alpha, lc.dropout, seed=ft.seed)
        params = mark_only_lora_trainable(net)
    else:
        params = net.trainable_params()
    summary = trainable_summary(net)
    print(f"[finetune] {ft.method}: {summary.line()}", file=sys.stderr)
    net.set_train(True)
    loop = _loop_config(cfg, progress)
    loop.stop_after, loop.fault_steps = stop_after, list(fault_steps or [])

    loss_fn = causal_lm_loss_fn(net)

    def batches(start: int) -> Iterator:
        # the global batch (micro × dp examples); data-parallel rank r trains on rows r, r + dp, ...
        for ids, labels in example_batches(data.train, ft.micro_batch_size * mesh.dp, ft.seed, start_sample=start,
                                           pad_id=pad):
            yield ids[mesh.dp_index::mesh.dp], labels[mesh.dp_index::mesh.dp]

    def valid() -> Iterator:  # rank 0 validates on global batches: the same examples whatever the layout
        return example_batches(data.valid, ft.micro_batch_size * mesh.dp, ft.seed, repeat=False, shuffle=False,
                               pad_id=pad)

    # ---- fit (the shared loop)
    run_dir = store.root / "runs" / STAGE / key
    meta = {"model": mc.to_dict(), "name": info.get("name", "llama"), "base_artifact": base_ref["key"],
            "method": ft.method, "seed": ft.seed}
    # Model FLOPs per token: forward + backward; with LoRA the frozen weights need no weight
    # gradients, so about 4N instead of 6N (the adapters' own matmuls are negligible).
    fpt = mc.flops_per_token(seq) * (4 / 6 if ft.method == "lora" else 1.0)
    result = fit(net, params, loss_fn, loop, batches=batches, valid=valid if data.valid is not None else None,
                 run_dir=run_dir, meta=meta, flops_per_token=fpt, tokens_per_sample=seq, mesh=mesh)
    if (outcome := run_outcome(result, mesh, run_dir)) is not True:
        return outcome  # stopped on request, or not rank 0: rank 0 publishes

    # ---- publish
    train_rows = [r for r in result.history if "grad_norm" in r]
    with store.build(STAGE, key, pipeline=cfg.name, config=section, inputs=inputs, code=code_version(STAGE)) as b:
        weights = lora_state_dict(net) if ft.method == "lora" else {p.name: p.asnumpy() for p in params}
        save_tensors(b.dir / "adapter.safetensors", weights)
        lc = ft.lora
        atomic_write_json(b.dir / "adapter.json", {
            "method": ft.method,
            **({"rank": lc.rank, "alpha": lc.alpha, "scaling": lc.alpha / lc.rank, "dropout": lc.dropout,
                "target_modules": lc.target_modules, "modules": modules} if ft.method == "lora" else {}),
            "format": ft.format, "template": (("chat_template of the tokenizer" if sp.chat_template else TEMPLATE)
                                              if ft.format == "instruction" else None), "seq_length": seq,
            "base": {k: base_ref[k] for k in ("stage", "key", "digest", "path")},
            "model": {"name": info.get("name", "llama"), "config": mc.to_dict()},
        })
        add_run_files(b.dir, run_dir, result, f"{cfg.name}: {ft.method} fine-tuning ({summary.trainable / 1e6:.3g}M "
                      f"trainable{', response tokens only' if ft.format == 'instruction' else ''})")
        b.metrics.update(
            method=ft.method, native_kernels=kernels, steps=result.steps, consumed_samples=result.consumed_samples,
            first_loss=train_rows[0]["loss"] if train_rows else None,
            first_loss_step=train_rows[0]["step"] if train_rows else None,
            final_loss=result.final_loss, val_loss_before=result.initial_val_loss, val_loss=result.val_loss,
            loss_on="response tokens" if ft.format == "instruction" else "all tokens",
            trainable_params=summary.trainable, total_params=summary.total, trainable_share=summary.share,
            adapter_bytes=(b.dir / "adapter.safetensors").stat().st_size, skipped_steps=result.skipped_steps,
            tokens_per_s=result.tokens_per_s, seq_length=seq, **data.stats,
        )
    print(f"[finetune] validation loss {result.initial_val_loss} -> {result.val_loss} "
          f"({b.metrics['loss_on']}); adapter {b.metrics['adapter_bytes'] / 1e6:.2f} MB", file=sys.stderr)
    return b.path
