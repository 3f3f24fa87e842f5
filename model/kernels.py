"""Native kernels as MindSpore custom ops on CPU: built with g++ on first use, optional everywhere.

    lib = build(Path("model/train_kernels.cc"))   # path of the .so, or None (no compiler, a failed build, disabled)
    build_kernel(TRAIN_SOURCE)                    # KernelBuild: lib, isa ("avx512", ...), reason when off
    kernel_path()                                 # "avx512" / "avx2" / "neon" / "scalar", or "off: <why>"
    enabled(setting, Capabilities("CPU", "fp32"))  # THE decision: asked by the model, optimizer, memory plan, decoder
    k = train_ops()                               # the fused train-step ops, or None: callers keep MindSpore's own ops
    probs = k.causal_softmax(scores)              # [N, T, S] -> [N, T, S]

`ops.Custom(..., func_type="aot")` runs a C++ function inside the compiled graph like any kernel. The
sources live next to this file (NATIVE_SOURCES; tasks/store/codeversion.py puts them in the code version
of every stage whose imports reach this module). They are written once against model/simd.h and built
per ISA LEVEL with fixed flags (-march=x86-64-v4 for the AVX-512 body, x86-64-v3 for AVX2+FMA,
armv8.2-a for NEON, -DMSLLM_SCALAR for the scalar reference), so one cached build serves every machine
of a level; `cpu_levels()` (the one hardware probe: /proc/cpuinfo) says which levels this CPU runs and
the best is loaded. MSLLM_KERNEL_ISA=avx2|avx512|neon|scalar forces a level (tests, benchmarks); a level
the CPU cannot run turns the kernels off, saying why.

The cache, $MSLLM_KERNEL_CACHE (default ~/.cache/msllm/kernels), is keyed by (source and header bytes,
level flags, OpenMP, compiler path and `--version`). It must be ours and not group/world writable, or the
kernels stay off (another user could plant a library we would load). A build is compiled to a temp
file, checked in a subprocess (it loads, exports every `extern "C"` function of the source, and reports
the level it was built for), fsynced, and renamed into place with a sha256 written beside it; a cached
library whose bytes do not match its checksum (truncated, overwritten) is rebuilt, with one line naming
it. The first build or load of each source prints one line to stderr saying which body runs or, when
off, why (with the compiler's stderr when the build failed). Without g++ (or with MSLLM_FUSED_KERNELS=0)
nothing is built and the model runs on MindSpore's built-in kernels: the same math, slower
(docs/MINDSPORE_CPU.md).

Every kernel checks its operands and returns a code on a mismatch (KERNEL_ERRORS); the ops below also
check shapes and dtypes when MindSpore infers the graph, so a wrong call fails there with a message
naming the op and the operand (KernelShapeError), before any kernel runs.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
NATIVE_SOURCES = ("train_kernels.cc", "decode_kernel.cc", "simd.h")  # in the code version (tasks/store/codeversion.py)
TRAIN_SOURCE = HERE / "train_kernels.cc"
DECODE_SOURCE = HERE / "decode_kernel.cc"
HEADERS = (HERE / "simd.h",)  # included by every source: part of every build key
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-pthread"]
_FORMAT = "msllm-kernel-build-2"

KERNEL_ERRORS = {1: "wrong number of operands", 2: "wrong dtype (float32 tensors, int32 labels/offsets/tokens)",
                 3: "operand shapes do not match", 4: "a token or position out of range"}


@dataclass(frozen=True)
class Level:
    name: str
    machine: str           # platform.machine() family: "x86_64" or "aarch64"
    flags: tuple[str, ...]
    cpu_flags: frozenset[str]  # what /proc/cpuinfo must list for code built with `flags` to run


_X86_V2 = {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}
_X86_V3 = _X86_V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}  # abm: LZCNT
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
LEVELS = {  # best first per machine
    "x86_64": (Level("avx512", "x86_64", ("-march=x86-64-v4",), frozenset(_X86_V4)),
               Level("avx2", "x86_64", ("-march=x86-64-v3",), frozenset(_X86_V3)),
               Level("scalar", "x86_64", ("-march=x86-64", "-DMSLLM_SCALAR"), frozenset())),
    "aarch64": (Level("neon", "aarch64", ("-march=armv8.2-a",), frozenset({"asimd", "fp", "atomics", "asimdrdm"})),
                Level("scalar", "aarch64", ("-march=armv8-a", "-DMSLLM_SCALAR"), frozenset())),
}
ISA_NAMES = ("avx512", "avx2", "neon", "scalar")


def _machine(machine: str | None = None) -> str:
    m = (machine or platform.machine()).lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def _read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags: the `flags` (x86) or `Features` (aarch64) line of /proc/cpuinfo (or of
    `cpuinfo`); empty where there is none. The one hardware probe: the kernel levels, the trainer's
    theoretical peak (tasks/training/hardware.py) and the benchmarks' labels (scripts/bench/host.py) read it."""
    if cpuinfo is None:
        cpuinfo = _read_cpuinfo()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip().lower() in ("flags", "features"):
            return set(value.split())
    return set()


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's name from the same /proc/cpuinfo: `model name` (x86), else `Hardware` / `CPU part`
    (aarch64), else platform.processor() or the machine; for labelling measurements."""
    if cpuinfo is None:
        cpuinfo = _read_cpuinfo()
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip().lower(), value.strip())
    for key in ("model name", "hardware", "cpu part"):
        if fields.get(key):
            return fields[key]
    return platform.processor() or _machine()


def cpu_levels(cpuinfo: str | None = None, machine: str | None = None) -> tuple[str, ...]:
    """The ISA levels this CPU can run, best first (("avx512", "avx2", "scalar") on an AVX-512 x86), from
    cpu_flags(cpuinfo) and the machine (platform.machine(), or `machine`)."""
    levels = LEVELS.get(_machine(machine))
    if levels is None:
        return ()  # no kernel body for this architecture
    have = cpu_flags(cpuinfo)
    return tuple(lv.name for lv in levels if lv.cpu_flags <= have)


def select_isa(override: str | None = None, cpuinfo: str | None = None, machine: str | None = None) -> tuple[str | None, str]:
    """(level, "") to build, or (None, why not). `override` (default $MSLLM_KERNEL_ISA) forces a level."""
    override = os.environ.get("MSLLM_KERNEL_ISA", "") if override is None else override
    m = _machine(machine)
    runs = cpu_levels(cpuinfo, m)
    if not runs:
        return None, f"no kernel body for this architecture ({m}; bodies: x86_64, aarch64)"
    if override:
        if override not in ISA_NAMES:
            return None, f"MSLLM_KERNEL_ISA={override} is not one of {', '.join(ISA_NAMES)}"
        if override not in runs:
            return None, f"MSLLM_KERNEL_ISA={override}: this CPU ({m}) cannot run it (it runs {', '.join(runs)})"
        return override, ""
    return runs[0], ""


def _level(isa: str, machine: str | None = None) -> Level:
    return next(lv for lv in LEVELS[_machine(machine)] if lv.name == isa)


@dataclass(frozen=True)
class KernelBuild:
    source: str            # file name, e.g. "train_kernels.cc"
    lib: str | None        # the verified library, or None
    isa: str | None        # the level built (or that would have been)
    reason: str = ""       # why there is no library

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
        return (f"kernel cache {cache} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}, owner uid "
                f"{st.st_uid}, we are {os.geteuid()}): a library planted there would run in this process; "
                f"`chmod go-w {cache}` (as its owner) or set MSLLM_KERNEL_CACHE to a private directory")
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


_CHECK = ("import ctypes, sys\n"
          "lib = ctypes.CDLL(sys.argv[1])\n"
          "for name in sys.argv[3:]:\n"
          "    getattr(lib, name)\n"
          "isa = lib.MsllmKernelIsa\n"
          "isa.restype = ctypes.c_char_p\n"
          "got = isa().decode()\n"
          "sys.exit(0 if got == sys.argv[2] else 'built for ' + got + ', expected ' + sys.argv[2])\n")


def _verify(lib: Path, isa: str, symbols: list[str]) -> str:
    """'' when `lib` is an ELF shared library that loads in a fresh process, exports `symbols` and says it runs
    `isa`; else what is wrong. In a subprocess: garbage that crashes the loader crashes only the check."""
    try:
        with open(lib, "rb") as f:
            if f.read(4) != b"\x7fELF":
                return "not an ELF file"
        r = subprocess.run([sys.executable, "-I", "-c", _CHECK, str(lib), isa, *symbols],
                           capture_output=True, text=True, timeout=120)
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


def build_kernel(source: Path, openmp: bool = False, isa: str | None = None) -> KernelBuild:
    """`source` built for `isa` (default: select_isa(), the CPU's best or MSLLM_KERNEL_ISA) and verified, from
    the cache when its checksum matches. Never raises for a missing compiler, a failed build or a bad
    cache: the result says why it is off."""
    source = Path(source)
    chosen, why = select_isa(isa)
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    memo = (str(source), openmp, chosen, why, cxx, str(cache_dir()))
    if memo in _builds:
        return _builds[memo]
    result = _build(source, openmp, chosen, why, cxx)
    _builds[memo] = result
    if result.lib:
        _say(f"{source.name}: {result.isa} body ({' '.join(_level(result.isa).flags)}), {result.lib}")
    else:
        _say(f"{source.name}: off, MindSpore's own ops run instead: {result.reason}")
    return result


def _cache_key(source: Path, openmp: bool, isa: str, cxx: str) -> str:
    """16 hex digits over the source and header bytes, the level's flags, OpenMP, the compiler and its version."""
    h = hashlib.sha256(_FORMAT.encode())
    for part in (source.read_bytes(), *(p.read_bytes() for p in HEADERS),
                 "\0".join([cxx, str(_compiler_version(cxx)), *FLAGS, *_level(isa).flags, f"openmp={openmp}"]).encode()):
        h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()[:16]


def _build(source: Path, openmp: bool, isa: str | None, why: str, cxx: str | None) -> KernelBuild:
    name = source.name
    if isa is None:
        return KernelBuild(name, None, None, why)
    if cxx is None:
        return KernelBuild(name, None, isa, f"no C++ compiler ({os.environ.get('CXX', 'g++')} is not on PATH; "
                                             f"install g++ or set CXX)")
    if not source.is_file():
        return KernelBuild(name, None, isa, f"{source} does not exist")
    version = _compiler_version(cxx)
    if version is None:
        return KernelBuild(name, None, isa, f"{cxx} --version failed: not a working compiler (set CXX)")
    cache = cache_dir()
    if bad := _private_cache(cache):
        return KernelBuild(name, None, isa, bad)
    level = _level(isa)
    flags = [*FLAGS, *level.flags]
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
        for extra in ((["-fopenmp"], []) if openmp else ([],)):
            try:
                r = subprocess.run([cxx, *flags, *extra, f"-I{HERE}", str(source), "-o", tmp], capture_output=True,
                                   text=True, timeout=600)
            except (OSError, subprocess.SubprocessError) as exc:
                return KernelBuild(name, None, isa, f"{cxx} did not run: {exc}")
            if r.returncode == 0:
                break
            err = _stderr_tail(r.stderr)
        else:
            return KernelBuild(name, None, isa, f"{Path(cxx).name} failed to build {name} ({' '.join(level.flags)}): {err}")
        if bad := _verify(Path(tmp), isa, symbols):
            return KernelBuild(name, None, isa, f"{Path(cxx).name} exited 0 but its output for {name} {bad}; "
                                                f"check the compiler (CXX)")
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


@dataclass(frozen=True)
class Capabilities:
    """What the place that would run a kernel offers: the device and the compute dtype."""

    device_target: str = "CPU"
    compute: str = "fp32"
    """"fp32", or "fp16"/"bf16" (half-precision compute: the fused kernels are fp32 only)."""


def off_reason(config: bool, capabilities: Capabilities = Capabilities(), kind: str = "train") -> str:
    """Why the native kernels of `kind` ("train": the model's fused ops and the in-place AdamW; "decode": the
    fused decode step) do not run, or '' when they do (subject only to building: no compiler or a failed build
    then falls back to MindSpore's own ops, same math). `config` is the setting: train.fused_kernels for
    training, eval.fused_kernels for decoding. The one place this decision is made."""
    if not config:
        return f"{'train' if kind == 'train' else 'eval'}.fused_kernels is false"
    for var in (("MSLLM_FUSED_DECODE",) if kind == "decode" else ()) + ("MSLLM_FUSED_KERNELS",):
        if os.environ.get(var, "1") == "0":
            return f"{var}=0"
    if capabilities.device_target != "CPU":
        return f"device_target {capabilities.device_target} (the kernels are CPU custom ops)"
    if capabilities.compute != "fp32":
        return f"{capabilities.compute} compute (the fused kernels are fp32)"
    return ""


def enabled(config: bool, capabilities: Capabilities = Capabilities(), kind: str = "train") -> bool:
    """Whether the native kernels of `kind` are asked for: the model, the optimizer, the memory plan, the
    decoder and the server all ask this (see `off_reason`)."""
    return not off_reason(config, capabilities, kind)


def kernel_path(source: Path = TRAIN_SOURCE, openmp: bool = False) -> str:
    """Which body of `source` runs in this process: "avx512", "avx2", "neon", "scalar", or "off: <why>" (for
    logs and manifests). Builds on first call, as the ops do."""
    if off := disabled_reason():
        return f"off: {off}"
    return build_kernel(source, openmp).path


class KernelShapeError(ValueError):
    """A fused op called with operands its kernel does not accept (raised when MindSpore infers the graph)."""


def _need(ok: bool, op: str, what: str) -> None:
    if not ok:
        raise KernelShapeError(f"fused kernel {op}: {what}")


def dtype_of(t):
    """The element dtype of what MindSpore hands a dtype function (`Tensor[Float32]` or `Float32`)."""
    return t.element_type() if hasattr(t, "element_type") else t


def _f32(op: str, names: str, dtypes) -> None:
    import mindspore as ms

    for n, t in zip(names.split(), dtypes):
        _need(dtype_of(t) == ms.float32, op, f"{n} must be float32, got {dtype_of(t)}")


def _check_causal(op, *shapes):
    _need(len(shapes[0]) == 3, op, f"scores must be [N, T, S], got shape {list(shapes[0])}")
    _need(shapes[0][1] <= shapes[0][2], op, f"T = {shapes[0][1]} queries exceed S = {shapes[0][2]} keys "
                                            f"(the queries are the last T of the S positions: T <= S)")
    for s in shapes[1:]:
        _need(list(s) == list(shapes[0]), op, f"operands must have one shape, got {list(shapes[0])} and {list(s)}")
    return shapes[0]


def _check_same(op, *shapes):
    for s in shapes[1:]:
        _need(list(s) == list(shapes[0]), op, f"operands must have one shape, got {list(shapes[0])} and {list(s)}")
    return shapes[0]


def _check_rms(op, x, w, eps, dy=None):
    _need(len(x) >= 1 and x[-1] > 0, op, f"x must be [..., H] with H > 0, got {list(x)}")
    _need(_numel(w) == x[-1], op, f"weight must have H = {x[-1]} elements, got shape {list(w)}")
    _need(_numel(eps) == 1, op, f"eps must have one element, got shape {list(eps)}")
    if dy is not None:
        _need(list(dy) == list(x), op, f"dy must have x's shape {list(x)}, got {list(dy)}")


def _check_ce(op, x, y, *vecs):
    _need(len(x) == 2, op, f"logits must be [N, V], got {list(x)}")
    for name, s in (("labels", y), *(("row vector", v) for v in vecs)):
        _need(_numel(s) == x[0], op, f"{name} must have N = {x[0]} elements, got shape {list(s)}")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _dt_ce(op, x, y, *vecs):
    import mindspore as ms

    _need(dtype_of(y) == ms.int32, op, f"labels must be int32, got {dtype_of(y)}")
    _f32(op, "logits " + " ".join("vector" for _ in vecs), (x, *vecs))


def _known(*shapes) -> bool:
    """All dimensions known (a dynamic-shape graph infers -1 / -2 first: its checks wait for the real shapes)."""
    return all(isinstance(d, int) and d >= 0 for s in shapes for d in s)


def _shape_fn(op: str, check, out):
    def infer(*shapes):
        if _known(*shapes):
            check(op, *shapes)
        return out(*shapes)

    return infer


def _dtype_fn(op: str, check, out):
    def infer(*dtypes):
        check(op, *dtypes)
        return out(*dtypes)

    return infer


_train_ops: list = []  # memo of train_ops(): [] not yet asked, [None] unavailable, [ns]


def train_ops() -> SimpleNamespace | None:
    """The fused train-step ops of model/train_kernels.cc (fp32), or None where they cannot be built.

    causal_softmax(scores [N, T, S]) -> probs, queries at the last T of S key positions (T <= S);
    softmax_grad(probs, dprobs) -> dscores; swiglu(gate, up) -> silu(gate) * up;
    swiglu_grad(gate, up, dout) -> (dgate, dup); rms_norm(x [N, H], weight [H], eps [1]) -> y;
    rms_norm_grad(x, weight, eps, dy) -> (dx, dweight); cross_entropy(logits [N, V], labels [N] int32) ->
    (nll [N], logsumexp [N]); cross_entropy_grad(logits, labels, logsumexp, dnll) -> dlogits.
    Operands are checked when the graph is inferred (KernelShapeError) and again by the kernel.
    """
    if _train_ops:
        return _train_ops[0]
    lib = None if disabled_reason() else build(TRAIN_SOURCE)
    ns = None
    if lib is not None:
        from mindspore import ops

        def op(name, shape_check, shape_out, dtype_names, dtype_out):
            def dt_check(op_name, *dts):
                _f32(op_name, dtype_names, dts)

            return ops.Custom(f"{lib}:{name}", out_shape=_shape_fn(name, shape_check, shape_out),
                              out_dtype=_dtype_fn(name, dt_check, dtype_out), func_type="aot")

        ns = SimpleNamespace(
            lib=lib,
            causal_softmax=op("CausalSoftmax", _check_causal, lambda x: x, "scores", lambda x: x),
            softmax_grad=op("SoftmaxGrad", _check_causal, lambda p, d: p, "probs dprobs", lambda p, d: p),
            swiglu=op("SwiGLU", _check_same, lambda g, u: g, "gate up", lambda g, u: g),
            swiglu_grad=op("SwiGLUGrad", _check_same, lambda g, u, d: (g, g), "gate up dout", lambda g, u, d: (g, g)),
            rms_norm=op("RMSNorm", _check_rms, lambda x, w, e: x, "x weight eps", lambda x, w, e: x),
            rms_norm_grad=op("RMSNormGrad", _check_rms, lambda x, w, e, d: (x, w), "x weight eps dy",
                             lambda x, w, e, d: (x, w)),
            cross_entropy=ops.Custom(
                f"{lib}:CrossEntropy", out_shape=_shape_fn("CrossEntropy", _check_ce, lambda x, y: ([x[0]], [x[0]])),
                out_dtype=_dtype_fn("CrossEntropy", _dt_ce, lambda x, y: (x, x)), func_type="aot"),
            cross_entropy_grad=ops.Custom(
                f"{lib}:CrossEntropyGrad", out_shape=_shape_fn("CrossEntropyGrad", _check_ce, lambda x, y, lse, d: x),
                out_dtype=_dtype_fn("CrossEntropyGrad", _dt_ce, lambda x, y, lse, d: x), func_type="aot"),
        )
    _train_ops.append(ns)
    return ns


_zero_ops: list = []  # memo of zero_ops(), as _train_ops


def zero_ops() -> SimpleNamespace | None:
    """The in-place AdamW op (ZeroAdamW in model/train_kernels.cc), or None where it cannot be built (no compiler, or
    MSLLM_FUSED_KERNELS=0): tasks/training/zero.py ShardedAdamW then keeps its fp32 master share and
    MindSpore's AdamWeightDecay.

    adamw(param [n], grad [n], m [k], v [k], offset [1] int32, lr, beta1, beta2, eps, decay, coef, apply) -> [1]:
    updates m, v and param[offset:offset + k] in place (fp32; scalars 0-d fp32; apply 0 writes nothing).
    """
    if _zero_ops:
        return _zero_ops[0]
    lib = None if disabled_reason() else build(TRAIN_SOURCE)
    ns = None
    if lib is not None:
        from mindspore import ops
        from mindspore.ops import signature as sig

        class ZeroAdamW(ops.Custom):
            """Declared as writing param, m and v (RW_WRITE, side_effect_mem), as MindSpore's own AdamWeightDecay:
            without it a graph run under the PYNATIVE context (mindspore.jit) hands the kernel a copy of a
            Parameter the step also reads elsewhere, and the update is lost; with it the update is ordered after
            every earlier read of those Parameters in the graph (auto-monad)."""

            __mindspore_signature__ = (
                sig.make_sig("param", sig.sig_rw.RW_WRITE), sig.make_sig("grad"),
                sig.make_sig("m", sig.sig_rw.RW_WRITE), sig.make_sig("v", sig.sig_rw.RW_WRITE),
                *(sig.make_sig(n) for n in ("offset", "lr", "beta1", "beta2", "eps", "decay", "coef", "apply")))

            def __init__(self):
                super().__init__(f"{lib}:ZeroAdamW", out_shape=lambda *s: [1], out_dtype=lambda *t: t[0],
                                 func_type="aot")
                self.add_prim_attr("side_effect_mem", True)

        ns = SimpleNamespace(lib=lib, adamw=ZeroAdamW())
    _zero_ops.append(ns)
    return ns
