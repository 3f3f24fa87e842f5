"""One tokenizer interface, two backends: SentencePiece (`tokenizer.model`) and Hugging Face `tokenizers`
(`tokenizer.json`, byte-level BPE as Llama 3, SmolLM and Qwen ship it). Every stage and the server use this
module; none imports sentencepiece or tokenizers directly.

    tok = load_tokenizer(artifact_dir)        # whichever files the directory holds
    ids = tok.encode("text")                  # the text's ids, no special tokens
    ids = tok.prompt_ids("text")              # how a document starts: see below
    tok.decode(ids); tok.vocab_size; tok.bos_id(); tok.eos_id(); tok.pad_id(); tok.unk_id()
    tok.sha256                                # over the tokenizer files' bytes (what keys and checks compare)
    tok.chat_template; tok.render_chat(messages, add_generation_prompt=True)
    copy_tokenizer_files(src_dir, dst_dir)    # what a model artifact keeps

Ids are -1 where the tokenizer has no such token (as SentencePiece reports them). Special ids of a
`tokenizer.json` come from its `tokenizer_config.json` (`bos_token`, `eos_token`, `pad_token`, `unk_token`),
never from guesses.

Where a document starts (`prompt_ids`, and the data stage's packing): a SentencePiece model trained here
sees documents as `ids + [eos]` concatenated, so a prompt is `[eos] + ids`. A `tokenizer.json` model is
conditioned the way its own tokenizer does it (`encode(text, add_special_tokens=True)`: a BOS where its
post-processor adds one, nothing for SmolLM2), which is what transformers and lm-eval's `hf` model do.

The backends, the chat-template sandbox (Jinja) and the GGUF reader load on first use (lazy): stages import this.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from model.runtime import trim_heap
from tasks.tokenizer_error import TokenizerError

SP_FILE = "tokenizer.model"
HF_FILE = "tokenizer.json"
HF_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# Every file a tokenizer may consist of, in the order they are hashed; a model artifact keeps those present.
TOKENIZER_FILES = (SP_FILE, HF_FILE, HF_CONFIG, CHAT_TEMPLATE_FILE, "special_tokens_map.json")


def tokenizer_files(directory: str | Path) -> list[Path]:
    """The tokenizer files a directory holds: its tokenizer.model when it has one (the original where a directory
    also holds a tokenizer.json converted from it, as an export does), else tokenizer.json and its companions."""
    d = Path(directory)
    if (d / SP_FILE).is_file():
        return [d / SP_FILE]
    if (d / HF_FILE).is_file():
        return [d / f for f in TOKENIZER_FILES if f != SP_FILE and (d / f).is_file()]
    return []


def files_sha256(files: Iterable[Path]) -> str:
    """One digest over (name, bytes) of each file: the tokenizer's identity."""
    h = hashlib.sha256()
    for f in files:
        data = Path(f).read_bytes()
        h.update(f"{Path(f).name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the tokenizer files of `src` (a directory) into `dst`; returns their names."""
    files = tokenizer_files(src)
    if not files:
        raise TokenizerError(f"{src}: no {SP_FILE} or {HF_FILE}")
    for f in files:
        shutil.copy2(f, Path(dst) / f.name)
    return [f.name for f in files]


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a directory (its tokenizer.model, else its tokenizer.json), or of one file."""
    p = Path(path)
    if p.is_dir():
        files = tokenizer_files(p)
        if not files:
            raise TokenizerError(
                f"{p}: no {HF_FILE} or {SP_FILE}; pass a model, data or export artifact "
                "(or a directory with the model's tokenizer files)"
            )
        return HFTokenizer(p / HF_FILE) if files[0].name == HF_FILE else SentencePieceTokenizer(p / SP_FILE)
    if not p.is_file():
        raise TokenizerError(f"{p}: tokenizer file not found")
    if p.name.endswith(".json"):
        return HFTokenizer(p)
    return SentencePieceTokenizer(p)


class Tokenizer:
    """The interface. Backends set `kind`, `files` and implement the abstract methods."""

    kind = "?"
    files: list[Path]

    # ---- ids
    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def prompt_ids(self, text: str) -> list[int]:
        raise NotImplementedError

    def id_to_piece(self, i: int) -> str:
        raise NotImplementedError

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes each id stands for in decoded text (special/control tokens 0): bits per byte."""
        raise NotImplementedError

    # ---- special tokens (-1: none)
    def bos_id(self) -> int:
        return self._special["bos"]

    def eos_id(self) -> int:
        return self._special["eos"]

    def pad_id(self) -> int:
        return self._special["pad"]

    def unk_id(self) -> int:
        return self._special["unk"]

    def pad_fill_id(self) -> int:
        """What padding positions hold: pad, else EOS."""
        return self.pad_id() if self.pad_id() >= 0 else self.eos_id()

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def get_piece_size(self) -> int:
        return self.vocab_size

    _special: dict[str, int]

    # ---- identity
    @cached_property
    def sha256(self) -> str:
        return files_sha256(self.files)

    @property
    def chat_template(self) -> str | None:
        return None

    def info(self) -> dict[str, Any]:
        """What model.json records about the tokenizer (ids, size, files, digest)."""
        return {
            "type": self.kind,
            "files": [f.name for f in self.files],
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id(),
            "eos_id": self.eos_id(),
            "pad_id": self.pad_id(),
            "unk_id": self.unk_id(),
            "pad_fill_id": self.pad_fill_id(),
            "chat_template": self.chat_template is not None,
            "sha256": self.sha256,
        }

    # ---- chat
    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True, **limits: Any) -> str:
        """The conversation rendered with the tokenizer's chat template (TokenizerError when it has none or
        the template fails to render or passes a limit; `limits`: `tasks.chat_template.render_chat_template`'s)."""
        if self.chat_template is None:
            raise TokenizerError(f"{self.files[0]}: the tokenizer has no chat template")
        return render_template(
            self.chat_template,
            messages,
            add_generation_prompt,
            bos_token=self._piece_or_empty(self.bos_id()),
            eos_token=self._piece_or_empty(self.eos_id()),
            where=str(self.files[0].parent),
            **limits,
        )

    def _piece_or_empty(self, i: int) -> str:
        return self.id_to_piece(i) if i >= 0 else ""


