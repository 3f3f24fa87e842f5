"""Text generation from the exported ONNX decoder with onnxruntime alone (no MindSpore), with a KV cache.

Imports only numpy and onnxruntime (sentencepiece, or tokenizers for a tokenizer.json model, for text in /
text out), so it runs where MindSpore is not installed; the export stage copies this file into its artifact as
`onnx_generate.py`, with model/sampling.py beside it as `sampling.py` (the one sampling rule, numpy only).

    gen = OnnxGenerator("artifacts/export/<key>/model.onnx")
    new_ids = gen.generate(prompt_ids, max_new_tokens=32, eos_id=sp.eos_id())           # greedy
    new_ids = gen.generate(prompt_ids, 32, temperature=0.8, top_k=40, top_p=0.95, seed=1)
    for tok in gen.stream(prompt_ids, 32, eos_id=sp.eos_id()): ...                       # one id at a time
    rows = gen.generate_batch([ids_a, ids_b], 32, eos_id=sp.eos_id())                   # left-padded batch
    text = decode_completion(sp, prompt_ids, new_ids)
    text = generate_text("artifacts/export/<key>", "ROMEO:", max_new_tokens=32)

    python -m tasks.deploy.onnx_generate artifacts/export/<key> "ROMEO:" [--max-new-tokens 32] [--temperature 0.8 ...]

The model (tasks/deploy/onnx_decoder.py) takes input_ids, attention_mask, position_ids and
past_key_values.{i}.key/value, and returns logits and present.{i}.key/value. Generation is
one prefill over the prompt (past of length 0), then one call per new token that feeds the
previous call's `present` back as `past`: each token costs one token's work, not a full
forward. A batch is left-padded: attention_mask 0 over the padding, position_ids counting
each row's real tokens from 0, so every row sees exactly what it would see alone.

Semantics match `model.generate.Generator` (MindSpore) token for token: the prompt keeps its
last max_len - 1 tokens, generation stops after max_new_tokens, at eos_id (included), when
`stop(new_ids)` is true (the token that triggered it included), or when the sequence fills
max_len (default: the model's max_seq_length, from the ONNX metadata); sampling is
`model.sampling.sample_next` (the MindSpore generator's too) on numpy's default_rng(seed).

Prompts are encoded as in pretraining and evaluation: [eos_id] + sentencepiece ids (the
data stage ends every document with EOS, so EOS marks the start of a new one); a tokenizer.json
model's prompts are its tokenizer's own encoding (special tokens included), as transformers'.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

if __package__:  # tasks.deploy.onnx_generate, inside the project
    from model.sampling import sample_next
else:  # the copy in an export artifact (run as a script, or by path): sampling.py was copied beside it
    import importlib.util as _util

    _spec = _util.spec_from_file_location("_msllm_sampling", Path(__file__).resolve().parent / "sampling.py")
    _sampling = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_sampling)
    sample_next = _sampling.sample_next

# The few-line example of docs/PIPELINE.md (the export stage also writes it into MODEL_CARD.md, and a
# test runs it in a fresh interpreter). ART is the export artifact directory.
SNIPPET = """\
import numpy as np, onnxruntime as ort, sentencepiece as spm

sess = ort.InferenceSession(f"{ART}/model.onnx")
sp = spm.SentencePieceProcessor(model_file=f"{ART}/tokenizer.model")
past = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)  # empty KV cache
        for i in sess.get_inputs() if i.name.startswith("past_key_values.")}
ids = [sp.eos_id()] + sp.encode("ROMEO:")            # EOS starts a document, as in training
new, feed = [], ids                                  # prefill the prompt, then one token a step
for _ in range(64):
    n = len(ids) + len(new)                          # tokens in the cache after this call
    out = sess.run(None, {"input_ids": np.array([feed], np.int64),
                          "attention_mask": np.ones((1, n), np.int64),
                          "position_ids": np.arange(n - len(feed), n, dtype=np.int64)[None], **past})
    tok = int(out[0][0, -1].argmax())                # greedy, at the last position
    if tok == sp.eos_id():
        break
    new, feed = new + [tok], [tok]
    past = dict(zip(past, out[1:]))                  # present → past
print(sp.decode(ids[1:] + new))
"""

GENAI_SNIPPET = """\
import json, onnxruntime_genai as og

model = og.Model(ART)                                # genai_config.json + model.onnx + tokenizer.json
tok = og.Tokenizer(model)
eos = json.load(open(f"{ART}/genai_config.json"))["model"]["eos_token_id"]
ids = [eos] + list(tok.encode("ROMEO:"))             # the same prompt format: EOS, then the text
params = og.GeneratorParams(model)
params.set_search_options(max_length=len(ids) + 64, do_sample=False)   # greedy; stops at EOS
gen = og.Generator(model, params)
gen.append_tokens(ids)
while not gen.is_done():
    gen.generate_next_token()
