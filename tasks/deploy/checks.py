"""Checks of an exported model against the MindSpore network it came from (the export stage's verification).

    reference = Reference(net)                                  # MindSpore logits, memoised
    rows = onnx_checks(OnnxGenerator(path), reference, prompts, vocab_size)   # (batch, sequence, past) grid
    pairs = greedy_pairs(onnx_gen, net, sp, [(text, ids)], max_new_tokens=32, seq_length=128)
    genai = verify_genai(export_dir, sp, texts, pairs, 32, 128)   # onnxruntime-genai: tokens and tokenizer ids
    int8 = int8_report(export_dir, onnx_gen, reference, prompts, pairs, heldout, data, export_cfg)

Every function returns records for export.json / the model card; the stage (tasks/stages/export.py)
decides what fails it. MindSpore, onnxruntime and onnxruntime-genai are imported where used (lazy): the export
stage's parent side imports this module, and onnxruntime-genai's checks run without MindSpore.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from model.convert import nonfinite

STEPS = 8  # single-token steps (present → past) of the ONNX check
CHUNK = 3  # tokens per row of the batched check over a past
SPEED_TOKENS = 32  # decode steps timed per model for the int8 speed comparison


class ExportCheckFailed(RuntimeError):
    """An exported model does not reproduce the MindSpore network (logits or greedy tokens)."""

    permanent = True  # deterministic: the same export fails the same way


class Reference:
    """Logits of the MindSpore network (eager) for an int32 batch, memoised: the ground truth of every check."""

    def __init__(self, net):
        self.net = net
        self._memo: dict[tuple, np.ndarray] = {}

    def __call__(self, x: np.ndarray) -> np.ndarray:
        import mindspore as ms

        x = np.asarray(x, np.int32)
        k = (x.shape, x.tobytes())
        if k not in self._memo:
            logits = self.net(ms.Tensor(x)).asnumpy()
            check_finite_logits(logits, ((p.name, p.asnumpy()) for p in self.net.trainable_params()), "MindSpore")
            self._memo[k] = logits
        return self._memo[k]


def check_finite_logits(logits: np.ndarray, weights: Iterable[tuple[str, np.ndarray]], what: str) -> None:
    """ExportCheckFailed naming the tensor to blame when a reference's logits hold NaN/Inf (instead of a
    "max |Δlogit| nan" that compares NaN with NaN): the first non-finite weight, else the largest one (finite
    weights whose products overflow float32)."""
    if np.isfinite(logits).all():
        return
    largest = (0.0, "?")
    for name, w in weights:
        if bad := nonfinite(name, w):
            raise ExportCheckFailed(
                f"export verification failed: {what}'s logits are NaN/Inf: {bad}; this model "
                "cannot be exported: rebuild it, or convert it again from a good source"
            )
        if w.size:
            largest = max(largest, (float(np.abs(w).max()), name))
    raise ExportCheckFailed(
        f"export verification failed: {what}'s logits are NaN/Inf though every weight is finite: "
        f"the largest, |{largest[0]:.2g}| in {largest[1]}, overflows float32 arithmetic; this "
        "model cannot be exported: rebuild it, or convert it again from a good source"
    )


def verify_mindir(path: Path, reference: Reference, batches: list[np.ndarray]) -> float:
    """Max |logit difference| of the reloaded MindIR (`ms.load` + `nn.GraphCell`) against the reference."""
    import mindspore as ms

    graph = ms.nn.GraphCell(ms.load(str(path)))
    return max(max_abs_diff(graph(ms.Tensor(x)).asnumpy(), reference(x)) for x in batches)


def onnx_checks(gen, reference: Reference, prompts: list[list[int]], vocab_size: int) -> list[dict[str, Any]]:
    """onnxruntime's logits against MindSpore's at several (batch, sequence, past) combinations.

    Each prompt is extended by CHUNK + STEPS fixed pseudo-random tokens; MindSpore runs the
    extended rows once (right-padded: causal attention keeps every real position exact) and
    every ONNX call is compared with the positions it computes. Returns one record per
    combination: check, batch, sequence, past (for a left-padded batch: its padded lengths),
    max_abs_diff.
    """
    rng = np.random.default_rng(0)
    batch = prompts if len(prompts) > 1 else [prompts[0], prompts[0][len(prompts[0]) // 2 :]]  # batch > 1, padded
    ext = [[int(t) for t in rng.integers(0, vocab_size, CHUNK + STEPS)] for _ in batch]
    rows = [p + e for p, e in zip(batch, ext)]
    ref = reference(token_batches(rows, len(rows), max(map(len, rows)))[0])  # [n, L, V]
    out: list[dict[str, Any]] = []

    def record(check: str, b: int, t: int, past: int, d: float) -> None:
        out.append({"check": check, "batch": b, "sequence": t, "past": past, "max_abs_diff": d})

    def ones(b: int, n: int) -> np.ndarray:
        return np.ones((b, n), np.int64)

    # each prompt alone, no past
    for i, p in enumerate(batch[: len(prompts)]):
        logits, _ = gen.forward(np.array([p]), ones(1, len(p)), np.arange(len(p))[None], gen.empty_past(1))
        record("one prompt, no past", 1, len(p), 0, max_abs_diff(logits[0], ref[i, : len(p)]))
    # one row as a past (its prompt) plus everything after it in one call
    p0, r0 = batch[0], rows[0]
    _, past = gen.forward(np.array([p0]), ones(1, len(p0)), np.arange(len(p0))[None], gen.empty_past(1))
    rest = r0[len(p0) :]
    logits, _ = gen.forward(np.array([rest]), ones(1, len(r0)), np.arange(len(p0), len(r0))[None], past)
    record(
        "one prompt as the past, the rest in one call",
        1,
        len(rest),
        len(p0),
        max_abs_diff(logits[0], ref[0, len(p0) : len(r0)]),
    )
    # all prompts left-padded in one batch, no past
    n, t = len(batch), max(map(len, batch))
    ids, mask = np.zeros((n, t), np.int64), np.zeros((n, t), np.int64)
    for i, p in enumerate(batch):
        ids[i, t - len(p) :], mask[i, t - len(p) :] = p, 1
    pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    logits, past = gen.forward(ids, mask, pos, gen.empty_past(n))
    record(
        "batch, left-padded, no past",
        n,
        t,
        0,
        max(max_abs_diff(logits[i, t - len(p) :], ref[i, : len(p)]) for i, p in enumerate(batch)),
    )
    # the batch continues with a chunk of CHUNK tokens per row over its past
    lens = np.array([len(p) for p in batch])
    chunk = np.array([e[:CHUNK] for e in ext], np.int64)
    mask = np.concatenate([mask, ones(n, CHUNK)], axis=1)
    logits, past = gen.forward(chunk, mask, lens[:, None] + np.arange(CHUNK)[None], past)
    record(
        "batch, left-padded, a chunk over the past",
        n,
        CHUNK,
        t,
        max(max_abs_diff(logits[i], ref[i, lens[i] : lens[i] + CHUNK]) for i in range(n)),
    )
    # STEPS single-token steps, present fed back as past
    d = 0.0
    for s in range(STEPS):
        tok = np.array([[e[CHUNK + s]] for e in ext], np.int64)
        mask = np.concatenate([mask, ones(n, 1)], axis=1)
        logits, past = gen.forward(tok, mask, (lens + CHUNK + s)[:, None], past)
        d = max(d, max(max_abs_diff(logits[i, 0], ref[i, lens[i] + CHUNK + s]) for i in range(n)))
    record(f"batch, {STEPS} single-token steps (present → past)", n, 1, t + CHUNK, d)
    out[-1]["past_last"] = t + CHUNK + STEPS - 1
    return out


def greedy_pairs(
    gen, net, sp, prompts: list[tuple[str, list[int]]], max_new_tokens: int, seq_length: int
) -> list[dict[str, Any]]:
    """Greedy tokens per prompt from MindSpore's generator and from onnxruntime's (`gen`), over the same window."""
    from tasks.deploy.onnx_generate import decode_completion
    from tasks.modeling.build import generator

    ms_gen, eos = generator(net, max_len=seq_length), sp.eos_id()
    out = []
    for text, ids in prompts:
        want = ms_gen.generate(ids, max_new_tokens, eos_id=eos)
        got = gen.generate(ids, max_new_tokens, eos_id=eos)
        out.append(
            {
                "prompt": text,
                "prompt_ids": ids,
                "mindspore": want,
                "onnxruntime": got,
                "completion": decode_completion(sp, ids, got),
            }
        )
    return out


def divergence(g: dict[str, Any], runtime: str) -> str:
    want, got = g["mindspore"], g[runtime]
    at = next((i for i, (a, c) in enumerate(zip(want, got)) if a != c), min(len(want), len(got)))
    return f"greedy tokens differ for prompt {g['prompt']!r} from new token {at}: MindSpore {want} vs {runtime} {got}"


def token_batches(rows: list[list[int]], batch: int, length: int) -> list[np.ndarray]:
    """Token rows right-padded with 0 into int32 arrays of [batch, length] (spare rows all padding)."""
    out = []
    for start in range(0, len(rows), batch):
        x = np.zeros((batch, length), np.int32)
        for i, r in enumerate(rows[start : start + batch]):
            x[i, : len(r)] = r[:length]
        out.append(x)
    return out


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        raise ExportCheckFailed(
            f"export verification failed: logits of shape {list(a.shape)}, expected {list(b.shape)}"
        )
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


# ----------------------------------------------------------------------------- onnxruntime-genai


def genai_generate(model, ids: list[int], max_new_tokens: int, hold_eos: bool = False) -> list[int]:
    """Greedy new tokens of onnxruntime-genai after `ids` (stops at the config's EOS, included, unless hold_eos)."""
    import onnxruntime_genai as og

    if max_new_tokens <= 0:
        return []
    params = og.GeneratorParams(model)
    opts = {"max_length": len(ids) + max_new_tokens, "do_sample": False}
    params.set_search_options(**opts, **({"min_length": opts["max_length"]} if hold_eos else {}))
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    while not gen.is_done():
        gen.generate_next_token()
    return [int(t) for t in gen.get_sequence(0)[len(ids) :]]


def verify_genai(
    out: Path, sp, texts: list[str], greedy: list[dict[str, Any]], max_new_tokens: int, seq_length: int
) -> dict[str, Any]:
    """onnxruntime-genai on the export directory: greedy tokens per prompt (added to `greedy` rows) and tokenizer
    ids."""
    import onnxruntime_genai as og

    model = og.Model(str(out))
    for g in greedy:  # the window of model.generate.Generator(max_len=seq_length)
        ids = g["prompt_ids"][-(seq_length - 1) :]
        g["onnxruntime_genai"] = genai_generate(model, ids, min(max_new_tokens, seq_length - len(ids)))
    res = {
        "greedy_tokens_match": all(g["mindspore"] == g["onnxruntime_genai"] for g in greedy),
        "version": og.__version__,
    }
    if not (out / "tokenizer.json").is_file():
        return {
            **res,
            "tokenizer_ids_match": None,
            "tokenizer_texts": 0,
            "tokenizer_tokens": 0,
            "tokenizer_first_mismatch": None,
            "text_prefix": "",
            "decode_matches": None,
        }
    tok = og.Tokenizer(model)
    # onnxruntime-genai 0.18 does not add SentencePiece's dummy prefix ("▁" before the text) with this
    # tokenizer.json: for a model that has one, the equivalent of sp.encode(text) is tok.encode(" " + text)
    prefix = " " if json.loads((out / "tokenizer_config.json").read_text()).get("add_prefix_space") else ""
    first, tokens = None, 0
    for text in texts:
        want, got = sp.encode(text), [int(t) for t in tok.encode(prefix + text)]
        tokens += len(want)
        if want != got and first is None:
            at = next((i for i, (a, c) in enumerate(zip(want, got)) if a != c), min(len(want), len(got)))
            first = {"text": text[max(0, at - 40) : at + 80], "model": want[at : at + 8], "genai": got[at : at + 8]}
    decoded = all(
        tok.decode(g["mindspore"]) in (sp.decode(g["mindspore"]), prefix + sp.decode(g["mindspore"])) for g in greedy
    )
    return {
        **res,
        "tokenizer_ids_match": first is None,
        "tokenizer_texts": len(texts),
        "tokenizer_tokens": tokens,
        "tokenizer_first_mismatch": first,
        "text_prefix": prefix,
        "decode_matches": decoded,
    }


# ----------------------------------------------------------------------------- int8


def perplexity(gen, ids: np.ndarray, labels: np.ndarray) -> float:
    """exp(mean NLL) of `labels` (aligned with `ids`; -100 skipped) under an OnnxGenerator's full forward."""
    logits = gen.logits([list(r) for r in ids]).astype(np.float64)  # [B, T, V]
    keep = labels != -100
    z = logits - logits.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(z).sum(axis=-1))  # [B, T]
    target = np.take_along_axis(z, np.where(keep, labels, 0)[..., None], axis=-1)[..., 0]
    return float(np.exp(((lse - target) * keep).sum() / max(int(keep.sum()), 1)))


