"""Code versions from the import graph: which project files a module runs, and their hash.

A stage's cache key must change when any code it runs changes, and only then. A
hand-kept file list drifts, so the list is computed: parse every project module
(packages `model`, `tasks`, `flows`) with `ast`, follow its imports transitively and
hash the files reached, plus the native sources those modules build (a module-level
`NATIVE_SOURCES = ("x.cc", "x.h")` literal, file names beside the module: `model/kernel_build.py`
compiles `model/*.cc` at run time, so every stage whose imports reach it is keyed by them),
plus the data files the stage declares (the lm-eval task YAMLs, say):

    import_closure("tasks.stages.pretrain")            # ['model/__init__.py', ..., 'tasks/stages/pretrain.py', ...]
    code_version("tasks.stages.evaluate", data_files=["tasks/stages/evaluate/lm_tasks/*.yaml",
    "tasks/stages/evaluate/lm_tasks/utils.py"])
    native_sources("tasks.stages.pretrain")             # ['model/decode_kernel.cc', 'model/simd.h',
    'model/train_kernels.cc'] import_graph() # {'tasks.cli': {'tasks.config', ...}, ...}
    import_cycles(import_graph())               # [['tasks.cli', 'tasks.stages.export', ...]] (one list per cycle)

What counts as an import: `import a.b` (a and a.b), `from a import b` (a, and a.b when
it is a module), relative imports, imports inside functions, and
`importlib.import_module("a.b")` / `__import__("a.b", fromlist=[...])` with literal
names. Importing `a.b.c` also runs `a/__init__.py` and `a/b/__init__.py`, so those are
in the closure. Imports under `if TYPE_CHECKING:` never execute, so they are not edges
of `import_graph()` (the cycle test), but they are in the closure: a module imports a
type only to use objects of it that its callers pass in (the data stage calls
`PipelineConfig` methods), so that code runs too. Dynamic imports whose name is
computed are invisible (`dynamic_imports()` lists them, so a test can hold them to a
known set).

A project import that resolves to no file, a declared data file or native source that
does not exist, a `NATIVE_SOURCES` that is not a literal tuple of file names, or a file that does not parse is an error
(`CodeVersionError`), never a silent skip.
Standard library only: the CLI and the flows call this without MindSpore.
"""

from __future__ import annotations

import ast
import functools
import glob
import hashlib
import importlib.metadata
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("model", "tasks", "flows")
REPO = Path(__file__).resolve().parents[2]  # the repo root, or site-packages for an installed wheel
_FORMAT = b"msllm-code-version-1\0"


class CodeVersionError(RuntimeError):
    """An import or declared data file that resolves to nothing, or a source file that does not parse."""


@dataclass(frozen=True)
class DynamicImport:
    """An import whose module name is computed at run time: invisible to the graph."""

    module: str
    file: str
    line: int
    code: str


@dataclass(frozen=True)
class _Parsed:
    imports: frozenset[str]
    typing_imports: frozenset[str]  # under `if TYPE_CHECKING:`
    dynamic: tuple[DynamicImport, ...]
    native: tuple[str, ...] = ()  # NATIVE_SOURCES: file names beside the module that it compiles at run time
    external: frozenset[str] = frozenset()  # top-level names of the third-party modules it imports (run-time ones)


_PARSE_CACHE: dict[tuple[str, str, str, str], _Parsed] = {}  # (file, module, sha256 of bytes, module set)


# ----------------------------------------------------------------------------- the project's modules