print(tok.decode(gen.get_sequence(0)[1:]))
"""


@dataclass
class KVState:
    """The cache of a batch being decoded: what `OnnxGenerator.step` feeds the model next.

    past: past_key_values.{i}.key/value arrays [B, nkv, S, hd]; attention_mask [B, S] (0 over
    left padding); positions [B]: the position the next token of each row takes.
    """

    past: dict[str, np.ndarray]
    attention_mask: np.ndarray
    positions: np.ndarray

    @property
    def length(self) -> int:
        """Cache slots filled (padding included): S."""
        return int(self.attention_mask.shape[1])


class OnnxGenerator:
    """KV-cache generation over the exported decoder (model.onnx of an export artifact).

    `threads` sets onnxruntime's intra-op threads (default: its own choice); `max_len` the
    longest sequence (default: the model's max_seq_length). One instance may serve many
    requests one after another; it holds no per-request state (KVState does).
    """

    # Prompt tokens per prefill call. The decoder returns logits at every position it is fed ([B, T, V]: 393 MB for a
    # 2000-token SmolLM2 prompt) and scores [B, nh, T, S] per layer, and onnxruntime's arena keeps its largest call's
    # buffers: in chunks a prompt of any length costs what one chunk does (the decoder's mask is causal in cache-slot
    # order, so a chunk over the cache of the ones before it is the same attention).
    prefill_chunk = 256

    def __init__(
        self,
        model_path: str | Path,
        threads: int | None = None,
        max_len: int | None = None,
        providers: Sequence[str] = ("CPUExecutionProvider",),
    ):
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        self.path = Path(model_path)
        self.session = ort.InferenceSession(str(model_path), opts, providers=list(providers))
        inputs = {i.name: i for i in self.session.get_inputs()}
        need = {"input_ids", "attention_mask", "position_ids"}
        self.past_names = [n for n in inputs if n.startswith("past_key_values.")]
        if not need <= set(inputs) or not self.past_names:
            raise ValueError(
                f"{model_path}: not a KV-cache decoder (inputs {sorted(inputs)}); expected input_ids, "
                "attention_mask, position_ids and past_key_values.{i}.key/value: re-export it with "
                "`msllm export` (tasks/deploy/onnx_decoder.py)"
            )
        self.present_names = ["present." + n.removeprefix("past_key_values.") for n in self.past_names]
        shape = inputs[self.past_names[0]].shape  # [batch, kv_heads, past, head_dim]
        self.kv_heads, self.head_dim = int(shape[1]), int(shape[3])
        self.num_layers = len(self.past_names) // 2
        self.output_names = ["logits", *self.present_names]
        meta = self.session.get_modelmeta().custom_metadata_map
        arch = json.loads(meta["model_config"]) if "model_config" in meta else {}
        self.vocab_size = arch.get("vocab_size")
        self.max_seq_length = int(arch.get("max_seq_length", 1 << 30))
        self.max_len = int(max_len or self.max_seq_length)
        if self.max_len > self.max_seq_length:
            raise ValueError(f"max_len {self.max_len} exceeds the model's max_seq_length {self.max_seq_length}")
        self.eos_id = int(meta["eos_id"]) if meta.get("eos_id", "").lstrip("-").isdigit() else None

    # ------------------------------------------------------------------ model calls

    def forward(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, past: dict[str, np.ndarray]
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """One model call: (logits [B, T, V], present as the next call's past)."""
        feed = {
            "input_ids": np.asarray(input_ids, np.int64),
            "attention_mask": np.asarray(attention_mask, np.int64),
            "position_ids": np.asarray(position_ids, np.int64),
            **past,
        }
        out = self.session.run(self.output_names, feed)
        return out[0], dict(zip(self.past_names, out[1:]))

    def empty_past(self, batch: int) -> dict[str, np.ndarray]:
        """A cache of length 0 for `batch` rows (the past of a prefill)."""
        return {n: np.zeros((batch, self.kv_heads, 0, self.head_dim), np.float32) for n in self.past_names}

    def prefill(self, rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, KVState]:
        """Run the prompts `rows` (left-padded into one batch): (last real position's logits [B, V], state)."""
        if not rows or any(len(r) == 0 for r in rows):
            raise ValueError("prefill: every prompt needs at least one token id (e.g. EOS)")
        b, t = len(rows), max(len(r) for r in rows)
        ids = np.zeros((b, t), np.int64)
        mask = np.zeros((b, t), np.int64)
        for i, r in enumerate(rows):
            ids[i, t - len(r) :] = r
            mask[i, t - len(r) :] = 1
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
        past = self.empty_past(b)
        for c in range(0, t, self.prefill_chunk):  # chunks: each call's logits [B, C, V] and scores [B, nh, C, S]
            logits, past = self.forward(
                ids[:, c : c + self.prefill_chunk],
                mask[:, : c + self.prefill_chunk],
                positions[:, c : c + self.prefill_chunk],
                past,
            )
        return logits[:, -1], KVState(past, mask, mask.sum(axis=1).astype(np.int64))

    def step(self, state: KVState, tokens: Sequence[int]) -> np.ndarray:
        """Feed one token per row at the end of the cache (updates `state`); the logits [B, V] after it."""
        b = len(state.positions)
        ids = np.asarray(tokens, np.int64).reshape(b, 1)
        mask = np.concatenate([state.attention_mask, np.ones((b, 1), np.int64)], axis=1)
        logits, state.past = self.forward(ids, mask, state.positions.reshape(b, 1), state.past)
        state.attention_mask = mask
        state.positions = state.positions + 1
        return logits[:, -1]

    def logits(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        """Full-sequence logits [B, T, V] of token rows, right-padded to the longest (T); no cache kept.

        Positions after a row's end hold padding logits; positions before it are exact.
        """
        b, t = len(rows), max(len(r) for r in rows)
        ids = np.zeros((b, t), np.int64)
        mask = np.zeros((b, t), np.int64)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = r
            mask[i, : len(r)] = 1
        positions = np.broadcast_to(np.arange(t, dtype=np.int64), (b, t))
        return self.forward(ids, mask, positions, self.empty_past(b))[0]

    # ------------------------------------------------------------------ generation

    def _window(self, prompt_ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], int]:
        if not len(prompt_ids):
            raise ValueError("generate: the prompt is empty; pass at least one token id (e.g. EOS)")
        ids = [int(t) for t in prompt_ids][-(self.max_len - 1) :] if self.max_len > 1 else [int(prompt_ids[-1])]
        return ids, max(0, min(max_new_tokens, self.max_len - len(ids)))

    def stream(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = 0,
        eos_id: int | None = None,
        stop: Callable[[list[int]], bool] | None = None,
    ) -> Iterator[int]:
        """Yield the new token ids one at a time (as `generate` returns them; see the module docstring)."""
        ids, budget = self._window(prompt_ids, max_new_tokens)
        if budget == 0:
            return
        rng = np.random.default_rng(seed)
        logits, state = self.prefill([ids])
        new: list[int] = []
        while True:
            tok = sample_next(logits[0], temperature, top_k, top_p, rng)
            new.append(tok)
            yield tok
            if tok == eos_id or (stop is not None and stop(new)) or len(new) == budget:
                return
            logits = self.step(state, [tok])

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int = 64, **kwargs) -> list[int]:
        """New token ids after prompt_ids (prompt excluded; eos_id included when it ends the text).

        Keyword arguments: temperature, top_k, top_p, seed, eos_id, stop (as `stream`).
        """
        return list(self.stream(prompt_ids, max_new_tokens, **kwargs))

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = 0,
        eos_id: int | None = None,
    ) -> list[list[int]]:
        """New token ids for several prompts decoded together (left-padded; one call per step for all rows).

        Greedy rows equal `generate` of each prompt alone. Sampling draws every row from one
        default_rng(seed), row after row, so sampled rows differ from single-prompt runs.
        A row that ends (eos_id or its budget) stops growing; the batch runs until all have.
        """
        windows = [self._window(p, max_new_tokens) for p in prompts]
        rows = [ids for ids, _ in windows]
        budgets = [budget for _, budget in windows]
        steps = max(budgets, default=0)
        # rows padded to a common length must still fit max_len after `steps` tokens
        longest = max(len(r) for r in rows)
        steps = min(steps, self.max_len - longest) if steps else 0
        out: list[list[int]] = [[] for _ in rows]
        if steps <= 0:
            return out
        rng = np.random.default_rng(seed)
        logits, state = self.prefill(rows)
        done = [b == 0 for b in budgets]
        for n in range(steps):
            toks = []
            for i, row in enumerate(logits):
                if done[i]:
                    toks.append(eos_id if eos_id is not None else 0)
                    continue
                tok = sample_next(row, temperature, top_k, top_p, rng)
                out[i].append(tok)
                done[i] = tok == eos_id or len(out[i]) >= budgets[i]
                toks.append(tok)
            if all(done) or n == steps - 1:
                break
            logits = self.step(state, toks)
        return out


