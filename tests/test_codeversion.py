"""Code versions come from the import graph: an edit inside a stage's closure changes its version, one outside does not.

Each test works on a temporary copy of model/, tasks/ and flows/, so editing files
there never touches the working tree.
"""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest

from tasks.store.codeversion import (
    PACKAGES,
    CodeVersionError,
    code_version,
    dynamic_imports,
    import_closure,
    import_graph,
    native_sources,
)

REPO = Path(__file__).resolve().parent.parent
LM_TASK_FILES = ["tasks/stages/evaluate/lm_tasks/*.yaml", "tasks/stages/evaluate/lm_tasks/utils.py"]


@pytest.fixture
def repo_copy(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return root


def _edit(path: Path, text: str = "\n# an edit\n") -> None:
    path.write_text(path.read_text() + text)


def test_data_closure_holds_the_config_it_is_passed(repo_copy):
    # tasks/stages/data/ imports tasks.config only for type checking, but runs PipelineConfig's methods
    assert "tasks/config/schema.py" in import_closure("tasks.stages.data", repo_copy)
    before = code_version("tasks.stages.data", root=repo_copy)
    _edit(repo_copy / "tasks/config/schema.py")
    assert code_version("tasks.stages.data", root=repo_copy) != before


def test_pretrain_closure_follows_function_level_imports(repo_copy):
    closure = import_closure("tasks.stages.pretrain", repo_copy)
    # the MindRecord reader, the loop and the model are reached (some only through imports inside functions)
    for rel in (
        "tasks/stages/pretrain.py",
        "tasks/store/reader.py",
        "tasks/training/trainer.py",
        "tasks/training/step.py",
        "tasks/training/adamw.py",
        "tasks/training/checkpoint.py",
        "model/__init__.py",
        "model/llama.py",
        "model/config.py",
    ):
        assert rel in closure
    assert "tasks/deploy/onnx_generate.py" not in closure
    assert "flows/stages.py" not in closure
    assert closure == sorted(closure)


@pytest.mark.parametrize(
    "rel", ["tasks/store/reader.py", "tasks/training/trainer.py", "model/llama.py", "model/__init__.py"]
)
def test_edit_inside_the_closure_changes_the_version(repo_copy, rel):
    before = code_version("tasks.stages.pretrain", root=repo_copy)
    _edit(repo_copy / rel)
    assert code_version("tasks.stages.pretrain", root=repo_copy) != before


@pytest.mark.parametrize("rel", ["model/train_kernels.cc", "model/decode_kernel.cc", "model/simd.h"])
@pytest.mark.parametrize(
    "module", ["tasks.stages.pretrain", "tasks.stages.finetune", "tasks.stages.evaluate", "tasks.stages.export"]
)
def test_edit_of_a_native_kernel_source_changes_the_version(repo_copy, rel, module):
    # model/kernel_build.py compiles these at run time: every stage that can run them is keyed by them
    assert rel in native_sources(module, repo_copy)
    before = code_version(module, root=repo_copy)
    _edit(repo_copy / rel, "\n// an edit\n")
    assert code_version(module, root=repo_copy) != before


def test_every_native_source_in_model_is_declared():
    # a new .cc/.h beside model/kernel_build.py must be listed in NATIVE_SOURCES, or editing it would not change any key
    on_disk = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "model").iterdir() if p.suffix in (".cc", ".h"))
    assert native_sources("model.kernels", REPO) == on_disk


def test_missing_native_source_is_an_error(repo_copy):
    (repo_copy / "model/simd.h").unlink()
    with pytest.raises(CodeVersionError, match="NATIVE_SOURCES names simd.h"):
        code_version("tasks.stages.pretrain", root=repo_copy)


@pytest.mark.parametrize(
    "rel", ["tasks/deploy/onnx_generate.py", "flows/full_pipeline.py", "tasks/stages/evaluate/lm_tasks/utils.py"]
)
def test_edit_outside_the_closure_keeps_the_version(repo_copy, rel):
    before = code_version("tasks.stages.pretrain", root=repo_copy)
    _edit(repo_copy / rel)
    assert code_version("tasks.stages.pretrain", root=repo_copy) == before


def test_version_does_not_depend_on_where_the_repo_lives(repo_copy, tmp_path):
    other = tmp_path / "elsewhere" / "clone"
    shutil.copytree(repo_copy, other)
    assert code_version("tasks.stages.pretrain", root=other) == code_version("tasks.stages.pretrain", root=repo_copy)
    assert code_version("tasks.stages.pretrain", root=other) == code_version("tasks.stages.pretrain", root=REPO)


def test_declared_data_files_are_hashed(repo_copy):
    before = code_version("tasks.stages.evaluate", LM_TASK_FILES, root=repo_copy)
    assert before != code_version("tasks.stages.evaluate", root=repo_copy)
    _edit(repo_copy / "tasks/stages/evaluate/lm_tasks/local_boolq.yaml")
    assert code_version("tasks.stages.evaluate", LM_TASK_FILES, root=repo_copy) != before


