"""The layout table (docs/ARCHITECTURE.md, "## Layout") is the tree as it is: every folder of tracked source files is in it
(directly or under a listed parent that names it), and every path it lists exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TABLE = REPO / "docs" / "ARCHITECTURE.md"


def _table() -> list[str]:
    text = TABLE.read_text(encoding="utf-8")
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+)` \|", section, flags=re.M)


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [ln for ln in out.splitlines() if ln]


def test_every_listed_path_exists():
    listed = _table()
    assert listed, "no layout table in docs/ARCHITECTURE.md"
    missing = [p for p in listed if not (REPO / p.rstrip("/")).exists()]
    assert missing == []


def test_every_source_folder_and_top_level_entry_is_listed():
    listed = {p.rstrip("/") for p in _table()}
    files = _tracked()
    tops = {f.split("/", 1)[0] for f in files if f not in ("README.md", ".gitignore", "pyproject.toml",
                                                          "requirements.lock")}
    assert sorted(t for t in tops if t not in listed and not any(p.startswith(t + "/") for p in listed)) == []
    # every package folder under tasks/ is a room of the table (or a sub-folder a row names)
    rooms = {str(Path(f).parent) for f in files if f.startswith("tasks/") and f.endswith((".py", ".yaml"))}
    unlisted = sorted(r for r in rooms if r not in listed and not any(q.startswith(r + "/") for q in listed) and not any(
        r.startswith(p + "/") and f"`{r[len(p) + 1:].split('/')[0]}/`" in _row(p) for p in listed))
    assert unlisted == []


def _row(path: str) -> str:
    text = TABLE.read_text(encoding="utf-8")
    m = re.search(rf"^\| `{re.escape(path)}/?` \|(.*)$", text, flags=re.M)
    return m.group(1) if m else ""
