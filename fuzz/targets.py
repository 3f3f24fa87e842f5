"""The fuzz targets: one reader of untrusted bytes each, its input strategy, and the errors its contract allows.

A target's `run(data, tmp)` feeds one generated input to the reader (writing it under `tmp` when the reader takes a
path); the runner (fuzz/__main__.py) calls it and holds the contract: it returns, or raises one of `allowed` (the
project's own error for that reader: the one line a user sees), within SECONDS_PER_INPUT; anything else (another
exception, a hang, a crash of the process, a MemoryError under the runner's RLIMIT_AS) is a finding.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from fuzz.seeds import REPO, seeds

SECONDS_PER_INPUT = 5.0
"""A generous bound on one input on a loaded 2-core machine: every reader here takes milliseconds on a valid one."""

# values a claimed count or length takes when crafted: the edges of 8/16/32/64-bit fields and "a billion"
BIG = [0, 1, 2, 127, 128, 255, 256, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 10**9, 2**63 - 1, 2**64 - 1]


@dataclass(frozen=True)
class Target:
    name: str
    strategy: Callable[[], st.SearchStrategy]
    run: Callable[[Any, Path], Any]
    allowed: Callable[[], tuple[type[BaseException], ...]]
    what: str
    covers: tuple[str, ...] = ()
    """The reader's code whose line coverage `--coverage` reports: `path` (the whole module) or `path:f,g` (those
    top-level functions or classes only: the module holds other code the target does not read through)."""


# ----------------------------------------------------------------------------- input strategies


@st.composite
def mutated(draw, seed: bytes, max_edits: int = 8) -> bytes:
    """`seed` with up to `max_edits` edits: a byte range overwritten, inserted or deleted, a little-endian integer
    from BIG written over 4 or 8 bytes (the claimed counts and lengths of binary headers), or cut short."""
    data = bytearray(seed)
    for _ in range(draw(st.integers(0, max_edits))):
        if not data:
            break
        pos = draw(st.integers(0, len(data) - 1))
        op = draw(st.sampled_from(["set", "insert", "delete", "int32", "int64", "dup"]))
        if op == "set":
            chunk = draw(st.binary(min_size=1, max_size=8))
            data[pos : pos + len(chunk)] = chunk
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[pos : pos + draw(st.integers(1, 16))]
        elif op == "dup":  # a slice repeated: repeated keys, tensors, entries
            n = draw(st.integers(1, 64))
            data[pos:pos] = data[pos : pos + n] * draw(st.integers(1, 4))
        else:
            width = 4 if op == "int32" else 8
            value = draw(st.sampled_from(BIG)) % (1 << (8 * width))
            data[pos : pos + width] = value.to_bytes(width, "little")
    if draw(st.booleans()) and data:
        del data[draw(st.integers(0, len(data))) :]
    return bytes(data)


@st.composite
def mutated_text(draw, seed: str, max_edits: int = 6) -> str:
    """`seed` with up to `max_edits` text edits (random text inserted or overwritten, spans deleted or repeated)."""
    text = seed
    for _ in range(draw(st.integers(0, max_edits))):
        pos = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(["insert", "delete", "replace", "dup"]))
        piece = draw(st.text(max_size=12))
        if op == "insert":
            text = text[:pos] + piece + text[pos:]
        elif op == "delete":
            text = text[:pos] + text[pos + draw(st.integers(1, 40)) :]
        elif op == "replace":
            text = text[:pos] + piece + text[pos + len(piece) :]
        else:
            text = text[:pos] + text[pos : pos + draw(st.integers(1, 80))] * draw(st.integers(1, 5)) + text[pos:]
    return text


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from(BIG)
    | st.floats()
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)


# ----------------------------------------------------------------------------- the targets


def _gguf(data: bytes, tmp: Path):
    from model.gguf import read_gguf, read_metadata

    path = tmp / "m.gguf"
    path.write_bytes(data)
    return read_gguf(path, read_metadata(path))


def _gguf_allowed():
    from model.gguf import GGUFError

    return (GGUFError,)


HF_KEYS = {
    "vocab_size": 300,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
}


@st.composite
def hf_configs(draw) -> dict:
    """A llama config.json: some keys dropped, some given any JSON value, unknown keys added."""
    cfg = {k: v for k, v in HF_KEYS.items() if draw(st.integers(0, 9))}
    for k in draw(st.lists(st.sampled_from(sorted(HF_KEYS) + ["rope_scaling", "head_dim"]), max_size=4)):
        cfg[k] = draw(json_values)
    cfg.update(draw(st.dictionaries(st.text(max_size=10), json_values, max_size=2)))
    return cfg


def _hf_config(cfg: dict, tmp: Path):
    from model.convert import config_from_hf

    return config_from_hf(cfg)


def _hf_config_allowed():
    from model.convert import ConversionError

    return (ConversionError,)


def _tok_strategy():
    d = seeds() / "tok"
    files = {n: (d / n).read_text(encoding="utf-8") for n in ("tokenizer.json", "tokenizer_config.json")}
    return st.tuples(mutated_text(files["tokenizer.json"]), mutated_text(files["tokenizer_config.json"]))


def _tokenizer(files: tuple[str, str], tmp: Path):
    """tokenizer.json + tokenizer_config.json loaded, a text encoded and decoded, the chat template rendered."""
    from tasks.tokenizer import check_chat_template, load_tokenizer

    (tmp / "tokenizer.json").write_text(files[0], encoding="utf-8")
    (tmp / "tokenizer_config.json").write_text(files[1], encoding="utf-8")
    tok = load_tokenizer(tmp)
    ids = tok.encode("ROMEO: But soft, what light 12 ✓")
    tok.decode(ids)
    check_chat_template(tok)
    return tok


def _tokenizer_allowed():
    from tasks.tokenizer_error import TokenizerError

    return (TokenizerError,)


TEMPLATE_PARTS = [
    "{% for m in messages %}",
    "{% endfor %}",
    "{{ m['role'] }}",
    "{{ m.content }}",
    "{% if add_generation_prompt %}",
    "{% endif %}",
    "{{ 'x' * 1000000 }}",
    "{{ messages | tojson(indent=100) }}",
    "{% set ns = namespace(a='') %}",
    "{{ raise_exception('no') }}",
    "{{ '%s' % messages }}",
    "{{ ''.join(['a'] * 99999) }}",
    "{{ (messages * 1000) | length }}",
    "{% for i in range(100000000) %}",
    "{{ bos_token }}",
    "<|im_start|>",
    "{#",
    "{{",
    "}}",
    "{%",
    "%}",
    "\n",
]


@st.composite
def templates(draw):
    parts = draw(st.lists(st.sampled_from(TEMPLATE_PARTS) | st.text(max_size=8), max_size=12))
    msgs = draw(
        st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "assistant", "system", "tool", ""]), "content": st.text(max_size=30)}
            ),
            min_size=1,
            max_size=4,
        )
    )
    return "".join(parts), msgs


def _template(case: tuple[str, list], tmp: Path):
    from tasks.tokenizer import render_template

    return render_template(case[0], case[1], max_chars=20_000, max_chars_why="the fuzz target's cap")


def _pipelines_strategy():
    text = (REPO / "pipelines.yaml").read_text(encoding="utf-8")
    return mutated_text(text, max_edits=4) | st.builds(lambda v: json.dumps({"pipelines": {"p": v}}), json_values)


def _pipelines(text: str, tmp: Path):
    from tasks.config.loader import resolve_pipeline

    path = tmp / "pipelines.yaml"
    path.write_text(text, encoding="utf-8")
    return resolve_pipeline(path, None, [], check_files=False)


def _config_allowed():
    from tasks.config.schema import ConfigError

    return (ConfigError,)


@st.composite
def bodies(draw) -> tuple[bytes, bool]:
    """A request body: a plausible OpenAI body with fields given any JSON value, or raw bytes, for either endpoint."""
    chat = draw(st.booleans())
    if draw(st.integers(0, 4)) == 0:
        return draw(st.binary(max_size=200)), chat
    body: dict[str, Any] = {"model": draw(st.sampled_from(["m", "", "other"]) | json_values)}
    fields = ["prompt", "max_tokens", "temperature", "top_p", "n", "stop", "logprobs", "echo", "seed", "stream"]
    fields += ["messages", "top_logprobs", "max_completion_tokens", "logit_bias", "top_k", "stream_options"]
    for k in draw(st.lists(st.sampled_from(fields), max_size=6)):
        body[k] = draw(json_values)
    if chat and draw(st.booleans()):
        body["messages"] = [{"role": "user", "content": draw(st.text(max_size=40))}]
    elif draw(st.booleans()):
        body["prompt"] = draw(st.text(max_size=40) | st.lists(st.integers(-5, 400), max_size=8))
    return json.dumps(body).encode(), chat


class _Backend:
    """What parse_request reads of a served model: its tokenizer (the seed's tokenizer.json, real), context, vocab."""

    def __init__(self):
        from tasks.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(seeds() / "tok")
        self.context_length = 64
        self.vocab_size = self.tokenizer.vocab_size
        self.prompt_style = "chat_template"


_BACKEND: list[_Backend] = []


def _request(case: tuple[bytes, bool], tmp: Path):
    from tasks.serving.bodies import decode_json
    from tasks.serving.parsing import parse_request

    if not _BACKEND:
        _BACKEND.append(_Backend())
    body = decode_json(case[0])
    return parse_request(body, chat=case[1], model_id="m", backend=_BACKEND[0], max_jobs=8)


def _request_allowed():
    from tasks.serving.requests import ApiError

    return (ApiError,)


def _safetensors(data: bytes, tmp: Path):
    from tasks.store.tensors import read_tensors

    path = tmp / "model.safetensors"
    path.write_bytes(data)
    return read_tensors(path, "the fuzz target's fix")


def _safetensors_allowed():
    from tasks.store.tensors import CheckpointError

    return (CheckpointError,)


def _artifact_strategy():
    from fuzz.seeds import model_artifact

    art = model_artifact()
    info, manifest = (art / "model.json").read_text(), (art / "manifest.json").read_text()
    # model.json edited (re-signed in the manifest, or not), or the manifest edited
    return st.tuples(mutated_text(info), st.booleans(), st.none() | mutated_text(manifest, max_edits=3))


def _model_artifact(case: tuple[str, bool, str | None], tmp: Path):
    """A model artifact with its model.json (re-signed or not) or its manifest edited: verified, read, its config
    built and its weights loaded, as every loader of a model artifact does before building a network."""
    import hashlib
    import shutil

    from fuzz.seeds import model_artifact
    from tasks.store.artifacts import ArtifactStore
    from tasks.store.model_artifact import model_config, read_info
    from tasks.store.tensors import load_weights

    info, resign, manifest = case
    art = tmp / "store" / "pretrain" / model_artifact().name
    shutil.copytree(model_artifact(), art)
    (art / "model.json").write_text(info, encoding="utf-8")
    if manifest is not None:
        (art / "manifest.json").write_text(manifest, encoding="utf-8")
    elif resign:  # the file's sha256 and size rewritten in the manifest: the edit passes the digest check
        m = json.loads((art / "manifest.json").read_text())
        for f in m["files"]:
            if f["path"] == "model.json":
                f.update(sha256=hashlib.sha256(info.encode()).hexdigest(), size=len(info.encode()))
        (art / "manifest.json").write_text(json.dumps(m))
    ArtifactStore(tmp / "store").verify(art)
    read_info(art)
    model_config(art)
    return load_weights(art)


def _artifact_allowed():
    from tasks.store.errors import ArtifactError
    from tasks.store.tensors import CheckpointError

    return (ArtifactError, CheckpointError)


def _bytes_of(name: str) -> Callable[[], st.SearchStrategy]:
    return lambda: mutated((seeds() / name).read_bytes())


TARGETS = {
    t.name: t
    for t in [
        Target(
            "gguf",
            _bytes_of("model.gguf"),
            _gguf,
            _gguf_allowed,
            "model/gguf.py read_metadata + read_gguf",
            (
                "model/gguf_header.py",
                "model/gguf.py:_pairs,_unpermute,read_metadata,_undecodable,_check_layout,_f32,config_from_meta,"
                "_short,tokenizer_problem,read_gguf,_shape_table",
            ),
        ),
        Target(
            "hf_config",
            hf_configs,
            _hf_config,
            _hf_config_allowed,
            "model/convert.py config_from_hf",
            ("model/convert.py:_rope_theta,_short,_positive_int,_positive_float,_flag,config_from_hf",),
        ),
        Target(
            "tokenizer",
            _tok_strategy,
            _tokenizer,
            _tokenizer_allowed,
            "tasks/tokenizer.py load, encode, template",
            (
                "tasks/tokenizer.py:load_tokenizer,Tokenizer,SentencePieceTokenizer,_json_kind,_token_text,"
                "_bytes_to_unicode,HFTokenizer,render_template,check_chat_template",
            ),
        ),
        Target(
            "chat_template",
            templates,
            _template,
            _tokenizer_allowed,
            "tasks/chat_template render_chat_template",
            ("tasks/chat_template/__init__.py", "tasks/chat_template/sizes.py"),
        ),
        Target(
            "pipelines",
            _pipelines_strategy,
            _pipelines,
            _config_allowed,
            "tasks/config/loader.py resolve_pipeline",
            ("tasks/config/yaml12.py", "tasks/config/loader.py", "tasks/config/rules.py", "tasks/config/schema.py"),
        ),
        Target(
            "request",
            bodies,
            _request,
            _request_allowed,
            "tasks/serving bodies.decode_json + parse_request",
            ("tasks/serving/bodies.py", "tasks/serving/parsing.py", "tasks/serving/requests.py"),
        ),
        Target(
            "model_artifact",
            _artifact_strategy,
            _model_artifact,
            _artifact_allowed,
            "tasks/store: manifest verify, model.json, config, weights",
            (
                "tasks/store/artifacts.py:ArtifactStore.verify",
                "tasks/store/model_artifact.py:read_info,model_config",
                "tasks/store/tensors.py:read_tensors,load_weights,check_finite",
            ),
        ),
        Target(
            "safetensors",
            _bytes_of("model.safetensors"),
            _safetensors,
            _safetensors_allowed,
            "tasks/store/tensors.py read_tensors",
            ("tasks/store/tensors.py:read_tensors",),
        ),
    ]
}