# ----------------------------------------------------------------------------- SentencePiece


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, path: Path):
        import sentencepiece as spm

        self.path = Path(path)
        self.files = [self.path]
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(self.path))
        except (RuntimeError, OSError) as exc:
            raise TokenizerError(
                f"{self.path}: not a SentencePiece model ({exc}); point at a tokenizer.model"
            ) from None
        sp = self.sp
        self._special = {"bos": sp.bos_id(), "eos": sp.eos_id(), "pad": sp.pad_id(), "unk": sp.unk_id()}

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.sp.encode(list(texts), num_threads=1) if texts else []

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def prompt_ids(self, text: str) -> list[int]:
        return [self.eos_id()] + self.encode(text)

    def id_to_piece(self, i: int) -> str:
        return self.sp.id_to_piece(int(i))

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def token_bytes(self) -> np.ndarray:
        sp, n = self.sp, self.vocab_size
        out = np.zeros(n, np.int64)
        for i in range(n):
            if sp.is_control(i) or sp.is_unknown(i):
                continue
            out[i] = 1 if sp.is_byte(i) else len(sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))
        return out

    def model_proto(self) -> dict[str, Any]:
        """Training details of the model (type, byte fallback, normalisation) for the data stage's record."""
        from sentencepiece import sentencepiece_model_pb2 as pb

        proto = pb.ModelProto()
        proto.ParseFromString(self.path.read_bytes())
        ts, ns = proto.trainer_spec, proto.normalizer_spec
        return {
            "model_type": pb.TrainerSpec.ModelType.Name(ts.model_type).lower(),
            "byte_fallback": ts.byte_fallback,
            "add_dummy_prefix": ns.add_dummy_prefix,
            "normalization": ns.name,
            "character_coverage": round(ts.character_coverage, 6),
        }