class _Project:
    """The modules under `root`'s project packages: name → file, and namespace packages (no file)."""

    def __init__(self, root: str | Path = REPO):
        self.root = Path(root).resolve()
        self.files: dict[str, Path] = {}
        self.namespaces: set[str] = set()
        for pkg in PACKAGES:
            top = self.root / pkg
            if not top.is_dir():
                continue
            for path in sorted(top.rglob("*.py")):
                parts = path.relative_to(self.root).with_suffix("").parts
                if any(p.startswith(".") or p == "__pycache__" or not p.isidentifier() for p in parts):
                    continue
                name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                self.files[name] = path
            for d in [top, *sorted(p for p in top.rglob("*") if p.is_dir())]:
                parts = d.relative_to(self.root).parts
                if any(p.startswith(".") or p == "__pycache__" or not p.isidentifier() for p in parts):
                    continue
                if not (d / "__init__.py").is_file() and any(d.rglob("*.py")):
                    self.namespaces.add(".".join(parts))
        self._parsed: dict[str, _Parsed] = {}
        # a parse checks imports against the module set, so a cached parse is valid for that set only
        self._layout = hashlib.sha256(
            "\n".join(sorted(self.files) + ["|"] + sorted(self.namespaces)).encode()
        ).hexdigest()

    def rel(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()

    def exists(self, name: str) -> bool:
        return name in self.files or name in self.namespaces

    def is_package(self, name: str) -> bool:
        return name in self.namespaces or (name in self.files and self.files[name].name == "__init__.py")

    def parsed(self, name: str) -> _Parsed:
        if name not in self._parsed:
            path = self.files[name]
            data = path.read_bytes()
            key = (str(path), name, hashlib.sha256(data).hexdigest(), self._layout)
            if key not in _PARSE_CACHE:
                _PARSE_CACHE[key] = _parse(self, name, path, data)
            self._parsed[name] = _PARSE_CACHE[key]
        return self._parsed[name]

    def edges(self, name: str, typing: bool = False) -> set[str]:
        """The project modules (with a file) that importing `name` imports directly (+ type-only ones if `typing`)."""
        parsed = self.parsed(name)
        out = set()
        for target in parsed.imports | (parsed.typing_imports if typing else frozenset()):
            for anc in _ancestry(target):
                # a module inside package P runs only after P's __init__ began: no edge to P
                if anc in self.files and anc != name and not name.startswith(anc + "."):
                    out.add(anc)
        return out


def _ancestry(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _is_project(name: str) -> bool:
    return name.split(".", 1)[0] in PACKAGES


# ----------------------------------------------------------------------------- parsing one file


class _ImportVisitor(ast.NodeVisitor):
    def __init__(self, project: _Project, name: str, path: Path):
        self.project, self.name, self.path = project, name, path
        self.package = name if project.is_package(name) else name.rpartition(".")[0]
        self.imports: set[str] = set()
        self.typing_imports: set[str] = set()
        self.in_typing = False
        self.dynamic: list[DynamicImport] = []
        self.external: set[str] = set()

    # -- helpers
    def _where(self, node: ast.AST) -> str:
        return f"{self.project.rel(self.path)}:{getattr(node, 'lineno', '?')}"

    def _fail(self, node: ast.AST, what: str, why: str) -> None:
        raise CodeVersionError(f"{self._where(node)}: `{what}`: {why}; fix the import or add the file")

    def _require(self, node: ast.AST, module: str, what: str) -> None:
        """Record `module` (and check that it and its parent packages resolve to files in the project)."""
        if not _is_project(module):
            if not self.in_typing:
                self.external.add(module.split(".")[0])
            return
        for anc in _ancestry(module):
            if not self.project.exists(anc):
                rel = anc.replace(".", "/")
                self._fail(
                    node, what, f"no module {anc} under {self.project.root} (neither {rel}.py nor {rel}/__init__.py)"
                )
        (self.typing_imports if self.in_typing else self.imports).add(module)

    def _from(self, node: ast.AST, base: str, names: Iterable[str], what: str) -> None:
        self._require(node, base, what)
        if not _is_project(base):
            return
        for n in names:
            if n == "*":
                continue
            sub = f"{base}.{n}"
            if self.project.exists(sub):
                (self.typing_imports if self.in_typing else self.imports).add(sub)
            elif base in self.project.namespaces:  # a namespace package has no attributes, only submodules
                self._fail(
                    node,
                    what,
                    f"no module {sub} under {self.project.root} "
                    f"(neither {sub.replace('.', '/')}.py nor {sub.replace('.', '/')}/__init__.py)",
                )

    def _relative(self, node: ast.AST, level: int, module: str | None, what: str) -> str:
        parts = self.package.split(".") if self.package else []
        if level - 1 > len(parts) - 1 or not parts:
            self._fail(node, what, f"relative import beyond the top-level package of {self.name}")
        base = ".".join(parts[: len(parts) - (level - 1)])
        return f"{base}.{module}" if module else base

    # -- statements
    def visit_If(self, node: ast.If) -> None:
        t = node.test
        if (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
            isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
        ):
            outer, self.in_typing = self.in_typing, True
            for child in node.body:  # never runs: type-only imports
                self.visit(child)
            self.in_typing = outer
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._require(node, alias.name, f"import {alias.name}")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        names = [a.name for a in node.names]
        what = f"from {'.' * node.level}{node.module or ''} import {', '.join(names)}"
        base = self._relative(node, node.level, node.module, what) if node.level else node.module or ""
        self._from(node, base, names, what)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        fname = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        if fname in ("import_module", "__import__") and (node.args or node.keywords):
            self._dynamic_call(node, fname)
        self.generic_visit(node)

    def _dynamic_call(self, node: ast.Call, fname: str) -> None:
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        arg = node.args[0] if node.args else kw.get("name")
        what = ast.unparse(node)
        if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
            self.dynamic.append(DynamicImport(self.name, self.project.rel(self.path), node.lineno, what))
            return
        target = arg.value
        if fname == "import_module":
            if target.startswith("."):
                pkg = node.args[1] if len(node.args) > 1 else kw.get("package")
                if not (isinstance(pkg, ast.Constant) and isinstance(pkg.value, str)):
                    self.dynamic.append(DynamicImport(self.name, self.project.rel(self.path), node.lineno, what))
                    return
                level = len(target) - len(target.lstrip("."))
                parts = pkg.value.split(".")
                target = ".".join(
                    parts[: len(parts) - (level - 1)] + ([target.lstrip(".")] if target.lstrip(".") else [])
                )
            self._require(node, target, what)
            return
        # __import__(name, globals, locals, fromlist, level)
        level = node.args[4] if len(node.args) > 4 else kw.get("level")
        if isinstance(level, ast.Constant) and isinstance(level.value, int) and level.value > 0:
            target = self._relative(node, level.value, target or None, what)
        fromlist = node.args[3] if len(node.args) > 3 else kw.get("fromlist")
        names = []
        if isinstance(fromlist, (ast.List, ast.Tuple)):
            names = [e.value for e in fromlist.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        self._from(node, target, names, what)


def _parse(project: _Project, name: str, path: Path, data: bytes) -> _Parsed:
    try:
        tree = ast.parse(data, filename=str(path))
    except SyntaxError as exc:
        raise CodeVersionError(f"{project.rel(path)}:{exc.lineno}: does not parse ({exc.msg})") from None
    v = _ImportVisitor(project, name, path)
    v.visit(tree)
    v.imports.discard(name)
    v.typing_imports.discard(name)
    return _Parsed(
        frozenset(v.imports),
        frozenset(v.typing_imports - v.imports),
        tuple(v.dynamic),
        _native_sources(project, path, tree),
        frozenset(v.external),
    )


def _native_sources(project: _Project, path: Path, tree: ast.Module) -> tuple[str, ...]:
    """The module-level `NATIVE_SOURCES = ("a.cc", ...)` of a module: names of files beside it."""
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if not any(isinstance(t, ast.Name) and t.id == "NATIVE_SOURCES" for t in targets):
            continue
        v = node.value
        names = (
            [e.value for e in v.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if isinstance(v, (ast.Tuple, ast.List))
            else None
        )
        if names is None or len(names) != len(v.elts) or any("/" in n or n in ("", ".", "..") for n in names):
            raise CodeVersionError(
                f"{project.rel(path)}:{node.lineno}: NATIVE_SOURCES must be a literal tuple of file "
                f"names beside the module (it keys every stage that imports it)"
            )
        return tuple(names)
    return ()


# ----------------------------------------------------------------------------- public API


def import_graph(root: str | Path = REPO, typing: bool = False) -> dict[str, set[str]]:
    """{module: the project modules it imports directly}, for every module of model/, tasks/, flows/.

    Run-time imports only, unless `typing` adds those under `if TYPE_CHECKING:` (the closure's graph)."""
    project = _Project(root)
    return {name: project.edges(name, typing) for name in sorted(project.files)}


def dynamic_imports(root: str | Path = REPO) -> list[DynamicImport]:
    """Every `import_module(...)` / `__import__(...)` whose module name is not a literal."""
    project = _Project(root)
    return [d for name in sorted(project.files) for d in project.parsed(name).dynamic]


def _closure_modules(project: _Project, modules: Iterable[str]) -> set[str]:
    todo, seen = [], set()
    for m in modules:
        if m not in project.files:
            rel = m.replace(".", "/")
            raise CodeVersionError(
                f"module {m} is not a file under {project.root} (neither {rel}.py nor "
                f"{rel}/__init__.py); name a module of {', '.join(PACKAGES)}"
            )
        todo.append(m)
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo.extend(a for a in _ancestry(m) if a in project.files and a not in seen)  # parents' __init__ run too
        todo.extend(project.edges(m, typing=True) - seen)
    return seen


def import_closure(modules: str | Iterable[str], root: str | Path = REPO) -> list[str]:
    """The project files (paths relative to `root`, sorted) that importing `modules` runs, transitively."""
    project = _Project(root)
    names = [modules] if isinstance(modules, str) else list(modules)
    return sorted(project.rel(project.files[m]) for m in _closure_modules(project, names))


def data_file_paths(data_files: Iterable[str], root: str | Path = REPO) -> list[str]:
    """Declared data files (paths or globs relative to `root`) → sorted relative paths; a miss is an error."""
    root = Path(root).resolve()
    out: set[str] = set()
    for pattern in data_files:
        if Path(pattern).is_absolute() or ".." in Path(pattern).parts:
            raise CodeVersionError(f"declared data file {pattern!r}: give a path relative to {root}, inside it")
        if glob.has_magic(pattern):
            hits = [p for p in sorted(root.glob(pattern)) if p.is_file()]
            if not hits:
                raise CodeVersionError(
                    f"declared data files {pattern!r} match nothing under {root}; "
                    f"fix the stage's data_files or restore the files"
                )
            out.update(p.relative_to(root).as_posix() for p in hits)
        else:
            p = root / pattern
            if not p.is_file():
                raise CodeVersionError(
                    f"declared data file {pattern} does not exist under {root}; "
                    f"fix the stage's data_files or restore the file"
                )
            out.add(Path(pattern).as_posix())
    return sorted(out)


def native_sources(modules: str | Iterable[str], root: str | Path = REPO) -> list[str]:
    """The native sources (relative paths, sorted) that the modules of the import closure compile at run time."""
    project = _Project(root)
    names = [modules] if isinstance(modules, str) else list(modules)
    out = set()
    for m in _closure_modules(project, names):
        for fname in project.parsed(m).native:
            p = project.files[m].parent / fname
            if not p.is_file():
                raise CodeVersionError(
                    f"{project.rel(project.files[m])}: NATIVE_SOURCES names {fname}, which does not "
                    f"exist beside it; fix NATIVE_SOURCES or restore the file"
                )
            out.add(project.rel(p))
    return sorted(out)


def code_version(modules: str | Iterable[str], data_files: Iterable[str] = (), root: str | Path = REPO) -> str:
    """sha256 (hex) over the relative path and bytes of every file in the import closure, the native sources its
    modules build, and the data files."""
    root = Path(root).resolve()
    files = sorted(
        set(import_closure(modules, root)) | set(native_sources(modules, root)) | set(data_file_paths(data_files, root))
    )
    h = hashlib.sha256(_FORMAT)
    for rel in files:
        data = (root / rel).read_bytes()
        h.update(rel.encode() + b"\0" + str(len(data)).encode() + b"\0")
        h.update(data)
    return h.hexdigest()


def stage_code_version(name: str, module: str, data_files: Iterable[str] = (), root: str | Path = REPO) -> str:
    """16 hex digits: a stage's name + every source file its module imports + its declared data files + the versions
    of the libraries that code imports (`library_versions`: after upgrading lm-eval, eval is not a cache hit with the
    old scores). What the stage table's `code_version(name)` returns, and what a stage module below the table
    computes for itself."""
    closure = code_version(module, data_files=list(data_files), root=root)
    libs = ",".join(f"{d}={v}" for d, v in library_versions(module, root).items())
    return hashlib.sha256(f"{name}:{closure}:{libs}".encode()).hexdigest()[:16]


def library_versions(modules: str | Iterable[str], root: str | Path = REPO) -> dict[str, str]:
    """{distribution: installed version} of every third-party library the import closure of `modules` imports
    (mindspore, numpy, lm-eval, onnxruntime, tokenizers, sentencepiece, ...): what shapes a stage's bytes besides
    its own code. A library that is not installed is left out (the stage could not import it anyway)."""
    project = _Project(Path(root).resolve())
    names = [modules] if isinstance(modules, str) else list(modules)
    tops = {top for m in _closure_modules(project, names) for top in project.parsed(m).external}
    tops -= {*PACKAGES, *sys.stdlib_module_names, *_NOT_SHAPING, ""}
    out = {}
    for top in sorted(tops):
        for dist in _distributions().get(top, ()):
            try:
                out[dist] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                pass
    return dict(sorted(out.items()))


# imported for progress bars and process stats only: no byte of an artifact depends on their version
_NOT_SHAPING = frozenset({"tqdm", "rich", "psutil"})


@functools.lru_cache(maxsize=1)
def _distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's cycles: each strongly connected component of more than one module (or a self-import)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def strongconnect(v: str) -> None:  # Tarjan, iterative over each node's successors
        nonlocal counter
        work = [(v, iter(sorted(graph.get(v, ()))))]
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1 or node in graph.get(node, ()):
                        out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return sorted(out)


def shortest_cycle(graph: dict[str, set[str]], start: str) -> list[str]:
    """One shortest import chain from `start` back to itself (`[start, ..., start]`), or [] if there is none."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for w in sorted(graph.get(node, ())):
                if w == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if w not in parent:
                    parent[w] = node
                    nxt.append(w)
        frontier = nxt
    return []
