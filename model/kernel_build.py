"""Building a native kernel library: compile with g++ per ISA level, verify in a subprocess, cache by content.

    build_kernel(TRAIN_SOURCE)        # KernelBuild: lib, isa ("avx512", ...), reason when off
    build(DECODE_SOURCE, openmp=True)  # path of the .so, or None (no compiler, a failed build, disabled)
    kernel_path()                     # "avx512" / "avx2" / "neon" / "scalar", or "off: <why>"

The sources live next to this file (NATIVE_SOURCES: tasks/store/codeversion.py puts them in the code version
of every stage whose imports reach this module); they are written once against model/simd.h and built per
level (model/cpu.py). The cache, $MSLLM_KERNEL_CACHE (default ~/.cache/msllm/kernels), is keyed by (source
and header bytes, level flags, OpenMP, compiler path and `--version`). It must be ours and not group/world
writable, or the kernels stay off (another user could plant a library we would load). A build is compiled to
a temp file, checked in a subprocess (it loads, exports every `extern "C"` function of the source, and reports
the level it was built for), fsynced, and renamed into place with a sha256 written beside it; a cached library
whose bytes do not match its checksum (truncated, overwritten) is rebuilt, with one line naming it. The first
build or load of each source prints one line to stderr saying which body runs or, when off, why (with the
compiler's stderr when the build failed). Nothing here raises for a missing compiler or a failed build: the
result says why the kernels are off, and the callers keep MindSpore's own ops.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from model.cpu import level, select_isa

HERE = Path(__file__).resolve().parent
NATIVE_SOURCES = (
    "train_kernels.cc",
    "decode_kernel.cc",
    "spin_wait.cc",
    "simd.h",
)  # in the code version (tasks/store/codeversion.py)
TRAIN_SOURCE = HERE / "train_kernels.cc"
DECODE_SOURCE = HERE / "decode_kernel.cc"
SPIN_SOURCE = HERE / "spin_wait.cc"  # model/runtime.py spin_waits
HEADERS = (HERE / "simd.h",)  # included by every source: part of every build key
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-pthread"]
_FORMAT = "msllm-kernel-build-2"


@dataclass(frozen=True)
class KernelBuild:
    source: str  # file name, e.g. "train_kernels.cc"
    lib: str | None  # the verified library, or None
    isa: str | None  # the level built (or that would have been)
    reason: str = ""  # why there is no library

    @property
    def path(self) -> str:
        """What runs, for logs and manifests: the level ("avx512", ...) or "off: <why>"."""
        return self.isa if self.lib else f"off: {self.reason}"


_builds: dict[tuple, KernelBuild] = {}
_compiler_versions: dict[tuple, str | None] = {}


def _say(line: str) -> None:
    print(f"[kernels] {line}", file=sys.stderr, flush=True)


def _compiler_version(cxx: str) -> str | None:
    """First line of `cxx --version` (part of the cache key), or None when it does not run."""
    st = os.stat(cxx)
    k = (cxx, st.st_mtime_ns, st.st_size)
    if k not in _compiler_versions:
        try:
            r = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
            line = r.stdout.splitlines()[0].strip() if r.returncode == 0 and r.stdout.strip() else None
        except (OSError, subprocess.SubprocessError, UnicodeDecodeError):
            line = None
        _compiler_versions[k] = line
    return _compiler_versions[k]


def cache_dir() -> Path:
    return Path(os.environ.get("MSLLM_KERNEL_CACHE") or Path.home() / ".cache" / "msllm" / "kernels")


def _private_cache(cache: Path) -> str:
    """'' when `cache` exists (created 0700 if missing), is ours and is not writable by group or others;
    else why it must not be used."""
    try:
        cache.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = cache.stat()
    except OSError as exc:
        return f"kernel cache {cache} cannot be created ({exc.strerror}); set MSLLM_KERNEL_CACHE to a private directory"
    if not stat.S_ISDIR(st.st_mode):
        return f"kernel cache {cache} is not a directory; set MSLLM_KERNEL_CACHE to a private directory"
    if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (
            f"kernel cache {cache} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}, owner uid "
            f"{st.st_uid}, we are {os.geteuid()}): a library planted there would run in this process; "
            f"`chmod go-w {cache}` (as its owner) or set MSLLM_KERNEL_CACHE to a private directory"
        )
    return ""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def exported_functions(source: Path) -> list[str]:
    """The `extern "C"` functions a source defines: what its library must export."""
    return sorted(set(re.findall(r'extern\s+"C"[^;{(]*?\b([A-Za-z_]\w*)\s*\(', source.read_text())))


_CHECK = (
    "import ctypes, sys\n"
    "lib = ctypes.CDLL(sys.argv[1])\n"
    "for name in sys.argv[3:]:\n"
    "    getattr(lib, name)\n"
    "isa = lib.MsllmKernelIsa\n"
    "isa.restype = ctypes.c_char_p\n"
    "got = isa().decode()\n"
    "sys.exit(0 if got == sys.argv[2] else 'built for ' + got + ', expected ' + sys.argv[2])\n"
)


def _verify(lib: Path, isa: str, symbols: list[str]) -> str:
    """'' when `lib` is an ELF shared library that loads in a fresh process, exports `symbols` and says it runs
    `isa`; else what is wrong. In a subprocess: garbage that crashes the loader crashes only the check."""
    try:
        with open(lib, "rb") as f:
            if f.read(4) != b"\x7fELF":
                return "not an ELF file"
        r = subprocess.run(
            [sys.executable, "-I", "-c", _CHECK, str(lib), isa, *symbols], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot be checked ({exc})"
    if r.returncode != 0:
        err = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        return f"does not load or lacks its functions: {err}"
    return ""


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _stderr_tail(text: str, lines: int = 12) -> str:
    t = [ln for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(t[-lines:]) if t else "(no output)"


def build_kernel(source: Path, openmp: bool = False, isa: str | None = None, say: bool = True) -> KernelBuild:
    """`source` built for `isa` (default: select_isa(), the CPU's best or MSLLM_KERNEL_ISA) and verified, from
    the cache when its checksum matches. Never raises for a missing compiler, a failed build or a bad
    cache: the result says why it is off. `say=False`: no line on stderr (the caller reports)."""
    source = Path(source)
    chosen, why = select_isa(isa)
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    memo = (str(source), openmp, chosen, why, cxx, str(cache_dir()))
    if memo in _builds:
        return _builds[memo]
    result = _build(source, openmp, chosen, why, cxx)
    _builds[memo] = result
    if say and result.lib:
        _say(f"{source.name}: {result.isa} body ({' '.join(level(result.isa).flags)}), {result.lib}")
    elif say:
        _say(f"{source.name}: off, MindSpore's own ops run instead: {result.reason}")
    return result


def _cache_key(source: Path, openmp: bool, isa: str, cxx: str) -> str:
    """16 hex digits over the source and header bytes, the level's flags, OpenMP, the compiler and its version."""
    h = hashlib.sha256(_FORMAT.encode())
    for part in (
        source.read_bytes(),
        *(p.read_bytes() for p in HEADERS),
        "\0".join([cxx, str(_compiler_version(cxx)), *FLAGS, *level(isa).flags, f"openmp={openmp}"]).encode(),
    ):
        h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()[:16]


def _build(source: Path, openmp: bool, isa: str | None, why: str, cxx: str | None) -> KernelBuild:
    name = source.name
    if isa is None:
        return KernelBuild(name, None, None, why)
    if cxx is None:
        return KernelBuild(
            name, None, isa, f"no C++ compiler ({os.environ.get('CXX', 'g++')} is not on PATH; install g++ or set CXX)"
        )
    if not source.is_file():
        return KernelBuild(name, None, isa, f"{source} does not exist")
    version = _compiler_version(cxx)
    if version is None:
        return KernelBuild(name, None, isa, f"{cxx} --version failed: not a working compiler (set CXX)")
    cache = cache_dir()
    if bad := _private_cache(cache):
        return KernelBuild(name, None, isa, bad)
    lv = level(isa)
    flags = [*FLAGS, *lv.flags]
    lib = cache / f"{source.stem}-{isa}-{_cache_key(source, openmp, isa, cxx)}.so"
    sums = lib.with_name(lib.name + ".sha256")
    if lib.exists():
        try:
            ok = sums.read_text().split()[0] == _sha256(lib)
        except (OSError, IndexError):
            ok = False
        if ok:
            return KernelBuild(name, str(lib), isa)
        _say(f"cached kernel library {lib} does not match its checksum {sums.name} (truncated or corrupt): rebuilding")
    symbols = exported_functions(source)
    fd, tmp = tempfile.mkstemp(prefix=lib.name + ".", suffix=".tmp", dir=cache)
    os.close(fd)
    try:
        err = ""
        for extra in (["-fopenmp"], []) if openmp else ([],):
            try:
                r = subprocess.run(
                    [cxx, *flags, *extra, f"-I{HERE}", str(source), "-o", tmp],
                    capture_output=True,
                    text=True,
                    timeout=600,
                )
            except (OSError, subprocess.SubprocessError) as exc:
                return KernelBuild(name, None, isa, f"{cxx} did not run: {exc}")
            if r.returncode == 0:
                break
            err = _stderr_tail(r.stderr)
        else:
            return KernelBuild(
                name, None, isa, f"{Path(cxx).name} failed to build {name} ({' '.join(lv.flags)}): {err}"
            )
        if bad := _verify(Path(tmp), isa, symbols):
            return KernelBuild(
                name, None, isa, f"{Path(cxx).name} exited 0 but its output for {name} {bad}; check the compiler (CXX)"
            )
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        digest = _sha256(Path(tmp))
        os.chmod(tmp, 0o755)
        os.replace(tmp, lib)
        _write_atomic(sums, f"{digest}  {lib.name}\n".encode())
    except OSError as exc:
        return KernelBuild(name, None, isa, f"cannot write to the kernel cache {cache}: {exc}")
    finally:
        Path(tmp).unlink(missing_ok=True)
    return KernelBuild(name, str(lib), isa)


def build(source: Path, openmp: bool = False) -> str | None:
    """Path of `source` compiled (and verified) for this CPU's level, or None: see build_kernel."""
    return build_kernel(source, openmp).lib


def disabled_reason() -> str:
    """Why the kernels are switched off by the environment (MSLLM_FUSED_KERNELS=0), or ''."""
    return "MSLLM_FUSED_KERNELS=0" if os.environ.get("MSLLM_FUSED_KERNELS", "1") == "0" else ""


def kernel_path(source: Path = TRAIN_SOURCE, openmp: bool = False) -> str:
    """Which body of `source` runs in this process: "avx512", "avx2", "neon", "scalar", or "off: <why>" (for
    logs and manifests). Builds on first call, as the ops do."""
    if off := disabled_reason():
        return f"off: {off}"
    return build_kernel(source, openmp).path
