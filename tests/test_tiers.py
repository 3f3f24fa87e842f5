"""scripts/test.sh's closing table (scripts/test_report.py): each tier's time, exit status and counts from pytest's
own JUnit reports, and the total line CI reads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _junit(path: Path, tests: int, failures: int, errors: int, skipped: int) -> None:
    path.write_text(
        f'<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pytest" '
        f'errors="{errors}" failures="{failures}" skipped="{skipped}" tests="{tests}" time="1.0"/>'
        f"</testsuites>"
    )


def test_tier_table_sums_every_report_and_prints_the_total_line(tmp_path):
    _junit(tmp_path / "01.xml", 10, 0, 0, 2)
    _junit(tmp_path / "02.xml", 5, 1, 1, 0)
    _junit(tmp_path / "03.xml.1.xml", 3, 0, 0, 0)  # a tier of several pytest processes (the emulated CPU's)
    _junit(tmp_path / "03.xml.2.xml", 4, 0, 0, 1)
    rows = [
        ("unit tier", 75, 0, "01.xml"),
        ("integration tests", 610, 1, "02.xml"),
        ("emulated AVX2-only CPU", 3, 0, "03.xml"),
        ("skipped tier", 1, 0, "04.xml"),
    ]  # 04: no report at all
    tsv = tmp_path / "tiers.tsv"
    tsv.write_text("".join(f"{n}\t{s}\t{rc}\t{tmp_path / x}\n" for n, s, rc, x in rows))
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts/test_report.py"), str(tsv), "3725"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert out[-1] == "total: 17 passed, 2 failed, 3 skipped"
    assert out[-2] == "[test] all tiers: 62m05s"
    table = {ln.split("  ")[0].removeprefix("[test] ").strip(): ln.split() for ln in out[1:-2]}
    assert table["unit tier"][-5:] == ["1m15s", "0", "8", "0", "2"]
    assert table["integration tests"][-5:] == ["10m10s", "1", "3", "2", "0"]
    assert table["emulated AVX2-only CPU"][-5:] == ["0m03s", "0", "6", "0", "1"]
    assert table["skipped tier"][-5:] == ["0m01s", "0", "0", "0", "0"]
