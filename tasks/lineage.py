"""Lineage review: where an artifact came from, down to the raw corpus bytes.

    tree = lineage_tree(store, path)             # nested dicts, from the manifests alone
    print(render(tree, "text" | "json" | "mermaid" | "dot"))
    raw_inputs(tree)                             # every raw file (path, sha256) at the leaves

Each node is an artifact (stage, key, pipeline, code version, config digest,
metrics) whose children are its inputs: other artifacts (followed through their
recorded path, verified by digest) or raw files (path, size, sha256).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tasks.artifacts import ArtifactError, ArtifactStore, canonical_json


def lineage_tree(store: ArtifactStore, path: str | Path, _seen: set[str] | None = None) -> dict[str, Any]:
    m = store.read_manifest(path)
    seen = set() if _seen is None else _seen
    node: dict[str, Any] = {
        "kind": "artifact", "stage": m["stage"], "key": m["key"], "pipeline": m.get("pipeline"),
        "path": str(Path(path).resolve()), "created": m.get("created"), "digest": m["digest"],
        "code": m.get("code", {}), "config_sha256": hashlib.sha256(canonical_json(m.get("config")).encode()).hexdigest()[:16],
        "config": m.get("config"),
        "metrics": {k: v for k, v in m.get("metrics", {}).items() if isinstance(v, (int, float, str)) or v is None},
        "inputs": [],
    }
    for inp in m.get("inputs", []):
        if inp.get("kind") == "artifact":
            p = Path(inp["path"])
            if inp["key"] in seen:
                node["inputs"].append({"kind": "artifact-ref", "stage": inp["stage"], "key": inp["key"]})
                continue
            try:
                child = lineage_tree(store, p, seen | {m["key"]})
                if child["digest"] != inp["digest"]:
                    child["warning"] = "digest differs from the one recorded when this artifact was built"
            except ArtifactError as exc:
                child = {"kind": "missing", "stage": inp["stage"], "key": inp["key"], "digest": inp["digest"], "error": str(exc)}
            node["inputs"].append(child)
        else:
            node["inputs"].append({"kind": "file", "path": inp.get("path"), "size": inp.get("size"), "sha256": inp.get("sha256")})
    return node


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
        return f"{Path(n['path']).name} ({n['size']} B, sha256 {n['sha256'][:12]}…)"
    if n["kind"] != "artifact":
        return f"{n['stage']}/{n['key']} [{n['kind']}]"
    metrics = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in list(n["metrics"].items())[:4])
    return (f"{n['stage']}/{n['key']} (pipeline {n['pipeline']}, code {n['code'].get('stage_version', '?')}, "
            f"git {str(n['code'].get('git_commit') or '-')[:8]}, config {n['config_sha256']})" + (f" [{metrics}]" if metrics else ""))


def _walk(n: dict[str, Any], parent: str | None, edges: list, nodes: dict) -> None:
    nid = ("f_" + n["sha256"][:12]) if n["kind"] == "file" else f"{n['stage']}_{n['key'][:10]}"
    nodes[nid] = _label(n)
    if parent:
        edges.append((nid, parent))
    for c in n.get("inputs", []):
        _walk(c, nid, edges, nodes)


def render(tree: dict[str, Any], fmt: str = "text") -> str:
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
    edges: list = []
    nodes: dict = {}
    _walk(tree, None, edges, nodes)
    if fmt == "mermaid":
        out = ["graph LR"]
        out += [f'    {k}["{v.replace(chr(34), chr(39))}"]' for k, v in nodes.items()]
        out += [f"    {a} --> {b}" for a, b in dict.fromkeys(edges)]
        return "\n".join(out)
    if fmt == "dot":
        out = ["digraph lineage {", "  rankdir=LR;", "  node [shape=box, fontsize=10];"]
        out += [f'  "{k}" [label="{v.replace(chr(34), chr(39))}"];' for k, v in nodes.items()]
        out += [f'  "{a}" -> "{b}";' for a, b in dict.fromkeys(edges)]
        return "\n".join([*out, "}"])
    raise ValueError(f"unknown lineage format {fmt!r}; use text, json, mermaid or dot")
