"""tests/native/kernel_harness.cc: each ISA body of model/train_kernels.cc against the scalar body, in C++.

The aarch64 NEON body is cross-compiled (aarch64-linux-gnu-g++) with model/cpu.py's own level flags
and run under qemu-aarch64: numerical agreement only, no speed (an emulator says nothing about that).
Skipped, with the reason, where those tools are not installed (Debian: g++-aarch64-linux-gnu qemu-user).
The same harness runs natively for the x86 bodies this CPU can run. Compiling takes seconds: integration.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from model.cpu import LEVELS, cpu_levels
from model.kernel_build import FLAGS, HERE, TRAIN_SOURCE

pytestmark = pytest.mark.integration
HARNESS = Path(__file__).with_name("native") / "kernel_harness.cc"
CXX = shutil.which(os.environ.get("CXX", "g++"))
CROSS, QEMU = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")


def _flags(machine: str, isa: str) -> list[str]:
    return [*FLAGS, *next(lv for lv in LEVELS[machine] if lv.name == isa).flags, f"-I{HERE}"]


def _harness(cxx: str, machine: str, body: str, tmp: Path) -> list[str]:
    libs = []
    for isa in (body, "scalar"):
        out = tmp / f"{machine}-{isa}.so"
        subprocess.run([cxx, *_flags(machine, isa), str(TRAIN_SOURCE), "-o", str(out)], check=True, timeout=600)
        libs.append(str(out))
    exe = tmp / f"harness-{machine}"
    subprocess.run([cxx, "-O2", "-std=c++17", str(HARNESS), "-o", str(exe), "-ldl"], check=True, timeout=600)
    return [str(exe), *libs]


def _passed(r: subprocess.CompletedProcess) -> None:
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    assert r.returncode == 0 and last.endswith(" passed, 0 failed"), r.stdout + r.stderr


@pytest.mark.skipif(
    not (CROSS and QEMU),
    reason="needs aarch64-linux-gnu-g++ and qemu-aarch64 (apt-get install g++-aarch64-linux-gnu qemu-user)",
)
def test_neon_body_matches_scalar_under_qemu(tmp_path):
    cmd = _harness(CROSS, "aarch64", "neon", tmp_path)
    sysroot = "/usr/aarch64-linux-gnu"
    r = subprocess.run([QEMU, "-L", sysroot, *cmd], capture_output=True, text=True, timeout=600)
    assert "body neon vs scalar" in r.stdout
    _passed(r)


@pytest.mark.skipif(CXX is None or os.uname().machine != "x86_64", reason="needs g++ on x86_64")
@pytest.mark.parametrize("isa", [i for i in ("avx512", "avx2") if i in cpu_levels()])
def test_x86_body_matches_scalar_natively(tmp_path, isa):
    r = subprocess.run(_harness(CXX, "x86_64", isa, tmp_path), capture_output=True, text=True, timeout=600)
    assert f"body {isa} vs scalar" in r.stdout
    _passed(r)
