"""The data stage: corpora → cleaned documents → tokenizer (trained or reused) → packed MindRecord shards.

    path = run(cfg, ArtifactStore("artifacts"))                 # plain function, no Prefect inside
    path = run(cfg, store, tokenizer_model=base)                # continued pretraining: the base's tokenizer
    msllm data --pipeline tiny                                  # the CLI prints `path` last

A rerun with the same inputs and config is a cache hit (same key, nothing recomputed). The same
inputs and config give byte-identical payload files for any `num_workers` and chunk size.

Steps (each a public function of this package's modules: plan, tokenizer, shards; so an orchestrator can map
the middle one over a Dask cluster):

    plan = plan_chunks(cfg, work_dir)          # read, clean, dedup, split, write chunk files + tokenizer sample
    train_tokenizer(cfg.data.tokenizer, plan.sample_path, out)   # or reuse a given tokenizer.model
    results = map(tokenize_chunk, chunk_specs(plan, tokenizer))  # pure, path in → path out, any order of execution
    written = finalize(results, out_dir, ...)  # cut blocks, write MindRecord shards (results in plan order)

`run()` drives the map with a spawn-context process pool (`data.num_workers`; MindSpore is never
imported in the workers, and is imported in the parent only by `finalize`), or with `map_fn`
when the caller supplies one: `data.dask_address` is for the flow, which passes a Dask map here.
The work directory (chunk text + int32 token streams, about 1.3x the corpus) lives inside the
build directory and is removed before the artifact is published.

Inputs (`data.sources`: files, directories, globs, in order; directories and globs expand sorted):
`.txt` (one document per blank-line separated paragraph, or per file: `data.txt_split`), `.jsonl`,
`.json` (an array of records, or JSON Lines) — each optionally `.gz` — with the text in
`data.text_field`; `.parquet` and `hf:NAME` (a dataset in the local Hugging Face cache, split
`train`) go through HF `datasets`. The text formats use our own streaming readers rather than HF's
builders: measured with datasets 5.2, the json builder accepts a truncated gzip silently, stops at
invalid UTF-8 without naming the file, and cannot replace or skip one bad document.

Cleaning, in order (each dropped document counted by reason in the manifest, nothing silently):
`binary` (a NUL character; a file whose first 8 KiB hold a NUL byte counts once and is listed in
`skipped_files`), `invalid_utf8` (with `clean.invalid_utf8: skip`; with `replace` the bad bytes
become U+FFFD and the document counts under `documents_repaired`), `mostly_invalid` (more than
half of the document's characters are U+FFFD after that repair: binary data without NUL bytes,
e.g. an image or an archive renamed `.txt`; random bytes come out ~80% U+FFFD, real text with a
few bad bytes far below 50%; such a document is not also counted as repaired), Unicode normalization
(`clean.normalize`), `empty`, `whitespace`, `too_short` (< `min_chars`), `too_long`
(> `max_chars`), `duplicate` (sha256 of the normalized text). Validation documents are then drawn
at random (seed `data.seed`), so no document — and no block — is in both splits.

Tokenizer (`tokenizer.model`, SentencePiece): trained on a deterministic sample of training
documents (`tokenizer.sample_documents` / `sample_chars`; one sentence per line, lines cut at
`max_sentence_length` bytes) with byte fallback, identity normalization (we normalize ourselves),
no dummy prefix and no whitespace folding, so `decode(encode(text)) == text` for any text
(newlines and tabs become byte pieces). Ids: unk 0, bos 1, eos 2, pad 3. `num_threads=1` keeps
training deterministic. A reused tokenizer (`data.tokenizer.path` or the base model's on continued
pretraining: a tokenizer.model, or a Hugging Face tokenizer.json with its tokenizer_config.json and chat
template) is copied byte for byte, nothing is retrained; its size must equal the model's vocab_size.

Stored schema (`DATA_SCHEMA_VERSION` 1) of the artifact directory:

    train/train-00000-of-0000N.mindrecord (+ .db)   data.num_shards shards, blocks dealt round robin
    valid/valid-00000-of-00001.mindrecord (+ .db)   one shard
    tokenizer.model                                 SentencePiece model (or tokenizer.json + its companions)
    tokenizer_info.json                             {type, files, sha256, vocab_size, unk_id, bos_id, eos_id,
                                                     pad_id, pad_fill_id, model_type, byte_fallback, ...}
    manifest.json                                   written by the store: metrics (documents seen /
        kept / skipped by reason, tokens, blocks and tail tokens per split, MB, seconds), inputs with
        sha256, resolved config, every file's sha256, and `data` (schema version, seq_length, files
        and block counts per split, tokenizer info)

    MindRecord columns, one row per block:
      input_ids  int32 [seq_length + 1]   inputs = input_ids[:-1], targets = input_ids[1:]
      loss_mask  int32 [seq_length]       1 where target input_ids[i + 1] counts, 0 at padding

Each split is one stream `tokens(doc_1) + [eos] + tokens(doc_2) + [eos] + ...` cut into
blocks of seq_length + 1 tokens; consecutive blocks do not overlap. The last partial block is
dropped or padded with `pad_fill_id` (`data.tail`); both are counted. `tokens(doc)` is the
SentencePiece ids (no BOS), or a tokenizer.json's own encoding (a BOS where its post-processor adds one). Read blocks
with
`tasks.store.reader.open_blocks`.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import shutil
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.stages import code_version
from tasks.stages.data.plan import _postfix, _progress_bar, plan_chunks
from tasks.stages.data.shards import finalize
from tasks.stages.data.sources import resolve_sources, source_inputs
from tasks.stages.data.tokenizer import (
    check_vocab,
    chunk_specs,
    load_tokenizer,
    tokenize_chunk,
    tokenizer_info,
    train_tokenizer,
)
from tasks.store.artifacts import ArtifactStore, raw_file_input
from tasks.store.data_schema import COLUMNS, DATA_SCHEMA_VERSION, SPLITS, DataError
from tasks.store.disk import atomic_write_json

if TYPE_CHECKING:
    from tasks.config.schema import PipelineConfig


# ----------------------------------------------------------------------------- run


def _key_config(cfg: PipelineConfig, reused_tokenizer: bool) -> dict[str, Any]:
    """The data section minus settings that do not change the output bytes (workers, chunking)."""
    section = cfg.section("data")
    for k in ("num_workers", "chunk_documents", "chunk_bytes", "executor", "dask_address"):
        section.pop(k, None)
    if reused_tokenizer:  # identified by its sha256 among the inputs, not by where it lies
        section["tokenizer"] = {"reused": True}
    return section


@contextlib.contextmanager
def _pool_map(num_workers: int, n_tasks: int):
    """`map` in this process, or an ordered map over spawned worker processes (a dead worker raises
    BrokenProcessPool instead of hanging; spawn, not fork: never fork a process holding MindSpore threads)."""
    if num_workers <= 1 or n_tasks <= 1:
        yield map
        return
    with ProcessPoolExecutor(min(num_workers, n_tasks), mp_context=mp.get_context("spawn")) as pool:
        try:
            yield pool.map
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise


def stage_key(cfg: PipelineConfig, store: ArtifactStore, tokenizer_model: Path | None = None):
    """(key, inputs, (sources, ignored files, tokenizer files)): the content key, before any heavy work.

    Also checks the model's vocab size against the tokenizer (the reused one, or the one to train).
    """
    d = cfg.data
    sources, ignored = resolve_sources(cfg)
    tok_path = (
        Path(tokenizer_model) if tokenizer_model else (cfg.resolve_path(d.tokenizer.path) if d.tokenizer.path else None)
    )
    tok_files = None
    if tok_path is not None:
        base = load_tokenizer(tok_path)
        tok_files = base.files  # a tokenizer.model, or a tokenizer.json with its companions
        check_vocab(cfg, base.get_piece_size(), str(tok_path))
        if base.eos_id() < 0:
            raise DataError(f"{tok_path}: tokenizer has no EOS token to join documents with; use another tokenizer")
    else:
        check_vocab(cfg, d.tokenizer.vocab_size, None)
    inputs = source_inputs(sources) + [raw_file_input(f) for f in tok_files or []]
    key = store.key("data", _key_config(cfg, tok_path is not None), inputs, code_version("data"))
    return key, inputs, (sources, ignored, tok_files)


def run(
    cfg: PipelineConfig,
    store: ArtifactStore,
    tokenizer_model: Path | None = None,
    progress: bool = True,
    map_fn: Callable[[Callable, list], Iterable] | None = None,
    *,
    keyed: tuple,
) -> Path:
    """Build (or find cached) the data artifact of `cfg`; returns its directory.

    `tokenizer_model` overrides `data.tokenizer.path` (continued pretraining passes the base model's).
    `map_fn(tokenize_chunk, specs)` replaces the local process pool (e.g. a Dask client's map); it
    must yield the results in the order of `specs`. `keyed`: what `stage_key` returned for these arguments,
    from the stage runner (tasks/stages/runner.py), which resolved the inputs, checked the machine and computed it once.
    """
    t0 = time.perf_counter()
    log = (lambda msg: print(f"data: {msg}", file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    key, inputs, (sources, ignored, tok_files) = keyed
    hit = store.lookup("data", key)
    if hit is not None:
        log(f"cache hit {hit}")
        return hit
    with store.claim("data", key) as hit:  # one build per key: an identical run waits, then uses what it published
        if hit is not None:
            return hit
        return _build(cfg, store, key, inputs, sources, ignored, tok_files, progress, map_fn, log, t0)


def _build(
    cfg: PipelineConfig,
    store: ArtifactStore,
    key: str,
    inputs: list,
    sources,
    ignored,
    tok_files,
    progress: bool,
    map_fn,
    log: Callable[[str], None],
    t0: float,
) -> Path:
    """Compute and publish the data artifact `key` (under its build lock: `run`)."""
    d = cfg.data
    tok_path = tok_files[0] if tok_files else None
    code = code_version("data")
    config = cfg.section("data")
    if tok_path is not None:
        config["tokenizer"]["path"] = str(tok_path)
    with store.build("data", key, pipeline=cfg.name, config=config, inputs=inputs, code=code) as b:
        work = b.dir / "_work"
        plan = plan_chunks(cfg, work, sources=sources, progress=progress, tokenizer_sample=tok_path is None)
        st = plan.stats
        log(
            f"{st.seen} documents ({st.bytes_seen / 1e6:.1f} MB) from {st.files} file(s): kept {st.kept}, "
            f"skipped {sum(st.skipped.values())} { ({k: v for k, v in st.skipped.items() if v}) }"
        )
        t_tok = time.perf_counter()
        info = _place_tokenizer(cfg, b.dir, tok_files, plan, log)
        # The MindRecord writer imports MindSpore (seconds of C++ initialisation). Done here, before the worker pool
        # starts, not as the first shard opens: a SIGTERM that stops a busy run (scripts/serve.py, a cancelled flow
        # run) then lands in Python code and ends it cleanly; inside that import it surfaces as "ImportError:
        # initialization failed" with a traceback.
        import mindspore.mindrecord  # noqa: F401

        t_tokenize = time.perf_counter()
        written = _tokenize_and_write(cfg, plan, b.dir, info["pad_fill_id"], progress, map_fn)
        shutil.rmtree(work)
        t_end = time.perf_counter()
        seconds = {
            "read_clean": round(plan.seconds, 3),
            "tokenizer": round(t_tokenize - t_tok, 3),
            "tokenize_write": round(t_end - t_tokenize, 3),
            "total": round(t_end - t0, 3),
        }
        per = _record(b, cfg, plan, written, info, seconds, t_end - t0, tok_path, ignored)
    log(
        f"train {per['blocks']['train']} blocks / valid {per['blocks']['valid']} blocks of {d.seq_length + 1} tokens "
        f"in {time.perf_counter() - t0:.1f}s"
    )
    return b.path


def _place_tokenizer(cfg: PipelineConfig, out: Path, tok_files, plan, log: Callable[[str], None]) -> dict[str, Any]:
    """The artifact's tokenizer: the given one copied byte for byte, or one trained on the plan's sample; checked
    against the model's vocab size, described in tokenizer_info.json (returned)."""
    d = cfg.data
    tok_path = tok_files[0] if tok_files else None
    tok_file = out / "tokenizer.model"
    if tok_files:
        sp_file = tok_files[0].suffix != ".json"  # a SentencePiece model, under whatever name it had
        for f in tok_files:
            shutil.copyfile(f, out / ("tokenizer.model" if sp_file else f.name))
        tok_file = out / ("tokenizer.model" if sp_file else tok_files[0].name)
        source = "reused"
    else:
        log(
            f"training a {d.tokenizer.model_type} tokenizer, vocab {d.tokenizer.vocab_size}, "
            f"on {plan.sample_documents} documents"
        )
        train_tokenizer(d.tokenizer, plan.sample_path, tok_file)
        source = "trained"
    tok = load_tokenizer(out)
    check_vocab(cfg, tok.get_piece_size(), str(tok_file) if tok_path else None)
    info = tokenizer_info(tok, source)
    atomic_write_json(out / "tokenizer_info.json", info)
    return info


def _tokenize_and_write(cfg: PipelineConfig, plan, out: Path, pad_id: int, progress: bool, map_fn) -> dict:
    """Tokenize the plan's chunks (the process pool, or `map_fn`) and write the MindRecord shards; what
    `finalize` wrote per split."""
    d = cfg.data
    specs = chunk_specs(plan, out)
    kept = sum(plan.documents.values())
    with _progress_bar(progress, "tokenize+write", total=kept) as bar:
        counts = {"bytes": 0, "tokens": 0}

        def on_chunk(s: dict) -> None:
            counts["bytes"] += s["bytes"]
            counts["tokens"] += s["tokens"]
            bar.update(s["documents"])
            _postfix(bar, counts["bytes"], counts["tokens"])

        with contextlib.ExitStack() as stack:
            mapper = map_fn or stack.enter_context(_pool_map(d.num_workers, len(specs)))
            return finalize(
                mapper(tokenize_chunk, specs),
                out,
                seq_length=d.seq_length,
                num_shards=d.num_shards,
                tail=d.tail,
                pad_id=pad_id,
                on_chunk=on_chunk,
            )


def _record(
    b,
    cfg: PipelineConfig,
    plan,
    written: dict,
    info: dict[str, Any],
    seconds: dict[str, float],
    elapsed: float,
    tok_path: Path | None,
    ignored,
) -> dict[str, dict[str, int]]:
    """The manifest's metrics (documents, files, text, per-split counts, seconds) and its `data` section; returns
    the per-split counts."""
    d, st = cfg.data, plan.stats
    per = {
        k: {s: written[s][k] for s in SPLITS}
        for k in ("documents", "tokens", "blocks", "tail_tokens_dropped", "tail_tokens_padded")
    }
    b.metrics.update(
        {
            "documents_seen": st.seen,
            "documents_kept": st.kept,
            "documents_skipped": dict(st.skipped),
            "documents_skipped_total": sum(st.skipped.values()),
            "documents_repaired": dict(st.repaired),
            "files": st.files,
            "files_skipped": len(st.skipped_files),
            "raw_text_mb": round(st.bytes_seen / 1e6, 3),
            "kept_text_mb": round(st.bytes_kept / 1e6, 3),
            **per,
            "tokenizer_sample_documents": plan.sample_documents,
            "seconds": seconds,
            "mb_per_s": round(st.bytes_seen / 1e6 / max(elapsed, 1e-9), 3),
        }
    )
    b.extra["data"] = {
        "schema_version": DATA_SCHEMA_VERSION,
        "seq_length": d.seq_length,
        "block_length": d.seq_length + 1,
        "columns": COLUMNS,
        "tail": d.tail,
        "splits": {
            s: {k: written[s][k] for k in ("files", "blocks", "shard_blocks", "tokens", "documents")} for s in SPLITS
        },
        "tokenizer": info,
        "tokenizer_source_path": str(tok_path) if tok_path else None,
        "skipped_files": st.skipped_files,
        "ignored_files": ignored,
    }
    return per
