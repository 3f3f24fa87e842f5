"""Lineage review: where an artifact came from, down to the raw corpus bytes.

    tree = lineage_tree(store, path)             # nested dicts, from the manifests alone
    print(render(tree, "text" | "markdown" | "json" | "mermaid" | "dot"))
    raw_inputs(tree)                             # every raw file (path, sha256) at the leaves
    lineage_data_artifact(store, model)          # the data artifact a model was trained on, if still stored

Each node is an artifact (stage, key, pipeline, code version, config digest,
metrics) whose children are its inputs: other artifacts (followed through their
recorded path, verified by digest) or raw files (path, size, sha256).

Lineage is linear in the size of the graph: every artifact is read and expanded
once. Where an artifact is an input of several others (the data artifact under
both pretrain and eval, or any diamond), its first occurrence in depth-first
input order is the full subtree and every later one is a reference,
`{"kind": "artifact-ref", "ref": "shown above", stage, key, digest, path}`;
an artifact that is its own ancestor (only a crafted manifest) is
`{"kind": "artifact-ref", "ref": "cycle", ...}`. The text format prints a
reference as `stage/key [shown above]`; markdown (what the flows publish to the Prefect UI,
whose markdown renders no mermaid) is the same tree as a nested list, then a table per
artifact and per raw file; mermaid and dot draw the DAG itself
(one node per artifact, one edge per input). raw_inputs() is unaffected.

A manifest is data, not trust: an input is followed only when its recorded path
resolves inside the artifact root (symlinks included). One that points outside,
or an input entry that is not a well-formed record, is a `{"kind": "rejected",
"error": ...}` node and is not followed; an input whose manifest is missing or
corrupt is a `{"kind": "missing", "error": ...}` node. When an input's digest
differs from the one recorded in the manifest that uses it, its node (full or
reference) carries `warning`, shown by every format.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from tasks.store.artifacts import ArtifactStore
from tasks.store.disk import canonical_json
from tasks.store.errors import ArtifactError

DIGEST_WARNING = "digest differs from the one recorded when this artifact was built"
MAX_DEPTH = 200  # artifacts deep; a real pipeline is under 10 (keeps rendering within Python's recursion limit)
MODEL_STAGES = ("merged", "finetune", "pretrain", "convert")  # stages whose artifacts are (or lead to) models


def lineage_tree(store: ArtifactStore, path: str | Path) -> dict[str, Any]:
    """The lineage of the artifact at `path` (inside `store.root`). Raises ArtifactError for the root only."""
    done: dict[Path, dict[str, Any]] = {}  # expanded artifacts, by resolved path
    return _node(store, store.inside(path), done, set(), 0)


def _node(store: ArtifactStore, path: Path, done: dict, active: set, depth: int) -> dict[str, Any]:
    m = store.read_manifest(path)
    node: dict[str, Any] = {
        "kind": "artifact",
        "stage": str(m.get("stage")),
        "key": str(m.get("key")),
        "pipeline": m.get("pipeline"),
        "path": str(path),
        "created": m.get("created"),
        "digest": m["digest"],
        "code": m.get("code") if isinstance(m.get("code"), dict) else {},
        "config_sha256": hashlib.sha256(canonical_json(m.get("config")).encode()).hexdigest()[:16],
        "config": m.get("config"),
        "metrics": {
            k: v
            for k, v in (m.get("metrics") if isinstance(m.get("metrics"), dict) else {}).items()
            if isinstance(v, (int, float, str)) or v is None
        },
        "inputs": [],
    }
    if isinstance(m.get("replaces"), dict):  # a forced rerun: the artifact it replaced under the same key
        node["replaces"] = {k: m["replaces"].get(k) for k in ("path", "created", "digest")}
    done[path] = node
    active.add(path)
    inputs = m.get("inputs")
    for inp in inputs if isinstance(inputs, list) else []:
        node["inputs"].append(_input(store, inp, done, active, depth))
    active.discard(path)
    return node


def _input(store: ArtifactStore, inp: Any, done: dict, active: set, depth: int) -> dict[str, Any]:
    if not isinstance(inp, dict):
        return {
            "kind": "rejected",
            "stage": "?",
            "key": "?",
            "error": f"malformed input {str(inp)[:80]!r}; not followed",
        }
    if inp.get("kind") != "artifact":
        return {"kind": "file", "path": inp.get("path"), "size": inp.get("size"), "sha256": inp.get("sha256")}
    stage, key, digest = str(inp.get("stage", "?")), str(inp.get("key", "?")), inp.get("digest")
    if not isinstance(inp.get("path"), str) or not isinstance(digest, str):
        return {
            "kind": "rejected",
            "stage": stage,
            "key": key,
            "error": "malformed input (no path or digest); not followed: rebuild the artifact that lists it",
        }
    try:
        p = store.inside(inp["path"])
    except ArtifactError as exc:
        return {
            "kind": "rejected",
            "stage": stage,
            "key": key,
            "digest": digest,
            "error": f"{exc}; not followed (a manifest may only name artifacts of its own store: "
            "rebuild the one that lists it)",
        }
    if p in done or p in active:
        child = {
            "kind": "artifact-ref",
            "ref": "cycle" if p in active else "shown above",
            "stage": stage,
            "key": key,
            "digest": digest,
            "path": str(p),
        }
        if p in done and done[p]["digest"] != digest:
            child["warning"] = DIGEST_WARNING
        return child
    if depth + 1 >= MAX_DEPTH:
        return {
            "kind": "rejected",
            "stage": stage,
            "key": key,
            "digest": digest,
            "error": f"lineage deeper than {MAX_DEPTH} artifacts; not followed",
        }
    try:
        child = _node(store, p, done, active, depth + 1)
    except ArtifactError as exc:
        return {"kind": "missing", "stage": stage, "key": key, "digest": digest, "error": str(exc)}
    if child["digest"] != digest:
        child["warning"] = DIGEST_WARNING
    return child


def raw_inputs(tree: dict[str, Any]) -> list[dict[str, Any]]:
    out, stack = [], [tree]
    while stack:
        n = stack.pop()
        if n["kind"] == "file":
            out.append(n)
        stack.extend(n.get("inputs", []))
    uniq = {(f["path"], f["sha256"]): f for f in out}
    return sorted(uniq.values(), key=lambda f: f["path"] or "")


def _label(n: dict[str, Any]) -> str:
    if n["kind"] == "file":
        return f"{Path(str(n['path'])).name} ({n['size']} B, sha256 {str(n['sha256'])[:12]}…)"
    warn = f" ⚠ {n['warning']}" if n.get("warning") else ""
    if n["kind"] == "artifact-ref":
        return f"{n['stage']}/{n['key']} [{n['ref']}]{warn}"
    if n["kind"] != "artifact":
        return f"{n['stage']}/{n['key']} [{n['kind']}: {n.get('error', '')}]{warn}"
    metrics = ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in list(n["metrics"].items())[:4]
    )
    return (
        f"{n['stage']}/{n['key']} (pipeline {n['pipeline']}, code {n['code'].get('stage_version', '?')}, "
        f"git {str(n['code'].get('git_commit') or '-')[:8]}, config {n['config_sha256']})"
        + (f" [{metrics}]" if metrics else "")
        + (
            f" (rerun; replaces the one of {n['replaces'].get('created')}, kept at {n['replaces'].get('path')})"
            if isinstance(n.get("replaces"), dict)
            else ""
        )
        + warn
    )


def _nid(n: dict[str, Any]) -> str:
    raw = ("f_" + str(n["sha256"])[:12]) if n["kind"] == "file" else f"{n['stage']}_{str(n['key'])[:10]}"
    return re.sub(r"\W", "_", raw)


def _walk(n: dict[str, Any], parent: str | None, edges: dict, nodes: dict) -> None:
    """The DAG: one node per artifact (a reference adds only its edge), one edge per input, warnings on edges."""
    nid = _nid(n)
    if n["kind"] != "artifact-ref" or nid not in nodes:
        nodes[nid] = _label(n) if n["kind"] != "artifact-ref" else f"{n['stage']}/{n['key']}"
    if parent:
        edges[(nid, parent)] = edges.get((nid, parent)) or n.get("warning")
    if n["kind"] == "artifact":
        for c in n["inputs"]:
            _walk(c, nid, edges, nodes)


def _markdown(tree: dict[str, Any]) -> str:
    """A nested list (wraps in any width, unlike a code block), an artifacts table and a raw-inputs table."""
    lines = [f"# Lineage of {tree['stage']}/{tree['key']}", ""]
    arts: list[dict[str, Any]] = []

    def rec(n: dict[str, Any], depth: int) -> None:
        pad = "  " * depth + "- "
        if n["kind"] == "file":
            lines.append(
                f"{pad}raw file `{Path(str(n['path'])).name}` ({n['size']} B, sha256 `{str(n['sha256'])[:16]}…`)"
            )
            return
        warn = f" ⚠ {n['warning']}" if n.get("warning") else ""
        if n["kind"] == "artifact-ref":
            lines.append(f"{pad}**{n['stage']}/{str(n['key'])[:12]}** ({n['ref']}){warn}")
            return
        if n["kind"] != "artifact":
            lines.append(f"{pad}**{n['stage']}/{str(n['key'])[:12]}** {n['kind']}: {n.get('error', '')}{warn}")
            return
        arts.append(n)
        metrics = ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in list(n["metrics"].items())[:4]
        )
        lines.append(
            f"{pad}**{n['stage']}/{str(n['key'])[:12]}** (pipeline {n['pipeline']})"
            + (f": {metrics}" if metrics else "")
            + warn
        )
        for c in n["inputs"]:
            rec(c, depth + 1)

    rec(tree, 0)
    lines += ["", "| artifact | pipeline | created | code | git | config |", "|---|---|---|---|---|---|"]
    for n in arts:
        lines.append(
            f"| {n['stage']}/`{n['key']}` | {n['pipeline']} | {n['created']} | "
            f"`{n['code'].get('stage_version', '?')}` | `{str(n['code'].get('git_commit') or '-')[:8]}` | "
            f"`{n['config_sha256']}` |"
        )
    raws = raw_inputs(tree)
    if raws:
        lines += ["", "| raw input | bytes | sha256 |", "|---|---:|---|"]
        lines += [f"| {Path(str(r['path'])).name} | {r['size']} | `{r['sha256']}` |" for r in raws]
    return "\n".join(lines) + "\n"


def render(tree: dict[str, Any], fmt: str = "text") -> str:
    if fmt == "markdown":
        return _markdown(tree)
    if fmt == "json":
        return json.dumps(tree, indent=2, default=str)
    if fmt == "text":
        lines: list[str] = []

        def rec(n, prefix: str, last: bool, top: bool) -> None:
            lines.append(("" if top else prefix + ("└── " if last else "├── ")) + _label(n))
            kids = n.get("inputs", [])
            for i, c in enumerate(kids):
                rec(c, prefix + ("" if top else ("    " if last else "│   ")), i == len(kids) - 1, False)

        rec(tree, "", True, True)
        return "\n".join(lines)
    if fmt not in ("mermaid", "dot"):
        raise ValueError(f"unknown lineage format {fmt!r}; use text, markdown, json, mermaid or dot")
    edges: dict = {}
    nodes: dict = {}
    _walk(tree, None, edges, nodes)
    esc = lambda s: str(s).replace(chr(34), chr(39))  # noqa: E731
    if fmt == "mermaid":
        out = ["graph LR"]
        out += [f'    {k}["{esc(v)}"]' for k, v in nodes.items()]
        out += [f"    {a} -->|{esc(w)}| {b}" if w else f"    {a} --> {b}" for (a, b), w in edges.items()]
        return "\n".join(out)
    out = ["digraph lineage {", "  rankdir=LR;", "  node [shape=box, fontsize=10];"]
    out += [f'  "{k}" [label="{esc(v)}"];' for k, v in nodes.items()]
    out += [
        f'  "{a}" -> "{b}" [label="{esc(w)}", color=red];' if w else f'  "{a}" -> "{b}";' for (a, b), w in edges.items()
    ]
    return "\n".join([*out, "}"])


def lineage_data_artifact(store: ArtifactStore, model_artifact: Path, depth: int = 4) -> Path | None:
    """The data artifact a model was trained on (through finetune → pretrain …), if it is still in the store."""
    m = store.read_manifest(model_artifact)
    refs = [i for i in m.get("inputs", []) if i.get("kind") == "artifact"]
    for ref in sorted(refs, key=lambda r: r.get("stage") != "data"):  # a direct data input first
        try:
            p = store.lookup(ref["stage"], ref["key"])
        except ArtifactError:
            continue
        if p is None:
            continue
        if ref["stage"] == "data":
            return p
        if ref["stage"] in MODEL_STAGES and depth > 0:
            found = lineage_data_artifact(store, p, depth - 1)
            if found is not None:
                return found
    return None
