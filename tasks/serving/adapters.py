"""LoRA adapters beside their base: `msllm serve BASE --adapter name=FINETUNE ...` (vLLM's multi-LoRA shape).

    specs = [parse_adapter_flag("sonnets=artifacts/finetune/ab12"), ...]     # argparse type of --adapter
    adapters = check_adapters(base, specs, base_id="pretrain/9f3c")         # every check, nothing loaded
    a.mode(kind)                                                            # "unmerged" or "merged"
    dirs = {a.name: a.model_dir(kind, base, tmp) for a in adapters if a.mode(kind) == "merged"}

How an adapter is served (`adapter_mode` in /v1/models), decided in one place, `Adapter.mode`:
  - "unmerged": a LoRA adapter over a model artifact BASE (MindSpore). One network holds the base
    weights once; per adapter only its A and scaling·B (adapter.safetensors, adapter.json `scaling`),
    put into the network's LoRA layers before each call of one of its sequences
    (`tasks.serving.backends.MindSporeBackend(base, adapters=...)`, `model.lora.LoRASlots`): many
    adapters cost their A/B alone. The engine decodes MindSpore sequences one call at a time, so one
    adapter in place per call is exact per sequence.
  - "merged": an export BASE (onnxruntime, whose exported graph has no LoRA inputs), or a full
    finetune (no A/B to apply) over a model artifact. The finetune stage's own `merge` folds the
    finetune artifact into the base weights (a `merged` artifact in the finetune artifact's store,
    cached by content, the same one `msllm finetune` prints), and the engine runs it as one more backend
    beside the base, in the same worker thread and queue: every such adapter costs a full copy of the
    weights.

On an export BASE, the merged weights
are written as the same KV-cache ONNX decoder the export stage writes (`tasks.deploy.formats.export_onnx`,
with the base export's ONNX metadata and tokenizer) into a temporary directory that lives as long as the
server, by a child process (merging imports MindSpore; the server itself stays on onnxruntime alone). That
directory is not a published artifact: the export stage's parity checks have not run on it (run `msllm
export` on the merged artifact for those, and serve that export as a BASE of its own).

Checks, all before anything is loaded (ValueError naming `--adapter` and the fix): the flag's
`name=PATH` shape, a name that is a safe model id and directory name (`check_name`: letters, digits, '-', '_'
and '.', not starting with '.', at most 255 characters; no '/', '..' or absolute path, so `tmp / name` is a
directory the server owns), names unique and not the base's id, PATH a finetune artifact (adapter.json and a
manifest), and its base (adapter.json `base`: stage, key, digest) the model artifact BASE is, or,
for an export, the model artifact the export was made from (its manifest's first input).

The CLI imports this module (`parse_adapter_flag`), so NumPy, MindSpore and onnx load inside the functions that
need them (lazy: tasks.modeling.merge, tasks.serving.backends, the ONNX writer).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.store.artifacts import ArtifactStore
from tasks.store.errors import ArtifactError

FLAG = "--adapter"
REPO = Path(__file__).resolve().parents[2]
# An adapter's name is the `model` clients send and, on an export base, the name of its directory in the server's
# temporary directory: the characters of vLLM/OpenAI model names that are safe as one path component anywhere,
# not starting with '.' (no '.', '..' or hidden file), at most NAME_MAX (255) bytes.
NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,254}")


@dataclass(frozen=True)
class AdapterSpec:
    """One `--adapter name=PATH` as given: PATH is a directory or a store reference (`finetune/<key>`, a key prefix)."""

    name: str
    ref: str


def parse_adapter_flag(text: str) -> AdapterSpec:
    """`name=PATH` -> AdapterSpec; ValueError saying the shape (argparse turns it into a usage error)."""
    name, sep, ref = text.partition("=")
    name, ref = name.strip(), ref.strip()
    if not sep or not name or not ref:
        raise ValueError(
            f"{FLAG} {text!r}: expected NAME=FINETUNE_ARTIFACT, e.g. {FLAG} sonnets=artifacts/finetune/<key>"
        )
    if any(c.isspace() for c in name):
        raise ValueError(
            f"{FLAG} {text!r}: the name {name!r} has whitespace; clients send it as `model`, pick one without"
        )
    check_name(name, f"{FLAG} {text!r}")
    return AdapterSpec(name, ref)


def check_name(name: str, where: str) -> None:
    """ValueError naming the flag unless `name` is a safe model id and a single directory name (NAME)."""
    if NAME.fullmatch(name):
        return
    why = (
        "is a path (it has '/'); the name is a model id, not where the adapter is"
        if "/" in name or "\\" in name
        else "starts with '.'"
        if name.startswith(".")
        else f"is {len(name)} characters long, more than 255"
        if len(name) > 255 and NAME.fullmatch(name[:255])
        else "has characters other than letters, digits, '-', '_' and '.'"
    )
    raise ValueError(
        f"{where}: the adapter name {name!r} {why}; name it with letters, digits, '-', '_' and '.' "
        f"(not starting with '.', at most 255 characters), e.g. {FLAG} sonnets=artifacts/finetune/<key>"
    )


@dataclass(frozen=True)
class Adapter:
    """A checked adapter: its served name, finetune artifact, and what adapter.json says about it."""

    name: str
    finetune: Path
    method: str  # "lora" or "full"
    base_key: str  # stage/key of the model artifact it was trained on

    @property
    def finetune_id(self) -> str:
        return f"{self.finetune.parent.name}/{self.finetune.name}"

    def mode(self, base_kind: str) -> str:
        """ "unmerged" (a LoRA adapter over a model artifact: applied per sequence on the one base network) or
        "merged" (an export base, or a full finetune: a full copy of the weights); see the module docstring."""
        return "unmerged" if base_kind == "model" and self.method == "lora" else "merged"

    def merged(self) -> Path:
        """The merged model artifact (tasks.modeling.merge, cached in the finetune artifact's store)."""
        from tasks.modeling.merge import merge

        return merge(ArtifactStore(self.finetune.parent.parent), self.finetune)

    def model_dir(self, base_kind: str, base: Path, tmp: Path) -> Path:
        """What a backend of `base_kind` loads for this adapter: the merged artifact (MindSpore), or an ONNX
        export of it under `tmp` (onnxruntime; see the module docstring)."""
        if base_kind == "model":
            return self.merged()
        # An onnxruntime server never loads MindSpore, and merging imports it (model.lora): a child process
        # merges and writes the ONNX decoder, into a directory of `tmp` and nowhere else (the name was checked
        # when the flag was parsed; checked again here against the resolved path).
        check_name(self.name, f"{FLAG} {self.name}")
        out = tmp / self.name
        if out.resolve().parent != Path(tmp).resolve():
            raise ValueError(
                f"{FLAG} {self.name}: the adapter's directory {out} is not directly under the server's "
                f"temporary directory {tmp}; name the adapter with letters, digits, '-', '_' and '.'"
            )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        proc = subprocess.run(
            [sys.executable, "-m", "tasks.serving.adapters", str(self.finetune), str(base), str(out)],
            capture_output=True,
            text=True,
            env=env,
        )
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(
                f"{FLAG} {self.name}: merging {self.finetune_id} and writing it as an ONNX decoder like "
                f"{base.name} failed: {tail}"
            )
        return out


def model_ref_of(base: Path) -> dict[str, Any]:
    """{stage, key, digest} of the model artifact that BASE runs: itself, or the one an export was made from."""
    from tasks.serving.backends import artifact_kind

    kind = artifact_kind(base)
    try:
        m = ArtifactStore.read_manifest(base)
    except ArtifactError:
        raise ValueError(
            f"{FLAG} needs a published BASE to check adapters against, but {base} has no manifest.json; "
            f"pass the artifact directory `msllm train`, `msllm export` or `msllm convert` printed"
        ) from None
    if kind == "model":
        return {"stage": m["stage"], "key": m["key"], "digest": m["digest"]}
    models = [i for i in m.get("inputs", []) if i.get("kind") == "artifact" and i.get("stage") != "eval"]
    if not models:
        raise ValueError(
            f"{base}: its manifest names no model artifact it was exported from, so {FLAG} cannot check "
            f"which base the adapters need; pass that model artifact as BASE instead"
        )
    return {k: models[0][k] for k in ("stage", "key", "digest")}


def check_adapters(base: Path, specs: list[AdapterSpec], base_id: str, store=None) -> list[Adapter]:
    """Every check of the module docstring, in flag order; `store` resolves references that are not directories."""
    from tasks.serving.backends import artifact_kind

    if not specs:
        return []
    names = [base_id]
    for s in specs:
        check_name(s.name, f"{FLAG} {s.name}={s.ref}")
        if s.name in names:
            what = "the base model's id" if s.name == base_id else "another adapter's name"
            raise ValueError(
                f"{FLAG} {s.name}={s.ref}: the name '{s.name}' is already {what}; every served model "
                f"needs its own id (rename the adapter{', or the base with --model-name' if s.name == base_id else ''})"
            )
        names.append(s.name)
    want = model_ref_of(base)
    out = []
    for s in specs:
        where = f"{FLAG} {s.name}={s.ref}"
        p = Path(s.ref)
        try:
            ft = p.resolve() if p.is_dir() else (store.find(s.ref) if store is not None else None)
        except ArtifactError as exc:
            raise ValueError(f"{where}: {exc}; pass the finetune artifact directory `msllm finetune` printed") from None
        if ft is None or not ft.is_dir():
            raise ValueError(
                f"{where}: no such directory; pass the finetune artifact directory `msllm finetune` printed"
            )
        if not (ft / "adapter.json").is_file():
            raise ValueError(
                f"{where}: not a finetune artifact (no adapter.json); pass the finetune artifact "
                f"(artifacts/finetune/<key>), not a model or an export"
            )
        try:
            m = ArtifactStore.read_manifest(ft)
        except ArtifactError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if m.get("stage") != "finetune":
            raise ValueError(f"{where}: a {m.get('stage')} artifact, not a finetune artifact")
        cfg = json.loads((ft / "adapter.json").read_text())
        got = cfg["base"]
        if (got["key"], got["digest"]) != (want["key"], want["digest"]):
            raise ValueError(
                f"{where}: this adapter was trained on {got['stage']}/{got['key']}, but BASE {base} "
                f"{'is' if artifact_kind(base) == 'model' else 'was exported from'} "
                f"{want['stage']}/{want['key']}; serve it over its own base (msllm serve "
                f"artifacts/{got['stage']}/{got['key']} {FLAG} {s.name}=...) or drop it"
            )
        out.append(Adapter(s.name, ft, cfg.get("method", "lora"), f"{got['stage']}/{got['key']}"))
    return out


def export_onnx_like(merged: Path, export: Path, out: Path) -> Path:
    """The merged weights as `export`'s KV-cache ONNX decoder (same metadata), with its tokenizer, in `out`."""
    import onnx

    from tasks.deploy.formats import export_onnx
    from tasks.store.model_artifact import read_info
    from tasks.store.tensors import load_weights
    from tasks.tokenizer import tokenizer_files

    out.mkdir()  # in the server's temporary directory, which exists: never a directory chain of its own
    meta = {
        p.key: p.value
        for p in onnx.load(str(export / "model.onnx"), load_external_data=False).metadata_props
        if p.key != "model_config"
    }  # the architecture comes from the merged model itself
    export_onnx(read_info(merged), load_weights(merged), out / "model.onnx", meta)
    for f in [*tokenizer_files(export), merged / "model.json"]:
        shutil.copy2(f, out / f.name)
    return out


if __name__ == "__main__":  # python -m tasks.serving.adapters FINETUNE EXPORT OUT (Adapter.model_dir's child)
    ft, export, out = map(Path, sys.argv[1:4])
    export_onnx_like(Adapter("", ft, "", "").merged(), export, out)