# ----------------------------------------------------------------------------- tokenizer.json


def _json_kind(value: Any) -> str:
    return {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}.get(type(value), "null")


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the alphabet of byte-level BPE)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


BYTE_ENCODER = _bytes_to_unicode()
BYTE_DECODER = {c: b for b, c in BYTE_ENCODER.items()}


class HFTokenizer(Tokenizer):
    kind = "hf"

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _Tok

        self.path = Path(path)
        d = self.path.parent
        self.files = (
            [d / f for f in TOKENIZER_FILES if f != SP_FILE and (d / f).is_file()]
            if self.path.name == HF_FILE
            else [self.path]
        )
        try:
            self.tok = _Tok.from_file(str(self.path))
        except Exception as exc:  # tokenizers raises a bare Exception on a bad file
            raise TokenizerError(
                f"{self.path}: not a Hugging Face tokenizer.json ({str(exc)[:200]}); "
                "re-save the tokenizer with transformers or tokenizers"
            ) from None
        trim_heap()  # its JSON parse's ~25 MB of freed buffers (SmolLM2's file) back to the OS, not kept resident
        cfg_path = d / HF_CONFIG
        try:
            self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        except json.JSONDecodeError as exc:
            raise TokenizerError(f"{cfg_path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(self.config, dict):
            raise TokenizerError(
                f"{cfg_path}: holds a JSON {_json_kind(self.config)}, not an object; it should map "
                "bos_token, eos_token, chat_template, ... to values: re-save the tokenizer"
            )
        self._special = {}
        for name in ("bos", "eos", "pad", "unk"):
            text = _token_text(self.config.get(f"{name}_token"))
            i = self.tok.token_to_id(text) if text is not None else None
            if text is not None and i is None:
                raise TokenizerError(f"{cfg_path}: {name}_token {text!r} is not in {self.path.name}'s vocabulary")
            self._special[name] = -1 if i is None else int(i)
        tmpl_file = d / CHAT_TEMPLATE_FILE
        tmpl = tmpl_file.read_text() if tmpl_file.is_file() else self.config.get("chat_template")
        if isinstance(tmpl, list):  # [{name, template}, ...]: the default one
            tmpl = next((t.get("template") for t in tmpl if isinstance(t, dict) and t.get("name") == "default"), None)
        self._chat_template = tmpl if isinstance(tmpl, str) and tmpl.strip() else None

    def _encode(self, text: str, add_special_tokens: bool = False):
        # One text through `encode_batch`: the same Encoding as `encode`, but tokenizers' binding releases the GIL
        # in encode_batch and holds it for all of `encode`, so other threads (the server's event loop while a
        # worker thread tokenizes a 2 MB prompt: 3 s) would stop. ~8 µs more a call.
        return self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def encode(self, text: str) -> list[int]:
        return self._encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)] if texts else []

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        e = self._encode(text)
        return e.ids, e.offsets

    def encode_own(self, text: str) -> list[int]:
        """The ids with the tokenizer's own special tokens (its post-processor), as transformers encodes."""
        return self._encode(text, add_special_tokens=True).ids

    def prompt_ids(self, text: str) -> list[int]:
        return self.encode_own(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def id_to_piece(self, i: int) -> str:
        return self.tok.id_to_token(int(i)) or ""

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def _byte_level(self) -> bool:
        dec = json.loads(self.tok.to_str()).get("decoder") or {}
        kinds = {dec.get("type")} | {d.get("type") for d in dec.get("decoders", []) or []}
        return "ByteLevel" in kinds

    def token_bytes(self) -> np.ndarray:
        n = self.vocab_size
        out = np.zeros(n, np.int64)
        special = {t.content for t in self.tok.get_added_tokens_decoder().values() if t.special}
        byte_level = self._byte_level()
        for i in range(n):
            piece = self.tok.id_to_token(i)
            if piece is None or piece in special:
                continue
            if byte_level:
                out[i] = sum(1 if c in BYTE_DECODER else len(c.encode("utf-8")) for c in piece)
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                out[i] = 1
            else:
                out[i] = len(piece.replace("\u2581", " ").encode("utf-8"))
        return out


# ----------------------------------------------------------------------------- chat templates


def render_template(
    template: str,
    messages: list[dict[str, str]],
    add_generation_prompt: bool = True,
    where: str = "chat template",
    **extra: Any,
) -> str:
    """Render a Hugging Face chat template (Jinja, sandboxed, as transformers renders it), within a time and a size
    limit (`tasks.chat_template.render_chat_template`, which takes `max_chars`, `max_chars_why` and `seconds` too)."""
    from tasks.chat_template import render_chat_template

    return render_chat_template(template, messages, add_generation_prompt, where, **extra)


def check_chat_template(tok: Tokenizer) -> None:
    """Render a two-turn conversation once: a template that cannot render, or passes the time or size limit of a
    rendering (tasks.chat_template), fails here, not at serve time."""
    if tok.chat_template is None:
        return
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "v"},
    ]
    tok.render_chat(msgs, add_generation_prompt=True)


