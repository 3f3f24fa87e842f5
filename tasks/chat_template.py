"""Chat templates rendered within limits: a model's own Jinja chat template (tokenizer_config.json's `chat_template`,
chat_template.jinja, a GGUF's tokenizer.chat_template) in Jinja's immutable sandbox, bounded in time and in the
size of what it builds. `tasks.tokenizer` renders through `render_chat_template`; convert checks a template once
(`tasks.tokenizer.check_chat_template`) and the server renders every chat request with it.
"""

from __future__ import annotations

from typing import Any

from tasks.tokenizer_error import TokenizerError

# ----------------------------------------------------------------------------- chat templates, within limits

# A chat template is code from the model's files (tokenizer_config.json's `chat_template`, chat_template.jinja, a
# GGUF's tokenizer.chat_template): it is rendered in Jinja's immutable sandbox, as transformers renders it, and
# within two limits, so a template can neither spin nor build a value the size of memory:
#
# - characters: the output and every value the template builds (a string, or the strings inside a list or dict)
#   stay within (template + messages + special tokens + 1) × (messages + 1) characters. A chat template renders
#   each message once, in one loop, around its own text, so its output is at most its text once per message plus
#   once outside the loop, and the messages' text once each; the server lowers the bound further to what the
#   model's context can hold (`max_chars`). Operations that could make a value far larger than their operands
#   (`*`, `**`, `%`, str.format, replace, center, join, indent, wordwrap, batch, tojson's indent, ...) are sized
#   before they run; every other call's result is sized after.
# - time: TEMPLATE_SECONDS of wall clock, checked at each loop iteration and macro call and at every call, filter
#   and operator. A chat template renders a conversation in well under a millisecond per message (ChatML: ~10 µs);
#   a second is orders of magnitude past any conversation that fits a context, and short enough that a rendering
#   that runs away costs a request one second of one worker thread.
#
# A rendering past either limit is a TemplateLimitError (a TokenizerError: convert refuses the model, naming
# `chat_template`; the server answers that request 400).

TEMPLATE_SECONDS = 1.0


class TemplateLimitError(TokenizerError):
    """A chat template passed its time or size limit (see above); the message names the limit and `chat_template`."""


class _LimitHit(BaseException):
    """Raised inside a rendering that passed a limit: a BaseException, so that no `except Exception` in Jinja or in
    a filter can swallow it (and compile-time constant folding stops too); `render_chat_template` turns it into one
    TemplateLimitError."""

    def __init__(self, kind: str, what: str, size: int = 0):
        super().__init__(kind, what, size)
        self.kind, self.what, self.size = kind, what, size


class _Budget:
    def __init__(self, max_chars: int, seconds: float):
        import time

        self.max_chars, self.seconds = max_chars, seconds
        self.clock = time.monotonic
        self.deadline = self.clock() + seconds
        # id -> (container, its size): lists, tuples and dicts cannot change in the immutable sandbox, so a size
        # is counted once per rendering (`filtered = filtered + [message]` in a loop stays linear); the container
        # is held so that its id is not reused
        self.sizes: dict[int, tuple[Any, int]] = {}

    def tick(self) -> None:
        if self.clock() > self.deadline:
            raise _LimitHit("time", "")

    def need(self, size: int, what: str) -> None:
        """Before an operation: its result would be `size` characters."""
        self.tick()
        if size > self.max_chars:
            raise _LimitHit("size", what, size)

    def size(self, v: Any) -> int:
        return len(v) if isinstance(v, str) else _size(v, self.max_chars, self.sizes)

    def check(self, value: Any, what: str, size: int | None = None) -> Any:
        """After an operation: its result's size (`size` where the caller knows it)."""
        n = self.size(value) if size is None else size
        self.need(n, what)
        if isinstance(value, (list, tuple, dict)) and id(value) not in self.sizes:
            self.sizes[id(value)] = (value, n)
        return value


def _size(v: Any, cap: int, known: dict[int, tuple[Any, int]] | None = None) -> int:
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


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def _mul_size(a: Any, b: Any, cap: int) -> int:
    if isinstance(a, int) and not isinstance(b, int):
        a, b = b, a
    if isinstance(b, int) and not isinstance(b, bool):
        if isinstance(a, int) and not isinstance(a, bool):
            return (a.bit_length() + b.bit_length()) * 30103 // 100000 + 2
        if isinstance(a, (str, list, tuple)):
            return _size(a, cap) * max(b, 0)  # a sequence repeated b times
    return 0