def decode_speeds(gens: list, prompt: list[int], n: int, rounds: int = 3) -> list[float]:
    """Decode tokens/s of each OnnxGenerator (greedy, no EOS stop; the steps after the first token).

    After a warm-up, the generators take turns for `rounds` rounds and each keeps its best: on a
    shared machine the others' load then hits both alike. A rough figure, not a benchmark
    (scripts/bench/export.py is).
    """
    best = [0.0] * len(gens)
    for g in gens:
        g.generate(prompt, 2)
    for _ in range(rounds):
        for i, g in enumerate(gens):
            it = g.stream(prompt, n)
            next(it)
            t0 = time.perf_counter()
            steps = sum(1 for _ in it)
            best[i] = max(best[i], steps / max(time.perf_counter() - t0, 1e-9))
    return [round(b, 1) for b in best]


def int8_report(
    out: Path,
    fp32,
    reference: Reference,
    prompts: list[list[int]],
    greedy: list[dict[str, Any]],
    heldout: tuple[np.ndarray, np.ndarray] | None,
    data: Path | None,
    ex,
) -> dict[str, Any]:
    """Size, decode speed, perplexity change, logit difference and greedy agreement of model.int8.onnx vs fp32."""
    from tasks.deploy.onnx_generate import OnnxGenerator

    q = OnnxGenerator(out / "model.int8.onnx", max_len=ex.seq_length)
    fp32_bytes, q_bytes = (out / "model.onnx").stat().st_size, (out / "model.int8.onnx").stat().st_size
    x = token_batches(prompts, len(prompts), max(map(len, prompts)))[0]
    ref = reference(x)
    got = q.logits([list(p) for p in prompts])
    diff = max(max_abs_diff(got[i, : len(p)], ref[i, : len(p)]) for i, p in enumerate(prompts))
    q_greedy = [q.generate(g["prompt_ids"], ex.max_new_tokens, eos_id=fp32.eos_id) for g in greedy]
    if heldout is not None:
        ids, labels = heldout
        source = f"held-out: {len(ids)} valid blocks × {ids.shape[1]} tokens of {data.parent.name}/{data.name}"
    else:  # the prompts and MindSpore's greedy continuations, scored after the first token
        rows = [list(g["prompt_ids"]) + list(g["mindspore"]) for g in greedy]
        rows = [r for r in rows if len(r) > 1] or [list(prompts[0])]
        t = max(map(len, rows)) - 1
        ids = np.zeros((len(rows), t), np.int64)
        labels = np.full((len(rows), t), -100, np.int64)
        for i, r in enumerate(rows):
            ids[i, : len(r) - 1], labels[i, : len(r) - 1] = r[:-1], r[1:]
        source = "the export prompts and MindSpore's greedy continuations (no data artifact in the store)"
    p32, p8 = perplexity(fp32, ids, labels), perplexity(q, ids, labels)
    n = max(2, min(SPEED_TOKENS, ex.seq_length - len(prompts[0])))
    s32, s8 = decode_speeds([fp32, q], prompts[0], n)
    return {
        "file": "model.int8.onnx",  # "method" and "quantization": tasks/deploy/formats.py, added by the stage
        "bytes": q_bytes,
        "fp32_bytes": fp32_bytes,
        "size_ratio": round(q_bytes / fp32_bytes, 4),
        "max_abs_diff": diff,
        "greedy_tokens_match": all(a == g["mindspore"] for a, g in zip(q_greedy, greedy)),
        "greedy": q_greedy,
        "perplexity": p8,
        "fp32_perplexity": p32,
        "perplexity_change_pct": round(100.0 * (p8 - p32) / p32, 4),
        "perplexity_source": source,
        "decode_tokens_per_s": s8,
        "fp32_decode_tokens_per_s": s32,
        "speed_tokens": n,
        "speedup": round(s8 / s32, 3) if s32 else None,
    }