# ----------------------------------------------------------------------------- tokenizer.json from GGUF metadata

# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) whose split is GPT-2's regex after digits are split one
# by one (llama-vocab.cpp), and those that are GPT-2's regex alone.
_PRE_DIGITS = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_PRE_GPT2 = {"gpt-2", "gpt2", "default", "mpt", "olmo", "jais", "trillion"}
_GGUF_CONTROL = 3  # tokenizer.ggml.token_type: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte


def hf_files_from_gguf(meta: dict[str, Any], where: str) -> dict[str, Any]:
    """(tokenizer.json, tokenizer_config.json) contents from a GGUF's tokenizer.ggml.* metadata (byte-level BPE).

    Raises TokenizerError naming the model or pre-tokenizer type when it is one this does not rebuild.
    """
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        what = " (a SentencePiece vocabulary)" if model == "llama" else ""
        raise TokenizerError(
            f"{where}: tokenizer.ggml.model={model!r}{what}; GGUF import rebuilds byte-level BPE "
            "('gpt2') tokenizers only: convert the model's Hugging Face directory (with its "
            "tokenizer.model or tokenizer.json) with --from-hf instead"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_DIGITS | _PRE_GPT2:
        raise TokenizerError(
            f"{where}: tokenizer.ggml.pre={pre!r} is not a pre-tokenizer this converts "
            f"(known: {', '.join(sorted(_PRE_DIGITS | _PRE_GPT2))}); convert the Hugging Face "
            "directory with --from-hf instead"
        )
    from model.gguf import tokenizer_problem

    if problem := tokenizer_problem(meta, where):  # one line naming the key, not a KeyError / IndexError
        raise TokenizerError(problem)
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = list(meta.get("tokenizer.ggml.merges") or [])
    added = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, (t, k) in enumerate(zip(tokens, types))
        if k == _GGUF_CONTROL
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    pre_tok = (
        {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level]}
        if pre in _PRE_DIGITS
        else byte_level
    )
    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": pre_tok,
        "post_processor": {**byte_level, "trim_offsets": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": [m.split(" ", 1) for m in merges],
        },
    }
    if meta.get("tokenizer.ggml.add_bos_token") and meta.get("tokenizer.ggml.bos_token_id") is not None:
        bos = tokens[int(meta["tokenizer.ggml.bos_token_id"])]
        bid = int(meta["tokenizer.ggml.bos_token_id"])
        tokenizer_json["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": bos, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": bos, "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos: {"id": bos, "ids": [bid], "tokens": [bos]}},
        }

    def tok_for(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "model_max_length": int(meta.get("llama.context_length", 2048)),
        "bos_token": tok_for("bos"),
        "eos_token": tok_for("eos"),
        "unk_token": tok_for("unknown"),
        "pad_token": tok_for("padding"),
    }
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return {HF_FILE: tokenizer_json, HF_CONFIG: config}