def _pow_size(a: Any, b: Any) -> int:
    if isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool) and b > 0 and abs(a) > 1:
        return b * a.bit_length() * 30103 // 100000 + 2
    return 0


_PERCENT = None


def _percent_size(fmt: Any, args: Any, cap: int) -> int:
    """`fmt % args` is at most the format, its widths and precisions (given or taken from `args` by '*'), and
    the arguments' own text."""
    import re

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
        widths += sum(abs(_int(v)) for v in vals)
    return len(fmt) + widths + _size(vals, cap)


def _format_size(fmt: str, args: tuple, kwargs: dict, cap: int) -> int:
    """str.format: the format, the numbers in its format specs, a nested field's value, and the arguments."""
    import re
    import string

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
        widths += sum(abs(_int(v)) for v in vals)
    return len(fmt) + widths + _size(vals, cap)


def _replace_size(s: str, old: str, new: str, count: Any = None) -> int:
    n = len(s) + 1 if old == "" else s.count(old) if old else 0
    if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
        n = min(n, count)
    return len(s) + n * max(len(new) - len(old), 0)


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _str_method_size(obj: Any, args: tuple, kwargs: dict, cap: int) -> int | None:
    """What a str method that can outgrow its string would make (None: not one of those)."""
    s, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if not isinstance(s, str):
        return None
    if name == "replace" and len(args) >= 2:
        return _replace_size(s, str(args[0]), str(args[1]), _arg(args, kwargs, 2, "count", -1))
    if name in ("center", "ljust", "rjust", "zfill"):
        return max(len(s), _int(_arg(args, kwargs, 0, "width", 0)))
    if name == "expandtabs":
        return len(s) + s.count("\t") * max(_int(_arg(args, kwargs, 0, "tabsize", 8)), 0)
    if name == "translate" and args and isinstance(args[0], dict):
        return len(s) * max([1, *(len(v) for v in args[0].values() if isinstance(v, str))])
    return None