def encode_prompt(sp, text: str) -> list[int]:
    """How pretraining and evaluation see the start of a document: [eos_id] + ids for a SentencePiece model, the
    tokenizer's own encoding (with its special tokens) for a tokenizer.json model (its `prompt_ids`)."""
    if hasattr(sp, "prompt_ids"):
        return sp.prompt_ids(text)
    return [sp.eos_id()] + sp.encode(text)


class JsonTokenizer:
    """A Hugging Face tokenizer.json (+ tokenizer_config.json for the special tokens) with the few methods this
    script uses; needs the `tokenizers` package."""

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer  # lazy: the artifact's copy of this script needs numpy and onnxruntime only

        d = Path(directory)
        self.tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg = json.loads((d / "tokenizer_config.json").read_text()) if (d / "tokenizer_config.json").is_file() else {}
        eos = cfg.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        self._eos = self.tok.token_to_id(eos) if isinstance(eos, str) else None

    def eos_id(self) -> int:
        return -1 if self._eos is None else int(self._eos)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def prompt_ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer(artifact: str | Path):
    """The export's tokenizer: its tokenizer.model (sentencepiece) when it has one, else its tokenizer.json."""
    art = Path(artifact)
    if (art / "tokenizer.model").is_file():
        import sentencepiece as spm  # lazy: as tokenizers in JsonTokenizer

        return spm.SentencePieceProcessor(model_file=str(art / "tokenizer.model"))
    return JsonTokenizer(art)


