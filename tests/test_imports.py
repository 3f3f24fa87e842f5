"""The project's import graph (AST, imports inside functions and by literal name included) has no cycles,
and its layers point down only: model/ imports neither tasks/ nor flows/, tasks/ never imports flows/, and the
rooms of tasks/ import only rooms below them (ROOMS), never a private name of another room."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tasks.store.codeversion import PACKAGES, dynamic_imports, import_cycles, import_graph, shortest_cycle

REPO = Path(__file__).resolve().parent.parent

# Imports whose module name is computed at run time: the graph cannot see them, so each one is listed here
# on purpose. (module, code) as `dynamic_imports()` reports it.
KNOWN_DYNAMIC = {
    ("tasks.stages", "importlib.import_module(stage(name).module)"),  # the stage table: each module is a literal there
    ("tasks.runtime.supervise", "importlib.import_module(module)"),  # a stage's child entry, by the table's Stage.entry
}


# The rooms, lowest first; a room imports only rooms of lower tiers (never a sibling of its own tier).
# Each room is a top-level module or package: model/, flows/, or tasks/<room>.
ROOMS: tuple[tuple[str, ...], ...] = (
    ("model",),  # MindSpore only: the decoder, LoRA, generation, weight conversion
    ("config",),  # the pipelines.yaml schema
    ("tokenizer_error",),  # the tokenizer's error class, raised by the two rooms above it
    ("chat_template",),  # a model's Jinja chat template rendered in a sandbox, within time and size limits
    ("tokenizer",),  # one tokenizer interface (SentencePiece or tokenizer.json)
    ("prompts",),  # prompt formats: the instruction template, chat examples
    ("store",),  # artifacts, lineage, model artifacts, tensor files, the data schema and shard reader
    ("runtime",),  # child-process supervisor, msrun launch, rank layout (the mesh)
    ("modeling",),  # building and loading networks, the tensor-parallel split, merging adapters
    ("training", "deploy"),  # the training loop / export formats (ONNX, GGUF) and their checks
    ("stages",),  # the stage table and one module per stage
    ("serving",),  # the HTTP server
    ("cli",),  # the command line
    ("flows",),  # Prefect flows
)
TIER = {room: i for i, tier in enumerate(ROOMS) for room in tier}


def room_of(module: str) -> str:
    """`tasks.stages.export` → stages, `model.llama` → model, `tasks` (the package's docstring) → tasks."""
    parts = module.split(".")
    return parts[1] if parts[0] == "tasks" and len(parts) > 1 else parts[0]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(REPO)


def _layer(module: str) -> str:
    return module.split(".", 1)[0]


def _violations(graph: dict[str, set[str]], src: str, forbidden: set[str]) -> list[str]:
    return sorted(
        f"{m} imports {t}" for m, ts in graph.items() if _layer(m) == src for t in ts if _layer(t) in forbidden
    )


def test_graph_covers_every_module(graph):
    files = {
        p.relative_to(REPO).with_suffix("").as_posix().removesuffix("/__init__").replace("/", ".")
        for pkg in PACKAGES
        for p in (REPO / pkg).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert set(graph) == files


def test_no_import_cycles(graph):
    cycles = import_cycles(graph)
    assert not cycles, "import cycles (each group's modules, then one shortest chain through it):\n" + "\n".join(
        f"  {', '.join(c)}\n    " + " → ".join(shortest_cycle(graph, c[0])) for c in cycles
    )


def test_model_imports_neither_tasks_nor_flows(graph):
    assert _violations(graph, "model", {"tasks", "flows"}) == []


def test_model_cells_are_plain(graph):
    """The model's cells (model/llama.py, model/layers.py) import nothing kernel- or parallel-related: the build's
    convert and parallelize steps (tasks/modeling/build.py, parallelize.py) apply both from outside (issue 34)."""
    kernel_or_parallel = ("model.kernels", "model.kernel_ops", "model.kernel_build", "model.fused_cells", "model.cpu")
    bad = sorted(
        f"{m} imports {t}"
        for m in ("model.llama", "model.layers")
        for t in graph[m]
        if t in kernel_or_parallel or "parallel" in t or "mesh" in t
    )
    assert bad == []


def test_runtime_does_not_import_the_model(graph):
    """tasks/runtime starts processes and holds the rank layout (tasks/runtime/mesh.py: numpy only); the model is
    built in tasks/modeling and trained in tasks/training."""
    bad = sorted(
        f"{m} imports {t}"
        for m, ts in graph.items()
        if room_of(m) == "runtime"
        for t in ts
        if _layer(t) == "model" or room_of(t) == "training"
    )
    assert bad == []


def test_tasks_never_import_flows(graph):
    assert _violations(graph, "tasks", {"flows"}) == []


def test_nothing_imports_the_cli(graph):
    """Stages (and every other room) are imported by the CLI, never the other way round."""
    users = sorted(
        m
        for m, ts in graph.items()
        if not m.startswith("tasks.cli")
        for t in ts
        if t == "tasks.cli" or t.startswith("tasks.cli.")
    )
    assert users == []


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import statement in a file, at any depth (functions, branches included)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def test_cli_reaches_training_and_the_model_only_through_the_stages():
    """tasks/cli imports neither tasks.training nor model (plan, convert and validate --forward included): the
    stage runner and tasks/stages/preflight.py stand between them (issue 34)."""

    def forbidden(module: str) -> bool:
        return module in ("model", "tasks.training") or module.startswith(("model.", "tasks.training."))

    bad = sorted(
        {
            f"{p.relative_to(REPO)}:{line}: {m}"
            for p in (REPO / "tasks" / "cli").rglob("*.py")
            for line, m in _imported_modules(p)
            if forbidden(m)
        }
    )
    assert bad == [], "go through a stage module (tasks/stages/runner.py, preflight.py):\n  " + "\n  ".join(bad)
    assert forbidden("model.registry") and forbidden("tasks.training") and not forbidden("models.x")


def test_inference_never_imports_the_training_room():
    """Serving, export (tasks/deploy and the export stage), eval and predict (the eval stage's lm_adapter) take their
    networks from tasks/modeling: no import of tasks.training at any depth (functions included). The room below
    training cannot reach it either (test_rooms_import_only_lower_rooms), so nothing they import brings it."""

    def training(module: str) -> bool:
        return module == "tasks.training" or module.startswith("tasks.training.")

    files = [
        *(REPO / "tasks" / "serving").rglob("*.py"),
        *(REPO / "tasks" / "deploy").rglob("*.py"),
        *(REPO / "tasks" / "stages" / "evaluate").rglob("*.py"),
        REPO / "tasks" / "stages" / "export.py",
    ]
    bad = sorted(
        {f"{p.relative_to(REPO)}:{line}: {m}" for p in files for line, m in _imported_modules(p) if training(m)}
    )
    assert bad == [], "take the network from tasks/modeling (build_network, load_network, merge):\n  " + "\n  ".join(
        bad
    )
    assert len(files) > 10 and training("tasks.training.trainer") and not training("tasks.training_data")


def test_generators_come_from_the_modeling_room():
    """One generator factory (tasks/modeling/build.py `generator`): the package builds model.generate.Generator there
    only, so the decode path is chosen, logged and reported one way. (Benchmarks and tests may build their own.)"""
    built = sorted(
        f"{p.relative_to(REPO)}:{node.lineno}"
        for top in ("tasks", "flows")
        for p in (REPO / top).rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Generator"
    )
    assert built == [f"tasks/modeling/build.py:{_line_of(REPO / 'tasks/modeling/build.py', 'return Generator(')}"]


def _line_of(path: Path, text: str) -> int:
    return next(n for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if text in line)


def test_rooms_are_all_ranked(graph):
    assert sorted({room_of(m) for m in graph} - set(TIER) - {"tasks"}) == []


def test_rooms_import_only_lower_rooms(graph):
    """Zero upward (or sideways) arrows: each edge between rooms goes to a lower tier."""
    bad = sorted(
        f"{m} ({room_of(m)}) imports {t} ({room_of(t)})"
        for m, ts in graph.items()
        for t in ts
        if room_of(m) != room_of(t) and "tasks" not in (room_of(m), room_of(t)) and TIER[room_of(t)] >= TIER[room_of(m)]
    )
    assert bad == [], "move the helper down to the lower room both use:\n  " + "\n  ".join(bad)


def _private_uses(path: Path, module: str) -> list[str]:
    """`from other_room import _name` and `other_room_module._name` in one file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    here, out, aliases = room_of(module), [], {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and not node.level
            and room_of(node.module) != here
            and node.module.split(".")[0] in ("model", "tasks", "flows")
        ):
            out += [
                f"{module}: from {node.module} import {a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")
            ]
            aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname})
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            target = aliases[node.value.id]
            if target.split(".")[0] in ("model", "tasks", "flows") and room_of(target) != here:
                out.append(f"{module}: {target}.{node.attr}")
    return out


def test_no_private_name_crosses_rooms(graph):
    bad = []
    for module in graph:
        rel = module.replace(".", "/")
        path = REPO / (rel + ".py") if (REPO / (rel + ".py")).is_file() else REPO / rel / "__init__.py"
        bad += _private_uses(path, module)
    assert sorted(bad) == [], "make the name public (it is part of the lower room's API) or move the code"


def test_no_stage_imports_another_stage(graph):
    """Helpers two stages share live below both (store/, training/, ...), not in one of them."""

    def stage_of(m):
        parts = m.split(".")
        return parts[2] if len(parts) > 2 and parts[:2] == ["tasks", "stages"] else None

    bad = sorted(
        f"{m} imports {t}"
        for m, ts in graph.items()
        for t in ts
        if stage_of(m) and stage_of(t) and stage_of(m) != stage_of(t)
    )
    assert bad == []


def test_stage_table_modules_exist_and_expose_the_stage_api():
    from tasks.stages import STAGES

    for s in STAGES.values():
        assert (REPO / (s.module.replace(".", "/") + ".py")).is_file() or (
            REPO / s.module.replace(".", "/") / "__init__.py"
        ).is_file(), s.module
        src = (
            (REPO / (s.module.replace(".", "/") + ".py"))
            if (REPO / (s.module.replace(".", "/") + ".py")).is_file()
            else REPO / s.module.replace(".", "/") / "__init__.py"
        ).read_text()
        for fn in ("def run(", "def stage_key(") if s.name not in ("merged", "convert") else ("def ",):
            assert fn in src, (s.module, fn)
        if s.child:
            assert f"def {s.child}(" in src, (s.module, s.child)


def test_child_entry_points_round_trip_by_dotted_name():
    """The supervisor names a child's entry by the function it was handed; the child resolves the name back."""
    from tasks.modeling.merge import code_version as merged_code_version
    from tasks.runtime.supervise import entry_name, entry_point
    from tasks.stages import STAGES, code_version, stage_module

    for s in STAGES.values():
        if s.child:
            fn = getattr(stage_module(s.name), s.child)
            assert entry_name(fn) == s.entry and entry_point(s.entry) is fn
    with pytest.raises(ValueError, match="expected tasks"):
        entry_point("os:system")
    assert merged_code_version() == code_version("merged")  # the merge module keys itself as the table does


def test_no_unlisted_dynamic_imports():
    found = {(d.module, d.code) for d in dynamic_imports(REPO)}
    new = sorted(found - KNOWN_DYNAMIC)
    assert not new, (
        "imports by a computed name hide an edge from the graph (and from code versions); import by "
        "literal name, or list the import in KNOWN_DYNAMIC with a why: " + ", ".join(map(str, new))
    )


def test_cycle_finder():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"a"}, "b": set()}) == [["a"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
    assert import_cycles({"x": {"y"}, "y": {"x"}, "p": {"q"}, "q": {"p", "x"}}) == [["p", "q"], ["x", "y"]]
    assert shortest_cycle({"a": {"b", "c"}, "b": {"c"}, "c": {"a"}}, "a") == ["a", "c", "a"]
    assert shortest_cycle({"a": {"a"}}, "a") == ["a", "a"]
    assert shortest_cycle({"a": {"b"}, "b": set()}, "a") == []


REEXPORTS_ALLOWED: set[str] = set()  # no module re-exports another's names; nothing may join this
SOURCE_DIRS = ("model", "tasks", "flows", "scripts", "tests")


def _defined_names(tree: ast.Module) -> set[str]:
    """The names a module binds itself at its top level (def, class, assignment, for/with target; inside top-level
    if/try/with blocks too); an import binds a name but defines nothing."""
    names: set[str] = set()

    def bind(target: ast.AST) -> None:
        names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))

    def visit(body: list[ast.stmt]) -> None:
        for s in body:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(s.name)
            elif isinstance(s, ast.Assign):
                for t in s.targets:
                    bind(t)
            elif isinstance(s, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)):
                bind(s.target)
            elif isinstance(s, (ast.With, ast.AsyncWith)):
                for item in s.items:
                    if item.optional_vars is not None:
                        bind(item.optional_vars)
            if isinstance(s, ast.Try):
                for h in s.handlers:
                    visit(h.body)
            for block in ("body", "orelse", "finalbody"):
                if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(getattr(s, block, []))

    visit(tree.body)
    return names