def _environment():
    """The bounded sandbox (built once): Jinja's ImmutableSandboxedEnvironment as transformers sets it up (trim_blocks,
    lstrip_blocks, loopcontrols, tojson, raise_exception), with every limit of the comment above."""
    global _ENV
    if _ENV is not None:
        return _ENV
    import ast
    import json
    from functools import wraps

    import jinja2
    from jinja2.compiler import CodeGenerator
    from jinja2.filters import make_attrgetter
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import pass_environment, pass_eval_context

    def budget() -> _Budget:
        b = getattr(_STATE, "budget", None)
        # outside `render_chat_template` (only its renderings use this environment): the default time limit
        return b if b is not None else _Budget(1 << 20, TEMPLATE_SECONDS)

    class Codegen(CodeGenerator):
        def visit_Concat(self, node, frame):  # `a ~ b`: sized after
            self.write("environment.sized(")
            super().visit_Concat(node, frame)
            self.write(", '`~`')")

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%", "+"})  # also keeps these out of compile-time folding
        code_generator_class = Codegen

        def tick(self) -> None:
            budget().tick()

        def sized(self, value, what: str):
            return budget().check(value, what)

        def _compile(self, source: str, filename: str):
            # a time check at the top of every loop body and function (macros, blocks, the root) of the module
            # Jinja generated
            tree = ast.parse(source, filename)
            for node in ast.walk(tree):
                if isinstance(node, (ast.For, ast.While, ast.FunctionDef)):
                    node.body.insert(0, ast.copy_location(ast.Expr(ast.Call(
                        ast.Attribute(ast.Name("environment", ast.Load()), "tick", ast.Load()), [], [])), node.body[0]))
            return compile(ast.fix_missing_locations(tree), filename, "exec")

        def call_binop(self, context, operator, left, right):
            b = budget()
            cap = b.max_chars
            what = f"`{operator}`"
            if operator == "+" and type(left) is type(right) and isinstance(left, (str, list, tuple)):
                n = b.size(left) + b.size(right)  # known: a list grown one item per loop stays linear
                b.need(n, what)
                return b.check(left + right, what, n)
            if operator == "*":
                b.need(_mul_size(left, right, cap), what)
            elif operator == "**":
                b.need(_pow_size(left, right), what)
            elif operator == "%":
                b.need(_percent_size(left, right, cap), what)
            return b.check(self.binop_table[operator](left, right), what)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's own spelling
            b = budget()
            est = _str_method_size(__obj, args, kwargs, b.max_chars)
            name = getattr(__obj, "__name__", "a call")
            if est is not None:
                b.need(est, f"str.{name}()")
            elif name == "join" and isinstance(getattr(__obj, "__self__", None), str) and len(args) == 1:
                items = list(args[0])
                b.need(sum(map(b.size, items)) + len(__obj.__self__) * len(items), "str.join()")
                args = (items,)
            else:
                b.tick()
            return b.check(super().call(__context, __obj, *args, **kwargs), f"{name}()")

        def wrap_str_format(self, value):
            f = super().wrap_str_format(value)
            if f is None:
                return None
            fmt = value.__self__

            @wraps(f)
            def bounded(*args, **kwargs):
                b = budget()
                if value.__name__ == "format_map":
                    b.need(_format_size(fmt, (), dict(args[0]) if args and isinstance(args[0], dict) else {},
                                        b.max_chars), "str.format_map()")
                else:
                    b.need(_format_size(fmt, args, kwargs, b.max_chars), "str.format()")
                return b.check(f(*args, **kwargs), "str.format()")
            return bounded

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

    def sized_filter(name: str, estimate=None):
        f = env.filters[name]

        @wraps(f)
        def bounded(*args, **kwargs):
            b = budget()
            if estimate is not None:
                b.need(estimate(b.max_chars, args, kwargs), f"the {name} filter")
            else:
                b.tick()
            return b.check(f(*args, **kwargs), f"the {name} filter")
        return bounded

    def text(v: Any) -> str:
        return v if isinstance(v, str) else str(v)

    estimates = {
        "center": lambda cap, a, k: max(len(text(a[0])), _int(_arg(a, k, 1, "width", 80))),
        "indent": lambda cap, a, k: len(text(a[0])) + (text(a[0]).count("\n") + 1) * (
            len(w) if isinstance(w := _arg(a, k, 1, "width", 4), str) else max(_int(w), 0)),
        "wordwrap": lambda cap, a, k: len(text(a[1])) * (1 + len(text(_arg(a, k, 4, "wrapstring", None) or "\n"))),
        "replace": lambda cap, a, k: _replace_size(text(a[1]), text(_arg(a, k, 2, "old", "")),
                                                   text(_arg(a, k, 3, "new", "")), _arg(a, k, 4, "count")),
        "format": lambda cap, a, k: _percent_size(text(a[0]), k or tuple(a[1:]), cap),
        "batch": lambda cap, a, k: _int(_arg(a, k, 1, "linecount", 0)),
        "slice": lambda cap, a, k: max([_int(x) for x in (*a, *k.values())] or [0]),
    }
    for name in list(env.filters):
        if name not in ("join", "sum", "tojson"):
            env.filters[name] = sized_filter(name, estimates.get(name))

    @pass_eval_context
    def join(eval_ctx, value, d="", attribute=None):
        """Jinja's join, its items sized first (a list of large strings joins into a larger one)."""
        b = budget()
        if attribute is not None:
            value = map(make_attrgetter(eval_ctx.environment, attribute), value)
        items = list(value)
        b.need(sum(map(b.size, items)) + len(text(d)) * len(items), "the join filter")
        return text(d).join(map(str, items))

    @pass_environment
    def total(environment, iterable, attribute=None, start=0):
        """Jinja's sum; lists and tuples are concatenated in linear time (sum() copies the prefix at each item)."""
        b = budget()
        if attribute is not None:
            iterable = map(make_attrgetter(environment, attribute), iterable)
        items = list(iterable)
        if isinstance(start, (list, tuple)) and all(type(x) is type(start) for x in items):
            b.need(b.size(start) + sum(map(b.size, items)), "the sum filter")
            out = [y for x in (start, *items) for y in x]
            return out if isinstance(start, list) else tuple(out)
        b.tick()
        return b.check(sum(items, start), "the sum filter")

    def tojson(x, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
        """transformers' tojson (json.dumps), written piece by piece so that an indent cannot outgrow the limit."""
        b = budget()
        b.need(len(indent) if isinstance(indent, str) else _int(indent), "the tojson filter's indent")
        out, n = [], 0
        for piece in json.JSONEncoder(indent=indent, ensure_ascii=ensure_ascii, separators=separators,
                                      sort_keys=sort_keys).iterencode(x):
            n += len(piece)
            b.need(n, "the tojson filter")
            out.append(piece)
        return "".join(out)

    env.filters.update(join=join, sum=total, tojson=tojson)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    lipsum = env.globals["lipsum"]

    def bounded_lipsum(n=5, html=True, min=20, max=100):  # noqa: A002 - Jinja's names
        budget().need(max * _int(n) * 16, "lipsum()")  # paragraphs × words × the longest word and its space
        return lipsum(n, html, min, max)

    env.globals.update(raise_exception=raise_exception, lipsum=bounded_lipsum)
    _ENV = env
    return env


_ENV = None
_STATE = __import__("threading").local()
_COMPILED: dict[str, Any] = {}  # template source -> compiled template (a server renders one or two, every request)


def template_char_limit(template: str, messages: list[dict[str, Any]], extra: dict[str, Any]) -> int:
    """The characters a rendering may build: (template + the messages' text + extra strings + 1) × (messages + 1)
    (the derivation is in the comment above)."""
    text = sum(len(str(v)) for m in messages for v in (m.values() if isinstance(m, dict) else [m]))
    text += sum(len(v) for v in extra.values() if isinstance(v, str))
    return (len(template) + text + 1) * (len(messages) + 1)


def render_chat_template(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                         where: str = "chat template", *, max_chars: int | None = None, max_chars_why: str = "",
                         seconds: float | None = None, **extra: Any) -> str:
    """Render a Hugging Face chat template (Jinja, sandboxed, as transformers renders it) within the limits above.

    `max_chars` lowers the character limit (the server passes what its context can hold; `max_chars_why` says that in
    the error); `seconds` replaces TEMPLATE_SECONDS. A template that fails, or passes a limit, is one TokenizerError
    naming `where` and the `chat_template` key."""
    import jinja2

    fix = "fix chat_template.jinja or tokenizer_config.json's chat_template"  # the phrase convert rewrites for a GGUF
    limit = template_char_limit(template, messages, extra)
    why = (f"({len(template)} characters of template + the messages' text + 1) × ({len(messages)} messages + 1): a "
           f"chat template renders each message once")
    if max_chars is not None and max_chars < limit:
        limit, why = max_chars, max_chars_why or "the limit given"
    seconds = TEMPLATE_SECONDS if seconds is None else seconds
    env = _environment()
    previous = getattr(_STATE, "budget", None)
    _STATE.budget = _Budget(limit, seconds)
    try:
        tmpl = _COMPILED.get(template)
        if tmpl is None:
            tmpl = env.from_string(template)
            if len(_COMPILED) >= 8:
                _COMPILED.clear()
            _COMPILED[template] = tmpl
        out, n = [], 0
        for piece in tmpl.generate(messages=messages, add_generation_prompt=add_generation_prompt, **extra):
            n += len(piece)
            _STATE.budget.need(n, "its output")
            out.append(piece)
        return "".join(out)
    except _LimitHit as hit:
        if hit.kind == "time":
            raise TemplateLimitError(
                f"{where}: the chat template did not finish rendering {len(messages)} message(s) within its time "
                f"limit of {seconds:g} s (a chat template renders a conversation in milliseconds: this one loops "
                f"far longer, e.g. over range()); {fix}") from None
        made = "its output reached" if hit.what == "its output" else f"{hit.what} would make a value of"
        raise TemplateLimitError(
            f"{where}: the chat template passed its size limit of {limit:,} characters for these {len(messages)} "
            f"message(s): {made} {hit.size:,} characters (the limit: {why}); {fix}") from None
    except jinja2.exceptions.TemplateError as exc:
        raise TokenizerError(f"{where}: the chat template fails to render ({type(exc).__name__}: {exc}); {fix}") from None
    except Exception as exc:  # a template is code: any error inside it is the template's
        raise TokenizerError(f"{where}: the chat template fails to render ({type(exc).__name__}: {exc}); {fix}") from None
    finally:
        _STATE.budget = previous