def decode_completion(sp, prompt_ids: Sequence[int], new_ids: Sequence[int]) -> str:
    """The text of new_ids after prompt_ids, EOS dropped. Decoded together with the prompt: decoded
    alone, a completion would lose its leading space."""
    eos = sp.eos_id()
    head = [int(t) for t in prompt_ids if t != eos]
    new = [int(t) for t in new_ids if t != eos]
    prefix, full = sp.decode(head), sp.decode(head + new)
    return full[len(prefix) :] if full.startswith(prefix) else sp.decode(new)


class ExportChanged(ValueError):
    """A file of an export artifact differs from the digest the export recorded for it."""


def check_export(artifact: str | Path, names: Sequence[str] = ("model.onnx", "tokenizer.model")) -> None:
    """Check the files about to be used against the sha256 the export recorded (export.json's `digests`, or
    the artifact's manifest.json): standalone, so a copied export directory is checked without msllm.
    ExportChanged names the file, the expected and the actual digest; a directory with neither record
    (a hand-built one) is not checked."""
    art = Path(artifact)
    recorded: dict[str, str] = {}
    for meta, read in (
        ("manifest.json", lambda d: {f["path"]: f["sha256"] for f in d.get("files", [])}),
        ("export.json", lambda d: dict(d.get("digests") or {})),
    ):
        try:
            recorded.update(read(json.loads((art / meta).read_text(encoding="utf-8"))))
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            continue
    for name in names:
        want = recorded.get(name)
        if want is None:
            continue
        h = hashlib.sha256()
        with open(art / name, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
        if h.hexdigest() != want:
            raise ExportChanged(
                f"{art / name}: sha256 differs from the export's record: expected {want}, the file has "
                f"{h.hexdigest()}; it changed after it was exported (corrupt or edited): copy the export "
                "again, or rebuild it with `msllm export`"
            )


def generate_text(artifact: str | Path, prompt: str, max_new_tokens: int = 64, **kwargs) -> str:
    """The completion of `prompt` by an export artifact (model.onnx + tokenizer.model or tokenizer.json); greedy by
    default. Keyword arguments go to `OnnxGenerator.generate` (temperature, top_k, top_p, seed, stop).
    """
    art = Path(artifact)
    check_export(art)
    sp = load_tokenizer(art)
    ids = encode_prompt(sp, prompt)
    new = OnnxGenerator(art / "model.onnx").generate(ids, max_new_tokens, eos_id=sp.eos_id(), **kwargs)
    return decode_completion(sp, ids, new)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="completions from an export artifact, with onnxruntime only (KV cache)")
    ap.add_argument("artifact", help="export artifact directory (model.onnx + tokenizer.model or tokenizer.json)")
    ap.add_argument("prompts", nargs="+")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    art = Path(a.artifact)
    if not (art / "model.onnx").is_file() or not (
        (art / "tokenizer.model").is_file() or (art / "tokenizer.json").is_file()
    ):
        print(
            f"error: {art}: no model.onnx and tokenizer (tokenizer.model or tokenizer.json); pass an export "
            "artifact directory "
            "(the path `msllm export` prints)",
            file=sys.stderr,
        )
        return 2
    try:
        check_export(art)
    except ExportChanged as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for p in a.prompts:
        print(
            p
            + generate_text(
                art, p, a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