def test_missing_data_file_is_an_error(repo_copy):
    (repo_copy / "tasks/stages/evaluate/lm_tasks/local_piqa.yaml").unlink()
    with pytest.raises(CodeVersionError, match="tasks/stages/evaluate/lm_tasks/local_piqa.yaml does not exist"):
        code_version("tasks.stages.evaluate", ["tasks/stages/evaluate/lm_tasks/local_piqa.yaml"], root=repo_copy)
    with pytest.raises(CodeVersionError, match="match nothing"):
        code_version("tasks.stages.evaluate", ["tasks/stages/evaluate/lm_tasks/*.yml"], root=repo_copy)
    with pytest.raises(CodeVersionError, match="relative to"):
        code_version("tasks.stages.evaluate", ["../outside.yaml"], root=repo_copy)


def test_import_of_a_missing_module_is_an_error(repo_copy):
    _edit(repo_copy / "tasks/training/trainer.py", "\n\ndef later():\n    import tasks.training.no_such_module\n")
    with pytest.raises(
        CodeVersionError, match=r"tasks/training/trainer\.py:\d+: .*no module tasks\.training\.no_such_module"
    ):
        code_version("tasks.stages.pretrain", root=repo_copy)
    # a stage that does not reach the broken file is unaffected
    code_version("tasks.stages.data", root=repo_copy)
    with pytest.raises(CodeVersionError, match="module tasks.nope is not a file"):
        code_version("tasks.nope", root=repo_copy)


def test_deleting_an_imported_module_is_an_error(repo_copy):
    code_version("tasks.stages.pretrain", root=repo_copy)  # parses (and caches) every file of the closure
    (repo_copy / "tasks/training/step.py").unlink()  # the importers' bytes are unchanged
    with pytest.raises(CodeVersionError, match=r"no module tasks\.training\.step"):
        code_version("tasks.stages.pretrain", root=repo_copy)


def test_a_file_that_does_not_parse_is_an_error(repo_copy):
    _edit(repo_copy / "tasks/store/reader.py", "\ndef broken(:\n")
    with pytest.raises(CodeVersionError, match=r"tasks/store/reader\.py:\d+: does not parse"):
        code_version("tasks.stages.pretrain", root=repo_copy)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))


def test_every_import_form_is_an_edge(tmp_path):
    _write(
        tmp_path,
        {
            "model/__init__.py": "from model.config import C\n",
            "model/config.py": "C = 1\n",
            "model/heavy.py": "import numpy\n",
            "tasks/a.py": """
            from __future__ import annotations
            import json
            import tasks.b
            from tasks import c
            from tasks.sub import d as dd
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from tasks import typing_only
            else:
                from tasks import runtime_branch

            def f():
                from . import e
                from .sub.d import thing
                import importlib
                importlib.import_module("tasks.f")
                __import__("tasks.sub", fromlist=["g", "attr"])
                importlib.import_module(".h", "tasks")
                name = "tasks.x"
                importlib.import_module(name)

            class K:
                def m(self):
                    from model.heavy import numpy
            """,
            **{f"tasks/{m}.py": "" for m in ("b", "c", "e", "f", "h", "typing_only", "runtime_branch")},
            "tasks/sub/__init__.py": "from .d import thing\n",
            "tasks/sub/d.py": "thing = 1\n",
            "tasks/sub/g.py": "",
            "flows/__init__.py": "",
        },
    )
    graph = import_graph(tmp_path)
    assert graph["tasks.a"] == {
        "tasks.b",
        "tasks.c",
        "tasks.sub",
        "tasks.sub.d",
        "tasks.runtime_branch",
        "tasks.e",
        "tasks.f",
        "tasks.sub.g",
        "tasks.h",
        "model",
        "model.heavy",
    }
    # a type-only import is no run-time edge (no cycle), but its code is in the closure: callers pass its objects in
    assert import_graph(tmp_path, typing=True)["tasks.a"] == graph["tasks.a"] | {"tasks.typing_only"}
    assert "tasks/typing_only.py" in import_closure("tasks.a", tmp_path)
    assert graph["tasks.sub"] == {"tasks.sub.d"}
    assert graph["model"] == {"model.config"}
    assert graph["model.heavy"] == set()  # no edge from a module to its own package
    assert [(d.module, d.code) for d in dynamic_imports(tmp_path)] == [("tasks.a", "importlib.import_module(name)")]
    # the closure adds the __init__ of every package it passes through
    assert import_closure("model.heavy", tmp_path) == ["model/__init__.py", "model/config.py", "model/heavy.py"]


def test_a_stage_key_follows_the_versions_of_the_libraries_its_code_imports(monkeypatch):
    """Upgrading lm-eval changes eval's code version (so its key: no cache hit with the old scores) and not data's;
    a progress-bar library changes none (issue 54)."""
    import importlib.metadata

    from tasks.store.codeversion import library_versions, stage_code_version

    ev, data = library_versions("tasks.stages.evaluate"), library_versions("tasks.stages.data")
    assert "lm_eval" in ev and "mindspore" in ev and "lm_eval" not in data and "sentencepiece" in data
    assert "tqdm" not in ev and "numpy" in data
    before = {
        s: stage_code_version(s, m) for s, m in (("eval", "tasks.stages.evaluate"), ("data", "tasks.stages.data"))
    }
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "99.0" if d in ("lm_eval", "tqdm") else real(d))
    after = {s: stage_code_version(s, m) for s, m in (("eval", "tasks.stages.evaluate"), ("data", "tasks.stages.data"))}
    assert after["eval"] != before["eval"] and after["data"] == before["data"]
