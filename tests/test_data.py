"""The data stage (tasks/stages/data/) and the block reader (tasks/store/reader.py).

One end-to-end run of the `tiny` pipeline on the shipped Shakespeare (through the CLI), small
corpora written into tmp_path for everything else, a reused tokenizer where training one is beside
the point. Whole file: well under a minute and a half on 2 cores.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tasks.config.loader import resolve_pipeline
from tasks.stages import data
from tasks.stages.data.cleaning import Cleaner
from tasks.stages.data.plan import plan_chunks
from tasks.stages.data.schema import SKIP_REASONS
from tasks.stages.data.sources import read_documents, resolve_sources
from tasks.stages.data.tokenizer import tokenize_chunk, train_tokenizer
from tasks.store.artifacts import ArtifactStore
from tasks.store.data_schema import DataError
from tasks.store.reader import data_info, num_blocks, open_blocks, rank_order
from tests.helpers import run_stage

REPO = Path(__file__).resolve().parent.parent
PIPELINES = REPO / "pipelines.yaml"
SHAKESPEARE = REPO / "data/corpora/tinyshakespeare.txt"


def make_cfg(sources, *overrides: str, check_files: bool = False):
    srcs = [str(s) for s in sources]
    return resolve_pipeline(
        PIPELINES, "tiny", [f"data.sources={json.dumps(srcs)}", *overrides], check_files=check_files
    )


def paragraphs(n: int, start: int = 0) -> list[str]:
    """n distinct Shakespeare paragraphs (speeches) of at least 200 characters (~60 tokens)."""
    paras = [p for p in SHAKESPEARE.read_text(encoding="utf-8").split("\n\n") if len(p) >= 200]
    return list(dict.fromkeys(paras[start:]))[:n]


def write_txt(path: Path, docs: list[str]) -> Path:
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


def payload_digests(artifact: Path) -> dict[str, str]:
    return {f["path"]: f["sha256"] for f in ArtifactStore.read_manifest(artifact)["files"]}


def all_rows(artifact: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Every block of a split in global order (through the reader, unshuffled)."""
    ids, mask = [], []
    for b in open_blocks(artifact, split, batch_size=64, repeat=False, shuffle=False):
        ids.append(b["input_ids"])
        mask.append(b["loss_mask"])
    return np.concatenate(ids), np.concatenate(mask)


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory) -> Path:
    """`msllm data --pipeline tiny` on the shipped Shakespeare (2 workers); the path it printed last."""
    from tasks.cli import main

    root = tmp_path_factory.mktemp("art")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["data", "--config", str(PIPELINES), "--pipeline", "tiny", "--artifacts", str(root)])
    assert rc == 0
    return Path(out.getvalue().strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tok512(shakespeare) -> Path:
    return shakespeare / "tokenizer.model"


def run_small(cfg, tmp_path: Path, tok: Path | None, **kw) -> Path:
    return run_stage("data", cfg, ArtifactStore(tmp_path / "art"), tokenizer_model=tok, progress=False, **kw)


# ----------------------------------------------------------------------------- end to end


def test_end_to_end_tiny_shakespeare(shakespeare):
    import sentencepiece as spm

    m = ArtifactStore(shakespeare.parent.parent).verify(shakespeare)
    met = m["metrics"]
    assert met["documents_seen"] == met["documents_kept"] + met["documents_skipped_total"] > 7000
    assert met["documents_skipped"]["duplicate"] > 0 and set(met["documents_skipped"]) >= set(SKIP_REASONS)
    assert met["documents"]["train"] + met["documents"]["valid"] == met["documents_kept"]
    for split in ("train", "valid"):  # every token of a split lands in a block or in the counted tail
        assert met["tokens"][split] == met["blocks"][split] * 65 + met["tail_tokens_dropped"][split]
    assert {f["path"] for f in m["files"]} >= {
        "tokenizer.model",
        "tokenizer_info.json",
        "train/train-00000-of-00002.mindrecord",
        "train/train-00001-of-00002.mindrecord.db",
        "valid/valid-00000-of-00001.mindrecord",
    }
    assert m["inputs"][0]["sha256"] == hashlib.sha256(SHAKESPEARE.read_bytes()).hexdigest()
    info = data_info(shakespeare)
    tok = json.loads((shakespeare / "tokenizer_info.json").read_text())
    assert tok["vocab_size"] == 512 and (tok["bos_id"], tok["eos_id"], tok["pad_id"]) == (1, 2, 3)
    assert info["tokenizer"] == tok and info["seq_length"] == 64
    assert num_blocks(shakespeare, "train") == met["blocks"]["train"] == sum(info["splits"]["train"]["shard_blocks"])

    ids, mask = all_rows(shakespeare, "valid")
    assert ids.shape == (met["blocks"]["valid"], 65) and ids.dtype == np.int32 and mask.shape == (len(ids), 64)
    assert mask.all() and ids.max() < 512 and ids.min() >= 0
    sp = spm.SentencePieceProcessor(model_file=str(shakespeare / "tokenizer.model"))
    stream = ids.reshape(-1).tolist()  # valid blocks are consecutive pieces of one stream
    docs = [sp.decode(d) for d in _split_on(stream, sp.eos_id())]
    text = SHAKESPEARE.read_text(encoding="utf-8")
    assert all(d in text for d in docs if d)  # decode(encode(doc)) == doc: newlines and spacing survive


def _split_on(seq: list[int], sep: int) -> list[list[int]]:
    out, cur = [], []
    for t in seq:
        if t == sep:
            out.append(cur)
            cur = []
        else:
            cur.append(t)
    return out[1:]  # the first piece may start mid-document


def test_cache_hit_returns_existing_artifact(shakespeare, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("recomputed on a cache hit")

    monkeypatch.setattr(data, "plan_chunks", boom)
    cfg = resolve_pipeline(PIPELINES, "tiny", ["data.num_workers=1", "data.chunk_documents=50"])  # output-neutral keys
    assert run_stage("data", cfg, ArtifactStore(shakespeare.parent.parent), progress=False) == shakespeare


def test_byte_identical_for_any_workers_and_chunking(tmp_path):
    src = write_txt(tmp_path / "corpus.txt", paragraphs(1500))
    a = run_small(make_cfg([src], "data.num_workers=1"), tmp_path / "a", None)
    b = run_small(make_cfg([src], "data.num_workers=2", "data.chunk_documents=300"), tmp_path / "b", None)
    assert a != b and a.name == b.name  # same key, different stores
    da, db = payload_digests(a), payload_digests(b)
    assert da == db and any(p.endswith(".mindrecord.db") for p in da)


# ----------------------------------------------------------------------------- reader


def test_two_ranks_read_every_block_once_per_epoch(shakespeare):
    n = num_blocks(shakespeare, "train")
    ids_all, _ = all_rows(shakespeare, "train")
    seen = []
    for rank in (0, 1):
        got = list(open_blocks(shakespeare, "train", batch_size=32, num_shards=2, shard_id=rank, seed=7, repeat=False))
        idx = np.concatenate([b["index"] for b in got])
        rows = np.concatenate([b["input_ids"] for b in got])
        assert len(idx) == n // 2 and np.array_equal(rows, ids_all[idx])  # rows match their global ids
        seen.append(idx)
    both = np.concatenate(seen)
    assert len(np.unique(both)) == len(both) == 2 * (n // 2)  # every block at most once, all but n % 2
    assert not np.array_equal(rank_order(n, 0, seed=7, num_shards=2), rank_order(n, 1, seed=7, num_shards=2))
    S = next(s for s in range(2, n + 1) if n % s == 0)  # when num_shards divides n: every block exactly once
    assert np.array_equal(
        np.sort(np.concatenate([rank_order(n, 5, seed=7, num_shards=S, shard_id=r) for r in range(S)])), np.arange(n)
    )


def test_resume_at_offset_reproduces_the_stream(shakespeare):
    n = num_blocks(shakespeare, "valid")  # small split: 40 batches cross several epoch boundaries
    B, S = 24, 2
    full = open_blocks(shakespeare, "valid", batch_size=B, num_shards=S, shard_id=1, seed=3, shuffle=True)
    ref = [next(full) for _ in range(40)]
    assert 40 * B > 2 * (n // S)
    k = 13
    resumed = open_blocks(
        shakespeare, "valid", batch_size=B, num_shards=S, shard_id=1, seed=3, shuffle=True, start_sample=k * B * S
    )
    for want in ref[k:]:
        got = next(resumed)
        for key in ("input_ids", "loss_mask", "index"):
            assert np.array_equal(got[key], want[key])


def test_reader_batch_larger_than_split(shakespeare, tmp_path):
    n = num_blocks(shakespeare, "valid")
    it = open_blocks(shakespeare, "valid", batch_size=n + 5)
    b1, b2 = next(it), next(it)
    assert b1["input_ids"].shape == (n + 5, 65)
    assert np.array_equal(b1["index"], np.arange(n + 5) % n) and np.array_equal(
        b2["index"], np.arange(n + 5, 2 * n + 10) % n
    )


def test_corrupt_or_truncated_shard_is_named(shakespeare, tmp_path):
    art = tmp_path / "copy"
    shutil.copytree(shakespeare, art)
    shard = art / "train/train-00001-of-00002.mindrecord"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="train-00001-of-00002.mindrecord: sha256 differs"):
        open_blocks(art, "train", batch_size=8)
    shard.write_bytes(bytes(raw[: len(raw) // 3]))  # truncated: named even without the checksum pass
    with pytest.raises(DataError, match="train-00001-of-00002.mindrecord"):
        open_blocks(art, "train", batch_size=8)
    with pytest.raises(DataError, match="train-00001-of-00002.mindrecord: .* bytes, the manifest records"):
        open_blocks(art, "train", batch_size=8, verify=False, repeat=False)  # a stat, before MindSpore reads it


def test_schema_version_mismatch_says_what_to_run(shakespeare, tmp_path):
    art = tmp_path / "old"
    shutil.copytree(shakespeare, art)
    m = json.loads((art / "manifest.json").read_text())
    m["data"]["schema_version"] = 0
    (art / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match="rerun `msllm data"):
        open_blocks(art, "train", batch_size=8)


# ----------------------------------------------------------------------------- formats, cleaning, splits


def test_formats_directories_and_globs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = paragraphs(12)
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    write_txt(d / "a.txt", docs[0:3])  # 3 paragraphs
    with gzip.open(d / "sub" / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(json.dumps({"id": i, "body": t}) for i, t in enumerate(docs[3:6])) + "\n\n")
    (d / "c.json").write_text(json.dumps([{"body": t} for t in docs[6:8]]), encoding="utf-8")
    pq.write_table(pa.table({"body": docs[8:10]}), d / "d.parquet")
    (d / "README.md").write_text("not a corpus")
    (tmp_path / "e.txt").write_text(docs[10] + "\n\n" + docs[11], encoding="utf-8")
    cfg = make_cfg([d, tmp_path / "*.txt"], "data.text_field=body", "data.validation_documents=2")
    sources, ignored = resolve_sources(cfg)
    assert [s.kind for s in sources] == ["text", "json", "parquet", "jsonl", "text"]
    assert ignored == [str(d / "README.md")]
    plan = plan_chunks(cfg, tmp_path / "work", sources=sources)
    assert plan.stats.seen == plan.stats.kept == 12 and plan.documents == {"train": 10, "valid": 2}
    file_mode = make_cfg([tmp_path / "e.txt"], "data.txt_split=file")
    assert list(read_documents(resolve_sources(file_mode)[0][0], file_mode.data)) == [docs[10] + "\n\n" + docs[11]]


def test_cleaning_counts_every_drop():
    from tasks.config.schema import CleanSection

    c = Cleaner(CleanSection(normalize="NFKC", min_chars=3, max_chars=40, invalid_utf8="skip"))
    bad = b"caf\xe9 au lait".decode("utf-8", "surrogateescape")
    for t in ["hello world", "", "  \n\t ", "hello world", "hi", "x" * 41, "bin\x00ary", bad, "\ufb01ne print"]:
        c.add(t)
    s = c.stats
    assert c.kept == ["hello world", "fine print"]  # NFKC folds the ligature
    assert s.skipped == {
        "binary": 1,
        "invalid_utf8": 1,
        "mostly_invalid": 0,
        "empty": 1,
        "whitespace": 1,
        "too_short": 1,
        "too_long": 1,
        "duplicate": 1,
    }
    assert s.seen == s.kept + sum(s.skipped.values()) == 9
    r = Cleaner(CleanSection(invalid_utf8="replace"))
    r.add(bad)
    r.add(json.loads('"lone \\ud800 surrogate"'))
    assert (
        r.kept == ["caf\ufffd au lait", "lone \ufffd\ufffd\ufffd surrogate"] and r.stats.repaired["invalid_utf8"] == 2
    )


def test_validation_split_is_by_document(tmp_path):
    src = write_txt(tmp_path / "c.txt", paragraphs(200))
    plan = plan_chunks(make_cfg([src], "data.validation_documents=17", "data.chunk_documents=50"), tmp_path / "w")
    texts = {
        s: [json.loads(ln) for c in plan.chunks if c["split"] == s for ln in open(c["text_path"], encoding="utf-8")]
        for s in ("train", "valid")
    }
    assert len(texts["valid"]) == 17 and len(texts["train"]) == 183
    assert not set(texts["valid"]) & set(texts["train"])
    assert [c["documents"] for c in plan.chunks] == [50, 50, 50, 33, 17]


def test_tail_pad_is_masked(tmp_path, tok512):
    import sentencepiece as spm

    src = write_txt(tmp_path / "c.txt", paragraphs(60))
    art = run_small(
        make_cfg([src], "data.tail=pad", "data.num_shards=1", "data.validation_documents=3"), tmp_path, tok512
    )
    met = ArtifactStore.read_manifest(art)["metrics"]
    pad = spm.SentencePieceProcessor(model_file=str(tok512)).pad_id()
    for split in ("train", "valid"):
        ids, mask = all_rows(art, split)
        short = np.flatnonzero(mask.sum(1) < 64)
        assert len(short) == (met["tail_tokens_padded"][split] > 0) and met["tail_tokens_dropped"][split] == 0
        if len(short):
            r = int(mask[short[0]].sum()) + 1  # real tokens in the padded block
            assert (ids[short[0], r:] == pad).all() and r + met["tail_tokens_padded"][split] == 65
        assert met["tokens"][split] == len(ids) * 65 - met["tail_tokens_padded"][split]


def test_reused_tokenizer_is_copied_and_checked(tmp_path, tok512):
    src = write_txt(tmp_path / "c.txt", paragraphs(60))
    art = run_small(make_cfg([src]), tmp_path, tok512)
    assert (art / "tokenizer.model").read_bytes() == tok512.read_bytes()
    assert json.loads((art / "tokenizer_info.json").read_text())["source"] == "reused"
    cfg = make_cfg([src], "model.vocab_size=1024", "data.tokenizer.vocab_size=1024")
    with pytest.raises(DataError, match=r"tokenizer has 512 pieces but model.vocab_size is 1024") as e:
        run_small(cfg, tmp_path / "x", tok512)
    assert str(tok512) in str(e.value)


def test_cjk_tokenizer_round_trips(tmp_path):
    import sentencepiece as spm

    from tasks.config.schema import TokenizerSection

    rng = np.random.default_rng(0)
    chars = [chr(c) for c in range(0x4E00, 0x4E00 + 1500)] + [chr(c) for c in range(0x3041, 0x3097)]
    weights = 1.0 / np.arange(1, len(chars) + 1)
    lines = ["".join(rng.choice(chars, size=40, p=weights / weights.sum())) + "。" for _ in range(3000)]
    (tmp_path / "s.txt").write_text("\n".join(lines), encoding="utf-8")
    with pytest.raises(DataError, match="character_coverage"):  # 512 pieces cannot hold ~1600 characters
        train_tokenizer(TokenizerSection(vocab_size=512), tmp_path / "s.txt", tmp_path / "full.model")
    tok = TokenizerSection(vocab_size=2048, character_coverage=0.9995, model_type="unigram")
    sp = spm.SentencePieceProcessor(model_file=str(train_tokenizer(tok, tmp_path / "s.txt", tmp_path / "t.model")))
    text = "".join(chars[-60:]) + " 日本語のテキスト\n\tです"  # unseen characters go through byte fallback
    assert sp.get_piece_size() == 2048 and sp.decode(sp.encode(text)) == text
    assert len(sp.encode(lines[0])) < len(lines[0])  # frequent characters and pairs are pieces


def test_tokenize_chunk_is_a_pure_path_function(tmp_path, tok512):
    import sentencepiece as spm

    docs = ["ROMEO:\nHello there.", "JULIET:\n  Good night."]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(d) for d in docs) + "\n", encoding="utf-8")
    spec = {
        "split": "train",
        "index": 0,
        "documents": 2,
        "bytes": 40,
        "text_path": str(tmp_path / "c.jsonl"),
        "tokens_path": str(tmp_path / "c.tokens.npy"),
        "tokenizer": str(tok512),
    }
    summary = json.loads(Path(tokenize_chunk(spec)).read_text())
    stream = np.load(summary["tokens_path"], allow_pickle=False)
    sp = spm.SentencePieceProcessor(model_file=str(tok512))
    want = sp.encode(docs[0]) + [sp.eos_id()] + sp.encode(docs[1]) + [sp.eos_id()]
    assert stream.dtype == np.int32 and stream.tolist() == want and summary["tokens"] == len(want)


# ----------------------------------------------------------------------------- bad input


def test_missing_path_is_named(tmp_path):
    with pytest.raises(DataError, match=r"data.sources\[0\]: '.*nope.txt' does not exist"):
        run_small(make_cfg([tmp_path / "nope.txt"]), tmp_path, None)
    (tmp_path / "notes.md").write_text("x")
    with pytest.raises(DataError, match="not a supported corpus file"):
        resolve_sources(make_cfg([tmp_path / "notes.md"]))


def test_empty_corpus_is_an_error(tmp_path, tok512):
    (tmp_path / "blank.txt").write_text("\n\n   \n\t\n", encoding="utf-8")
    (tmp_path / "e.jsonl").write_text('{"text": ""}\n{"text": "   "}\n{"text": null}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"no documents left after cleaning \(3 seen: empty 2, whitespace 1\)"):
        run_small(make_cfg([tmp_path / "blank.txt", tmp_path / "e.jsonl"]), tmp_path, tok512)


def test_binary_file_is_skipped_and_counted(tmp_path, tok512):
    write_txt(tmp_path / "good.txt", paragraphs(60))
    (tmp_path / "image.txt").write_bytes(bytes(range(256)) * 40)
    art = run_small(make_cfg([tmp_path / "good.txt", tmp_path / "image.txt"], "data.num_shards=1"), tmp_path, tok512)
    m = ArtifactStore.read_manifest(art)
    assert m["metrics"]["documents_skipped"]["binary"] == 1 and m["metrics"]["files_skipped"] == 1
    assert m["data"]["skipped_files"][0]["path"].endswith("image.txt")


def test_malformed_jsonl_names_file_and_line(tmp_path):
    lines = [json.dumps({"text": t}) for t in paragraphs(5)]
    lines.insert(3, '{"text": "unterminated}')
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"bad.jsonl:4: not valid JSON"):
        run_small(make_cfg([tmp_path / "bad.jsonl"]), tmp_path, None)
    (tmp_path / "nofield.jsonl").write_text('{"body": "x"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"nofield.jsonl:1: no 'text' field \(keys: body\); set data.text_field"):
        run_small(make_cfg([tmp_path / "nofield.jsonl"]), tmp_path, None)


def test_ten_megabyte_single_line(tmp_path, tok512):
    big = ("All the world's a stage, and all the men and women merely players. " * 150_000)[:10_000_000]
    (tmp_path / "big.jsonl").write_text(json.dumps({"text": big}) + "\n", encoding="utf-8")
    (tmp_path / "big.txt").write_text(big, encoding="utf-8")
    docs = list(read_documents(resolve_sources(make_cfg([tmp_path / "big.jsonl"]))[0][0], make_cfg([]).data))
    assert len(docs) == 1 and len(docs[0]) == 10_000_000
    write_txt(tmp_path / "good.txt", paragraphs(60))
    cfg = make_cfg([tmp_path / "big.txt", tmp_path / "good.txt"], "data.clean.max_chars=1000000", "data.num_shards=1")
    m = ArtifactStore.read_manifest(run_small(cfg, tmp_path, tok512))
    assert m["metrics"]["documents_skipped"]["too_long"] == 1 and m["metrics"]["raw_text_mb"] > 10


def test_corrupt_gzip_is_named(tmp_path):
    payload = "\n".join(json.dumps({"text": t}) for t in paragraphs(300)).encode()
    z = gzip.compress(payload)
    (tmp_path / "cut.jsonl.gz").write_bytes(z[: len(z) // 2])
    with pytest.raises(DataError, match=r"cut.jsonl.gz: corrupt or truncated gzip"):
        run_small(make_cfg([tmp_path / "cut.jsonl.gz"]), tmp_path, None)
    flipped = bytearray(z)
    flipped[len(z) // 2] ^= 0xFF
    (tmp_path / "flip.jsonl.gz").write_bytes(bytes(flipped))
    with pytest.raises(DataError, match=r"flip.jsonl.gz"):
        run_small(make_cfg([tmp_path / "flip.jsonl.gz"]), tmp_path, None)


def test_invalid_utf8_replace_or_skip(tmp_path, tok512):
    docs = paragraphs(60)
    raw = "\n\n".join(docs).encode() + b"\n\nbroken \xff\xfe bytes here\n"
    (tmp_path / "c.txt").write_bytes(raw)
    for policy, repaired, skipped in (("replace", 1, 0), ("skip", 0, 1)):
        cfg = make_cfg([tmp_path / "c.txt"], f"data.clean.invalid_utf8={policy}", "data.num_shards=1")
        met = ArtifactStore.read_manifest(run_small(cfg, tmp_path / policy, tok512))["metrics"]
        assert met["documents_repaired"]["invalid_utf8"] == repaired
        assert met["documents_skipped"]["invalid_utf8"] == skipped
        assert met["documents_kept"] == len(docs) + repaired


def test_too_few_blocks_for_shards(tmp_path, tok512):
    write_txt(tmp_path / "c.txt", paragraphs(6))
    with pytest.raises(DataError, match=r"lower data.num_shards"):
        run_small(
            make_cfg([tmp_path / "c.txt"], "data.num_shards=500", "data.validation_documents=1"), tmp_path, tok512
        )


def test_fast_mindrecord_writer_matches_public_api(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 512, size=(3000, 65), dtype=np.int32)
    mask = np.ones((3000, 64), dtype=np.int32)
    mask[-1, 20:] = 0
    digests = []
    for fast in (True, False):
        monkeypatch.setattr(data.shards, "_FAST_WRITE", fast)
        w = data.shards._SplitWriter(tmp_path / str(fast), "train", 2, 64)
        w._put(ids, mask)
        w.close("drop", 3, tmp_path / str(fast))
        digests.append(
            [
                hashlib.sha256((tmp_path / str(fast) / f).read_bytes()).hexdigest()
                for rel in w.files
                for f in (rel, rel + ".db")
            ]
        )
    assert digests[0] == digests[1]


def test_uncached_hub_dataset_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match=r"hf:nobody/not-cached: cannot load with HF datasets .*use local files"):
        run_small(make_cfg(["hf:nobody/not-cached"]), tmp_path, None)
