"""Benchmark the data stage against plain HF `datasets.map`; print one JSON line.

    HF_DATASETS_OFFLINE=1 GLOG_v=3 .venv/bin/python scripts/bench/data.py [--workers 2] [--corpora shakespeare peps]

On the shipped corpora with the `demo` settings (vocab 4096, seq 128), one SentencePiece model
trained beforehand (not timed) and used by both sides:

  ours      tasks.stages.data.run(..., tokenizer_model=...) into a fresh store: read, clean, dedup, split,
            tokenize in `--workers` processes, pack, write MindRecord shards, hash every file.
  baseline  datasets.load_dataset (text by paragraph / json) into a fresh cache, .map(tokenize,
            batched, num_proc=--workers) with the same model, then numpy packing (EOS-joined,
            reshaped to blocks); nothing written beyond HF's own cache.
  reader    tasks.store.reader.open_blocks on the train split (shuffled, batch 8): blocks/s, and the
            ratio to what the trainer consumes (~2000 tokens/s on 2 cores → 2000/128 ≈ 15.6 blocks/s).

MindSpore and datasets are imported before any timing (steady state); each side runs `--repeat`
times, alternating, and the fastest run counts. Run it alone: two cores. `loadavg` in the output is
the 1-minute load average before the first run (other processes skew the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
os.environ.setdefault("GLOG_v", "3")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

CORPORA = {"shakespeare": REPO / "data/corpora/tinyshakespeare.txt", "peps": REPO / "data/corpora/python-peps.jsonl.gz"}
TRAINER_TOKENS_PER_S = 2000.0


def baseline(files: list[Path], model: Path, seq: int, workers: int, cache: Path) -> dict:
    import datasets
    import numpy as np
    import sentencepiece as spm

    t0 = time.perf_counter()
    parts = []
    for f in files:
        if f.name.endswith(".txt"):
            parts.append(
                datasets.load_dataset(
                    "text", data_files=[str(f)], sample_by="paragraph", split="train", cache_dir=str(cache)
                )
            )
        else:
            ds = datasets.load_dataset("json", data_files=[str(f)], split="train", cache_dir=str(cache))
            parts.append(ds.select_columns(["text"]))
    corpus = datasets.concatenate_datasets(parts)
    sp = spm.SentencePieceProcessor(model_file=str(model))
    eos = sp.eos_id()

    def tokenize(batch):
        return {"ids": [ids + [eos] for ids in sp.encode(batch["text"])]}

    tok = corpus.map(tokenize, batched=True, num_proc=workers if workers > 1 else None, remove_columns=["text"])
    lens = np.asarray([len(x) for x in tok["ids"]])
    flat = np.fromiter((t for ids in tok["ids"] for t in ids), dtype=np.int32, count=int(lens.sum()))
    n = len(flat) // (seq + 1)
    blocks = flat[: n * (seq + 1)].reshape(n, seq + 1)
    dt = time.perf_counter() - t0
    mb = sum(len(t.encode("utf-8")) for t in corpus["text"]) / 1e6
    return {
        "seconds": round(dt, 3),
        "mb": round(mb, 3),
        "tokens": int(len(flat)),
        "blocks": int(len(blocks)),
        "mb_per_s": round(mb / dt, 3),
        "tokens_per_s": round(len(flat) / dt),
    }


def reader(artifact: Path, batch: int, seq: int, n_blocks: int) -> dict:
    from tasks.store.reader import open_blocks

    it = open_blocks(artifact, "train", batch_size=batch, seed=0)
    next(it)  # pipeline start-up is paid once per run
    t0 = time.perf_counter()
    seen = 0
    while seen < n_blocks:
        seen += len(next(it)["input_ids"])
    bps = seen / (time.perf_counter() - t0)
    trainer = TRAINER_TOKENS_PER_S / seq
    return {
        "blocks_per_s": round(bps),
        "batch_size": batch,
        "trainer_blocks_per_s": round(trainer, 1),
        "ratio_to_trainer": round(bps / trainer),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--corpora", nargs="+", default=list(CORPORA), choices=list(CORPORA))
    ap.add_argument("--reader-blocks", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=2, help="runs of each side, alternating; the fastest counts")
    args = ap.parse_args()

    import datasets
    import mindspore.dataset  # noqa: F401  (steady state: imported before timing)

    from tasks.config.loader import resolve_pipeline
    from tasks.stages import data
    from tasks.stages.data.plan import plan_chunks
    from tasks.stages.data.tokenizer import train_tokenizer
    from tasks.store.artifacts import ArtifactStore

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    files = [CORPORA[c] for c in args.corpora]
    load = round(os.getloadavg()[0], 2)
    cfg = resolve_pipeline(
        REPO / "pipelines.yaml",
        "demo",
        [
            f"data.sources={json.dumps([str(f) for f in files])}",
            f"data.num_workers={args.workers}",
            "data.tokenizer.character_coverage=0.9995",
        ],
    )
    seq = cfg.data.seq_length
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        tmp = Path(tmp)
        # one tokenizer for both sides (not timed)
        plan = plan_chunks(cfg, tmp / "plan")
        model = train_tokenizer(cfg.data.tokenizer, plan.sample_path, tmp / "tokenizer.model")

        ours_s, base, art = float("inf"), None, None
        for r in range(args.repeat):  # alternate the sides so that load from elsewhere hits both alike
            t0 = time.perf_counter()
            a = data.run(cfg, ArtifactStore(tmp / f"art{r}"), tokenizer_model=model, progress=False)
            if time.perf_counter() - t0 < ours_s:
                ours_s, art = time.perf_counter() - t0, a
            b = baseline(files, model, seq, args.workers, tmp / f"hf-cache{r}")
            base = b if base is None or b["seconds"] < base["seconds"] else base
        met = ArtifactStore.read_manifest(art)["metrics"]
        tokens = met["tokens"]["train"] + met["tokens"]["valid"]
        ours = {
            "seconds": round(ours_s, 3),
            "mb": met["raw_text_mb"],
            "tokens": tokens,
            "blocks": met["blocks"]["train"] + met["blocks"]["valid"],
            "mb_per_s": round(met["raw_text_mb"] / ours_s, 3),
            "tokens_per_s": round(tokens / ours_s),
            "phases_s": met["seconds"],
        }

        read = reader(art, cfg.pretrain.train.loop.micro_batch_size, seq, args.reader_blocks)
    print(
        json.dumps(
            {
                "bench": "data",
                "loadavg": load,
                "corpora": args.corpora,
                "workers": args.workers,
                "vocab_size": cfg.data.tokenizer.vocab_size,
                "seq_length": seq,
                "ours": ours,
                "baseline_hf_map": base,
                "throughput_vs_baseline": round(ours["mb_per_s"] / base["mb_per_s"], 2),
                "reader": read,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
