"""The closing table of scripts/test.sh: each tier's time, exit status and counts (from the JUnit reports pytest
wrote), then the whole run's `total: N passed, N failed, N skipped` line.

    python scripts/test_report.py TIERS.TSV ELAPSED_SECONDS

TIERS.TSV: one line per tier, `name<TAB>seconds<TAB>exit status<TAB>report path`; a tier that ran several pytest
processes wrote PATH.1.xml, PATH.2.xml, ... beside PATH; a tier that ran none (skipped: no AVX2, no qemu-user)
counts nothing. The reports are pytest's own files from this run (xml.etree, no entity expansion involved).
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def counts(report: Path) -> dict[str, int]:
    """passed / failed / skipped over every <testsuite> of the JUnit files at `report` (and `report`.N.xml)."""
    out = {"passed": 0, "failed": 0, "skipped": 0}
    for f in [report, *sorted(report.parent.glob(report.name + ".*.xml"))]:
        if not f.is_file():
            continue
        root = ET.parse(f).getroot()
        for suite in [root] if root.tag == "testsuite" else root.iter("testsuite"):
            n, fail, err, skip = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
            out["passed"] += n - fail - err - skip
            out["failed"] += fail + err
            out["skipped"] += skip
    return out


def mmss(seconds: int) -> str:
    return f"{seconds // 60}m{seconds % 60:02d}s"


def main(tsv: str, elapsed: str) -> int:
    rows = [line.split("\t") for line in Path(tsv).read_text().splitlines() if line.strip()]
    total = {"passed": 0, "failed": 0, "skipped": 0}
    print("[test] tier                                        time     exit  passed  failed  skipped")
    for name, seconds, rc, report in rows:
        c = counts(Path(report))
        for k in total:
            total[k] += c[k]
        print(f"[test] {name:<43} {mmss(int(seconds)):>8} {rc:>5} {c['passed']:>7} {c['failed']:>7} {c['skipped']:>8}")
    print(f"[test] all tiers: {mmss(int(elapsed))}")
    print(f"total: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
