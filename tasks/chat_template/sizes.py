"""How large a chat template's values are, and how large an operation's result would be before it runs: the
sizes tasks/chat_template/__init__.py's sandbox checks against its character limit (the derivation is the comment
there). Each estimate is an upper bound on the characters the result holds (0 where the operation cannot grow)."""

from __future__ import annotations

import re
import string
from typing import Any


def value_size(v: Any, cap: int, known: dict[int, tuple[Any, int]] | None = None) -> int:
    """The characters `v` holds (a string's length; the strings, keys and numbers inside lists, tuples, sets and
    dicts, with their separators as str() writes them; an integer's digits), counted until past `cap`; `known`:
    containers already counted."""
    n, stack = 0, [v]
    while stack and n <= cap:
        x = stack.pop()
        if isinstance(x, (str, bytes, bytearray)):
            n += len(x)
        elif isinstance(x, bool) or x is None:
            n += 5
        elif isinstance(x, int):
            n += x.bit_length() * 30103 // 100000 + 2  # its decimal digits (log10 2 = 0.30103) and a sign
        elif known is not None and id(x) in known:
            n += known[id(x)][1]
        elif isinstance(x, dict):
            n += 2 + 4 * len(x)
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            n += 2 + 4 * len(x)
            stack.extend(x)
        else:
            n += 24  # a float, an undefined, a namespace, a generator: a short repr, or nothing built yet
    return n


def as_int(v: Any) -> int:
    """`v` when it is an integer (not a bool), else 0."""
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def mul_size(a: Any, b: Any, cap: int) -> int:
    """`a * b`: the digits of a product of integers, or a sequence repeated (0: neither)."""
    if isinstance(a, int) and not isinstance(b, int):
        a, b = b, a
    if isinstance(b, int) and not isinstance(b, bool):
        if isinstance(a, int) and not isinstance(a, bool):
            return (a.bit_length() + b.bit_length()) * 30103 // 100000 + 2
        if isinstance(a, (str, list, tuple)):
            return value_size(a, cap) * max(b, 0)  # a sequence repeated b times
    return 0


def pow_size(a: Any, b: Any) -> int:
    """`a ** b` of integers: its digits (0: not a power that grows)."""
    if isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool) and b > 0 and abs(a) > 1:
        return b * a.bit_length() * 30103 // 100000 + 2
    return 0


_PERCENT = None


def percent_size(fmt: Any, args: Any, cap: int) -> int:
    """`fmt % args` is at most the format, its widths and precisions (given or taken from `args` by '*'), and
    the arguments' own text."""
    global _PERCENT
    if not isinstance(fmt, str):
        return 0
    if _PERCENT is None:
        _PERCENT = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")
    widths = 0
    star = False
    for w, p in _PERCENT.findall(fmt):
        for x in (w, p):
            if x == "*":
                star = True
            elif x:
                widths += int(x) if len(x) <= 12 else cap + 1
    vals = list(args.values()) if isinstance(args, dict) else list(args) if isinstance(args, tuple) else [args]
    if star:
        widths += sum(abs(as_int(v)) for v in vals)
    return len(fmt) + widths + value_size(vals, cap)


def format_size(fmt: str, args: tuple, kwargs: dict, cap: int) -> int:
    """str.format: the format, the numbers in its format specs, a nested field's value, and the arguments."""
    widths, nested = 0, False
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return len(fmt)  # format() will raise the same error
    for _, _, spec, _ in fields:
        if spec:
            nested |= "{" in spec
            widths += sum(int(d) if len(d) <= 12 else cap + 1 for d in re.findall(r"\d+", spec))
    vals = [*args, *kwargs.values()]
    if nested:
        widths += sum(abs(as_int(v)) for v in vals)
    return len(fmt) + widths + value_size(vals, cap)


def replace_size(s: str, old: str, new: str, count: Any = None) -> int:
    """`s.replace(old, new, count)`."""
    n = len(s) + 1 if old == "" else s.count(old) if old else 0
    if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
        n = min(n, count)
    return len(s) + n * max(len(new) - len(old), 0)


def arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    """Argument `i` of a call, or its keyword `name`, or `default`."""
    return args[i] if len(args) > i else kwargs.get(name, default)


def str_method_size(obj: Any, args: tuple, kwargs: dict, cap: int) -> int | None:
    """What a str method that can outgrow its string would make (None: not one of those)."""
    s, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if not isinstance(s, str):
        return None
    if name == "replace" and len(args) >= 2:
        return replace_size(s, str(args[0]), str(args[1]), arg(args, kwargs, 2, "count", -1))
    if name in ("center", "ljust", "rjust", "zfill"):
        return max(len(s), as_int(arg(args, kwargs, 0, "width", 0)))
    if name == "expandtabs":
        return len(s) + s.count("\t") * max(as_int(arg(args, kwargs, 0, "tabsize", 8)), 0)
    if name == "translate" and args and isinstance(args[0], dict):
        return len(s) * max([1, *(len(v) for v in args[0].values() if isinstance(v, str))])
    return None
