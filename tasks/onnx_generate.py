"""Greedy text generation from an exported ONNX model with onnxruntime alone (no MindSpore).

Imports only numpy, onnxruntime and sentencepiece, so it runs where MindSpore is not
installed; the export stage copies this file into its artifact as `onnx_generate.py`.

    gen = OnnxGenerator("artifacts/export/<key>/model.onnx")
    new_ids = gen.generate(prompt_ids, max_new_tokens=32, eos_id=sp.eos_id())
    text = decode_completion(sp, prompt_ids, new_ids)
    text = generate_text("artifacts/export/<key>", "ROMEO:", max_new_tokens=32)

    python -m tasks.onnx_generate artifacts/export/<key> "ROMEO:" [--max-new-tokens 32]

The ONNX model has a fixed input shape [batch, seq_len] (MindSpore 2.10 cannot export
this model with dynamic ONNX axes): input `input_ids` int32, output `logits` float32
[batch, seq_len, vocab]. A shorter sequence is right-padded and the next token is read
at its last real position: attention is causal, so the logits at position t never depend
on the padding after it. With no KV cache each new token costs one full forward. The
window semantics match `model.generate.Generator(net, max_len=seq_len)`: the prompt keeps
its last seq_len - 1 tokens and generation stops when the sequence fills the window, so
both produce the same greedy tokens.

Prompts are encoded as in pretraining and evaluation: [eos_id] + sentencepiece ids (the
data stage ends every document with EOS, so EOS marks the start of a new one).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import numpy as np
import onnxruntime as ort

# The README's few-line example (the export stage also writes it into MODEL_CARD.md, and a
# test runs it in a fresh interpreter). ART is the export artifact directory.
SNIPPET = '''\
import numpy as np, onnxruntime as ort, sentencepiece as spm

sess = ort.InferenceSession(f"{ART}/model.onnx")
sp = spm.SentencePieceProcessor(model_file=f"{ART}/tokenizer.model")
batch, seq_len = sess.get_inputs()[0].shape          # fixed export shape
ids = [sp.eos_id()] + sp.encode("ROMEO:")            # EOS starts a document, as in training
while len(ids) < seq_len:
    x = np.zeros((batch, seq_len), np.int32)         # right-padded: causal attention ignores
    x[0, :len(ids)] = ids                            # everything after the last real token
    logits = sess.run(["logits"], {"input_ids": x})[0]
    next_id = int(logits[0, len(ids) - 1].argmax())  # greedy, at the last real position
    if next_id == sp.eos_id():
        break
    ids.append(next_id)
print(sp.decode(ids[1:]))
'''


class OnnxGenerator:
    """Greedy decoding over a fixed-shape ONNX causal LM (input `input_ids` [B, T] -> `logits` [B, T, V])."""

    def __init__(self, model_path: str | Path, threads: int | None = None):
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])
        inp = self.session.get_inputs()[0]
        self.input_name = inp.name
        self.output_name = self.session.get_outputs()[0].name
        if len(inp.shape) != 2 or not all(isinstance(d, int) for d in inp.shape):
            raise ValueError(f"{model_path}: expected a fixed [batch, seq_len] input, got {inp.shape}")
        self.batch_size, self.seq_length = inp.shape

    def logits(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        """Logits [len(rows), T, V] of token rows (each at most T long, right-padded with 0)."""
        b, t = self.batch_size, self.seq_length
        out = []
        for start in range(0, len(rows), b):
            x = np.zeros((b, t), np.int32)
            chunk = rows[start:start + b]
            for i, r in enumerate(chunk):
                if len(r) > t:
                    raise ValueError(f"a row of {len(r)} tokens does not fit the exported length {t}")
                x[i, :len(r)] = r
            out.append(self.session.run([self.output_name], {self.input_name: x})[0][:len(chunk)])
        return np.concatenate(out, axis=0)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int = 64, eos_id: int | None = None) -> list[int]:
        """Greedy new token ids after prompt_ids (prompt excluded; eos_id included when it ends the text)."""
        if not len(prompt_ids):
            raise ValueError("generate: the prompt is empty; pass at least one token id (e.g. EOS)")
        t = self.seq_length
        seq = [int(i) for i in prompt_ids][-(t - 1):] if t > 1 else [int(prompt_ids[-1])]
        budget = min(max_new_tokens, t - len(seq))
        x = np.zeros((self.batch_size, t), np.int32)
        new: list[int] = []
        while len(new) < budget:
            n = len(seq)
            x[0, :n] = seq
            logits = self.session.run([self.output_name], {self.input_name: x})[0]  # [B, T, V]
            tok = int(np.argmax(logits[0, n - 1]))
            new.append(tok)
            if tok == eos_id:
                break
            seq.append(tok)
        return new


def encode_prompt(sp, text: str) -> list[int]:
    """[eos_id] + sentencepiece ids: how pretraining and evaluation see the start of a document."""
    return [sp.eos_id()] + sp.encode(text)


def generate_text(artifact: str | Path, prompt: str, max_new_tokens: int = 64) -> str:
    """Greedy completion of `prompt` by an export artifact (model.onnx + tokenizer.model)."""
    import sentencepiece as spm

    art = Path(artifact)
    sp = spm.SentencePieceProcessor(model_file=str(art / "tokenizer.model"))
    ids = encode_prompt(sp, prompt)
    return decode_completion(sp, ids, OnnxGenerator(art / "model.onnx").generate(ids, max_new_tokens, sp.eos_id()))


def decode_completion(sp, prompt_ids: Sequence[int], new_ids: Sequence[int]) -> str:
    """The text of new_ids after prompt_ids, EOS dropped. Decoded together with the prompt: decoded
    alone, a completion would lose its leading space."""
    eos = sp.eos_id()
    head = [int(t) for t in prompt_ids if t != eos]
    new = [int(t) for t in new_ids if t != eos]
    prefix, full = sp.decode(head), sp.decode(head + new)
    return full[len(prefix):] if full.startswith(prefix) else sp.decode(new)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="greedy completions from an export artifact, with onnxruntime only")
    ap.add_argument("artifact", help="export artifact directory (model.onnx + tokenizer.model)")
    ap.add_argument("prompts", nargs="+")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    a = ap.parse_args(argv)
    for p in a.prompts:
        print(p + generate_text(a.artifact, p, a.max_new_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