def _reexport_imports() -> list[str]:
    """Every `from M import n` (module level or in a function) of the project's source and tests where M is a
    project module that does not define n itself (nor has a submodule n)."""
    files = {
        p.relative_to(REPO).with_suffix("").as_posix().removesuffix("/__init__").replace("/", "."): p
        for d in SOURCE_DIRS
        for p in (REPO / d).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    trees = {m: ast.parse(p.read_text(encoding="utf-8")) for m, p in files.items()}
    defined = {m: _defined_names(t) for m, t in trees.items()}

    def source_of(module: str, node: ast.ImportFrom) -> str | None:
        if node.level:  # relative: from the importing module's package, `level - 1` packages up
            package = module.split(".")[: None if files[module].name == "__init__.py" else -1]
            base = package[: len(package) - node.level + 1]
            name = ".".join(base + ([node.module] if node.module else []))
        else:
            name = node.module
        if name in files:
            return name
        sibling = module.rsplit(".", 1)[0] + "." + name  # scripts/bench/ and tests/ import their neighbours by name
        return sibling if sibling in files and module.split(".")[0] in ("scripts", "tests") else None

    bad = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            src = source_of(module, node)
            if src is None or src in REEXPORTS_ALLOWED:
                continue
            bad += [
                f"{files[module].relative_to(REPO)}:{node.lineno}: from {node.module or '.'} import {a.name}"
                for a in node.names
                if a.name not in defined[src] and f"{src}.{a.name}" not in files
            ]
    return sorted(bad)


def test_every_name_is_imported_from_the_module_that_defines_it():
    """One definition site per name (issue 34 item 4): nobody imports a name from a module that merely imports it
    (no re-export shims, no `__all__` of another module's names, no `*`)."""
    bad = _reexport_imports()
    assert bad == [], "import each name from the module that defines it:\n  " + "\n  ".join(bad)


def test_python_embedded_in_shell_scripts_imports_names_where_they_are_defined():
    """The same rule for the Python that scripts/*.sh and .ci/run run inline (`python -c "from M import n"`, heredocs):
    the AST test above does not see it, and CI's capped-AVX2 step broke on a removed re-export there."""
    import re

    files = {
        p.relative_to(REPO).with_suffix("").as_posix().removesuffix("/__init__").replace("/", "."): p
        for d in ("model", "tasks", "flows")
        for p in (REPO / d).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    defined = {m: _defined_names(ast.parse(p.read_text(encoding="utf-8"))) for m, p in files.items()}
    pattern = re.compile(r"from ((?:model|tasks|flows)(?:\.\w+)*) import ([\w, ]+)")
    bad = []
    for script in [*(REPO / "scripts").glob("*.sh"), REPO / ".ci" / "run"]:
        for n, line in enumerate(script.read_text().splitlines(), 1):
            for module, names in pattern.findall(line):
                for name in (x.strip().split(" as ")[0] for x in names.split(",") if x.strip()):
                    if module not in files or (name not in defined[module] and f"{module}.{name}" not in files):
                        bad.append(f"{script.relative_to(REPO)}:{n}: from {module} import {name}")
    assert bad == [], "import each name from the module that defines it:\n  " + "\n  ".join(bad)


def test_reexport_check_sees_through_blocks_and_submodules():
    tree = ast.parse(
        "import os\nfrom a import b\nif os:\n    X = 1\n    def f(): pass\nelse:\n    class K: pass\n"
        "try:\n    import c\nexcept ImportError:\n    c = None\nfor i, (j, k) in []: pass\n"
        "with open(0) as fh: pass\n_T: int = 0\n"
    )
    assert _defined_names(tree) == {"X", "f", "K", "c", "i", "j", "k", "fh", "_T"}


# ---- imports at module top, except a documented lazy boundary (issue 34 item 4)

# Third-party packages too slow to load where a light module does not need them yet (measured: `import tasks.cli` takes
# ~0.25 s and loads none of them; times on the 2-core dev machine, after NumPy where the package needs it).
HEAVY = {
    "mindspore",  # 1.5 s
    "numpy",  # 0.1 s: the CLI does not load it (ml_dtypes and safetensors.numpy load it too: NEEDS_NUMPY)
    "lm_eval",
    "datasets",
    "torch",
    "transformers",  # ~1 s each (lm_eval with its task index)
    "prefect",
    "prefect_dask",  # 1.5 s; Dask +0.5 s over Prefect
    "matplotlib",
    "fastapi",
    "uvicorn",
    "onnx",
    "onnxruntime",
    "onnxruntime_genai",  # 0.1-0.4 s
    "gguf",
    "tensorboard",
    "jinja2",
    "tqdm",
    "psutil",
    "sentencepiece",
    "tokenizers",
}  # 10-170 ms
NEEDS_NUMPY = {"ml_dtypes", "safetensors"}

# Modules that must import fast and without MindSpore, and everything they import at module level: there an import
# of a heavy package (or of a project module that loads one at its top) stays inside the function that needs it.
LIGHT_ROOTS = {
    "tasks.cli",
    "tasks.config",  # `msllm` and config validation: pipelines.yaml checked in milliseconds
    "model.config",
    "model.registry",  # the config schema checks model names without MindSpore
    "tasks.stages",  # the stage table; each stage module (STAGES) too: the CLI and the flows import its run/stage_key
    "tasks.deploy.onnx_generate",  # needs numpy + onnxruntime only (its copy in an export artifact runs standalone)
    "tasks.deploy.checks",  # onnxruntime-genai's checks run without MindSpore
    "tasks.serving.backends",  # an export is served on onnxruntime alone, a model artifact on MindSpore alone
}
LIGHT_PACKAGES = ("tasks.cli.", "tasks.config.", "tasks.store.")  # every module under these

# Function-level imports that are neither of the above, each with its reason: (file, imported module).
LAZY_ALLOWED = {
    ("flows/full_pipeline.py", "flows.data_dask"),  # Dask (prefect-dask) loads only for data.executor: dask
}
# TODO(other engineer): these files still import light modules inside functions; remove each entry once fixed.
LAZY_TODO_FILES: set[str] = set()


def _module_imports() -> tuple[dict[str, Path], dict[str, tuple[set[str], list[tuple[int, str, set[str]]]]]]:
    """{module: path}, {module: (module-level targets, [(line, module, targets) of each import in a function])};
    targets include parent packages (importing a.b.c runs a and a.b) and `from a import sub` submodules. Imports
    under `if TYPE_CHECKING:` never run and are skipped."""
    files = {
        p.relative_to(REPO).with_suffix("").as_posix().removesuffix("/__init__").replace("/", "."): p
        for pkg in PACKAGES
        for p in (REPO / pkg).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    out = {}
    for mod, path in files.items():
        top: set[str] = set()
        inner: list[tuple[int, str, set[str]]] = []

        def targets(node: ast.Import | ast.ImportFrom) -> tuple[str, set[str]]:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                package = mod.split(".")[: None if path.name == "__init__.py" else -1]
                base = (
                    node.module
                    if not node.level
                    else ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                )
                names = [base] + [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in files]
            name = names[1] if len(names) > 1 else names[0]  # `from pkg import submodule` names the submodule
            return name, {".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 2)}

        def visit(node: ast.AST, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and "TYPE_CHECKING" in (
                    getattr(child.test, "id", None),
                    getattr(child.test, "attr", None),
                ):
                    continue
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    name, ts = targets(child)
                    if in_function:
                        inner.append((child.lineno, name, ts))
                    else:
                        top.update(ts)
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

        visit(ast.parse(path.read_text(encoding="utf-8")), False)
        out[mod] = (top, inner)
    return files, out


@pytest.fixture(scope="module")
def lazy_import_report() -> tuple[list[str], set[str], dict[str, set[str]]]:
    """(offenders "file:line: module", the light modules, {module: heavy packages it loads at import})."""
    from tasks.stages import STAGES

    files, imports = _module_imports()
    heavy: dict[str, set[str]] = {}

    def heavy_of(name: str) -> set[str]:
        if name not in files:
            top = name.split(".")[0]
            return ({top} & HEAVY) | ({"numpy"} if top in NEEDS_NUMPY else set())
        if name not in heavy:
            heavy[name] = set()  # a cycle's second visit adds nothing
            heavy[name] = set().union(*map(heavy_of, imports[name][0]))
        return heavy[name]

    roots = LIGHT_ROOTS | {s.module for s in STAGES.values()} | {m for m in files if m.startswith(LIGHT_PACKAGES)}
    light, todo = set(), sorted(roots)
    while todo:
        m = todo.pop()
        if m in files and m not in light:
            light.add(m)
            todo += imports[m][0]
    bad = []
    for m in sorted(files):
        rel = files[m].relative_to(REPO).as_posix()
        for line, name, ts in imports[m][1]:
            adds = set().union(*map(heavy_of, ts)) - heavy_of(m)  # heavy packages this import would add at the top
            if not (m in light and adds) and (rel, name) not in LAZY_ALLOWED:
                bad.append(f"{rel}:{line}: {name}")
    return bad, light, {m: heavy_of(m) for m in files}


def test_imports_are_at_module_top_except_the_lazy_boundary(lazy_import_report):
    """An import inside a function is one of: in a light module (LIGHT_ROOTS and what they import at their top), of a
    HEAVY package or a project module that loads one the importer does not load already; or listed in LAZY_ALLOWED
    with its reason. Everything else goes to the module's top, where a reader sees what the module depends on."""
    bad, light, _ = lazy_import_report
    todo = {b.split(":")[0] for b in bad} & LAZY_TODO_FILES
    bad = [b for b in bad if b.split(":")[0] not in LAZY_TODO_FILES]
    assert bad == [], (
        "move these imports to the module's top (or, for a real lazy boundary, add the package to HEAVY "
        "or the pair to LAZY_ALLOWED with the reason):\n  " + "\n  ".join(bad)
    )
    assert todo == LAZY_TODO_FILES, f"no lazy imports left to fix in {sorted(LAZY_TODO_FILES - todo)}: remove them"
    assert {"tasks.cli", "tasks.stages.pretrain", "tasks.store.artifacts", "model.config"} <= light


def test_the_cli_loads_no_heavy_package(lazy_import_report):
    """`import tasks.cli` loads nothing on the HEAVY list (NumPy included): `msllm --help` and config validation stay
    ~0.25 s. (tests/test_config.py checks MindSpore in a fresh interpreter; this one names the import that adds it.)"""
    _, _, heavy = lazy_import_report
    assert heavy["tasks.cli"] == set()
    assert heavy["tasks.stages.pretrain"] and "mindspore" not in heavy["tasks.stages.pretrain"]
