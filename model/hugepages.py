"""Transparent huge pages under the weights a decode step streams (Linux; elsewhere a no-op):

    huge_bytes = back_with_huge_pages([p.data_ptr(), p.nbytes) for p in params])

A decode step reads every weight once per token, 135M of them at SmolLM2-135M: with 4 KiB pages that is a TLB
miss every 4 KiB and prefetches that stop at each page's end. numpy asks for huge pages for its large arrays
(madvise(MADV_HUGEPAGE)); MindSpore's Parameters come from the C heap without them. The fused decode step called
through ctypes on numpy copies of the weights ran 126 tokens/s (fp32) and 354 (q8_0); without huge pages 85 and 326
(SmolLM2-135M's shape, 2 threads, AMD EPYC with AVX-512, docs/KERNELS.md). Where the kernel's THP setting is
`madvise` or `always` this marks the ranges (MADV_HUGEPAGE) and collapses what is already there (MADV_COLLAPSE,
Linux 6.1+: synchronous, the contents kept, the addresses unchanged). Only whole 2 MiB pages inside the ranges are
touched (neighbouring heap blocks merge into one range when adjacent); failures (an older kernel, THP `never`, no
free huge page) leave the memory as it was.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

HUGE = 2 << 20
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25
_GAP = 4096  # heap blocks this close are one range (malloc's headers between consecutive allocations)


def _ranges(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent (start, nbytes) spans merged, then cut to the whole huge pages inside each: [(start, end)]."""
    merged: list[list[int]] = []
    for start, n in sorted(s for s in spans if s[1] > 0):
        if merged and start - merged[-1][1] <= _GAP:
            merged[-1][1] = max(merged[-1][1], start + n)
        else:
            merged.append([start, start + n])
    out = []
    for a, b in merged:
        a, b = -(-a // HUGE) * HUGE, b // HUGE * HUGE
        if b > a:
            out.append((a, b))
    return out


def back_with_huge_pages(spans: list[tuple[int, int]]) -> int:
    """Bytes of `spans` ((address, nbytes) of live buffers) now asked to be, and collapsed into, huge pages; 0 where
    the platform or kernel offers none."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return 0
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    for a, b in _ranges(spans):
        if libc.madvise(a, b - a, MADV_HUGEPAGE) != 0:
            continue
        if libc.madvise(a, b - a, MADV_COLLAPSE) == 0:
            done += b - a
    return done
