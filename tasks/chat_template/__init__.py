"""Chat templates rendered within limits: a model's own Jinja chat template (tokenizer_config.json's `chat_template`,
chat_template.jinja, a GGUF's tokenizer.chat_template) in Jinja's immutable sandbox, bounded in time and in the
size of what it builds. `tasks.tokenizer` renders through `render_chat_template`; convert checks a template once
(`tasks.tokenizer.check_chat_template`) and the server renders every chat request with it. The size estimates of
each operation are tasks/chat_template/sizes.py.
"""

from __future__ import annotations

import ast
import json
import time
from functools import wraps
from typing import Any

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.filters import make_attrgetter
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import pass_environment, pass_eval_context

from tasks.chat_template.sizes import (
    arg,
    as_int,
    format_size,
    mul_size,
    percent_size,
    pow_size,
    replace_size,
    str_method_size,
    value_size,
)
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
    """One rendering's limits: its deadline and its character cap, with the sizes of the containers it built."""

    def __init__(self, max_chars: int, seconds: float):
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
        return len(v) if isinstance(v, str) else value_size(v, self.max_chars, self.sizes)

    def check(self, value: Any, what: str, size: int | None = None) -> Any:
        """After an operation: its result's size (`size` where the caller knows it)."""
        n = self.size(value) if size is None else size
        self.need(n, what)
        if isinstance(value, (list, tuple, dict)) and id(value) not in self.sizes:
            self.sizes[id(value)] = (value, n)
        return value


def _budget() -> _Budget:
    """The limits of the rendering under way in this thread."""
    b = getattr(_STATE, "budget", None)
    # outside `render_chat_template` (only its renderings use this environment): the default time limit
    return b if b is not None else _Budget(1 << 20, TEMPLATE_SECONDS)


def _environment():
    """The bounded sandbox (built once): Jinja's ImmutableSandboxedEnvironment as transformers sets it up (trim_blocks,
    lstrip_blocks, loopcontrols, tojson, raise_exception), with every limit of the comment above."""
    global _ENV
    if _ENV is None:
        env = _bounded_class()(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        _size_filters(env)
        _linear_filters(env)
        _bound_globals(env)
        _ENV = env
    return _ENV


def _with_ticks(source: str, filename: str):
    """The module Jinja generated, compiled with a time check at the top of every loop body and function (macros,
    blocks, the root)."""
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.While, ast.FunctionDef)):
            node.body.insert(
                0,
                ast.copy_location(
                    ast.Expr(ast.Call(ast.Attribute(ast.Name("environment", ast.Load()), "tick", ast.Load()), [], [])),
                    node.body[0],
                ),
            )
    return compile(ast.fix_missing_locations(tree), filename, "exec")


def _bounded_class():
    """The sandbox's class: every operator, call and str.format sized, and a time check in every loop and function
    of a compiled template."""

    class Codegen(CodeGenerator):
        def visit_Concat(self, node, frame):  # `a ~ b`: sized after
            self.write("environment.sized(")
            super().visit_Concat(node, frame)
            self.write(", '`~`')")

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%", "+"})  # also keeps these out of compile-time folding
        code_generator_class = Codegen

        def tick(self) -> None:
            _budget().tick()

        def sized(self, value, what: str):
            return _budget().check(value, what)

        def _compile(self, source: str, filename: str):
            return _with_ticks(source, filename)

        def call_binop(self, context, operator, left, right):
            b = _budget()
            cap = b.max_chars
            what = f"`{operator}`"
            if operator == "+" and type(left) is type(right) and isinstance(left, (str, list, tuple)):
                n = b.size(left) + b.size(right)  # known: a list grown one item per loop stays linear
                b.need(n, what)
                return b.check(left + right, what, n)
            if operator == "*":
                b.need(mul_size(left, right, cap), what)
            elif operator == "**":
                b.need(pow_size(left, right), what)
            elif operator == "%":
                b.need(percent_size(left, right, cap), what)
            return b.check(self.binop_table[operator](left, right), what)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's own spelling
            b = _budget()
            est = str_method_size(__obj, args, kwargs, b.max_chars)
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
                b = _budget()
                if value.__name__ == "format_map":
                    b.need(
                        format_size(fmt, (), dict(args[0]) if args and isinstance(args[0], dict) else {}, b.max_chars),
                        "str.format_map()",
                    )
                else:
                    b.need(format_size(fmt, args, kwargs, b.max_chars), "str.format()")
                return b.check(f(*args, **kwargs), "str.format()")

            return bounded

    return Bounded


def _text(v: Any) -> str:
    return v if isinstance(v, str) else str(v)


def _size_filters(env) -> None:
    """Every filter but join, sum and tojson sized: before it runs where it can outgrow its input, else after."""

    def sized_filter(name: str, estimate=None):
        f = env.filters[name]

        @wraps(f)
        def bounded(*args, **kwargs):
            b = _budget()
            if estimate is not None:
                b.need(estimate(b.max_chars, args, kwargs), f"the {name} filter")
            else:
                b.tick()
            return b.check(f(*args, **kwargs), f"the {name} filter")

        return bounded

    estimates = {
        "center": lambda cap, a, k: max(len(_text(a[0])), as_int(arg(a, k, 1, "width", 80))),
        "indent": lambda cap, a, k: (
            len(_text(a[0]))
            + (_text(a[0]).count("\n") + 1)
            * (len(w) if isinstance(w := arg(a, k, 1, "width", 4), str) else max(as_int(w), 0))
        ),
        "wordwrap": lambda cap, a, k: len(_text(a[1])) * (1 + len(_text(arg(a, k, 4, "wrapstring", None) or "\n"))),
        "replace": lambda cap, a, k: replace_size(
            _text(a[1]), _text(arg(a, k, 2, "old", "")), _text(arg(a, k, 3, "new", "")), arg(a, k, 4, "count")
        ),
        "format": lambda cap, a, k: percent_size(_text(a[0]), k or tuple(a[1:]), cap),
        "batch": lambda cap, a, k: as_int(arg(a, k, 1, "linecount", 0)),
        "slice": lambda cap, a, k: max([as_int(x) for x in (*a, *k.values())] or [0]),
    }
    for name in list(env.filters):
        if name not in ("join", "sum", "tojson"):
            env.filters[name] = sized_filter(name, estimates.get(name))


def _linear_filters(env) -> None:
    """join, sum and tojson written again, each sized as it builds its result (and sum in linear time)."""

    @pass_eval_context
    def join(eval_ctx, value, d="", attribute=None):
        """Jinja's join, its items sized first (a list of large strings joins into a larger one)."""
        b = _budget()
        if attribute is not None:
            value = map(make_attrgetter(eval_ctx.environment, attribute), value)
        items = list(value)
        b.need(sum(map(b.size, items)) + len(_text(d)) * len(items), "the join filter")
        return _text(d).join(map(str, items))

    @pass_environment
    def total(environment, iterable, attribute=None, start=0):
        """Jinja's sum; lists and tuples are concatenated in linear time (sum() copies the prefix at each item)."""
        b = _budget()
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
        b = _budget()
        b.need(len(indent) if isinstance(indent, str) else as_int(indent), "the tojson filter's indent")
        out, n = [], 0
        for piece in json.JSONEncoder(
            indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys
        ).iterencode(x):
            n += len(piece)
            b.need(n, "the tojson filter")
            out.append(piece)
        return "".join(out)

    env.filters.update(join=join, sum=total, tojson=tojson)


def _bound_globals(env) -> None:
    """transformers' raise_exception, and Jinja's lipsum sized before it runs."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    lipsum = env.globals["lipsum"]

    def bounded_lipsum(n=5, html=True, min=20, max=100):  # noqa: A002 - Jinja's names
        _budget().need(max * as_int(n) * 16, "lipsum()")  # paragraphs × words × the longest word and its space
        return lipsum(n, html, min, max)

    env.globals.update(raise_exception=raise_exception, lipsum=bounded_lipsum)


_ENV = None
_STATE = __import__("threading").local()
_COMPILED: dict[str, Any] = {}  # template source -> compiled template (a server renders one or two, every request)


def template_char_limit(template: str, messages: list[dict[str, Any]], extra: dict[str, Any]) -> int:
    """The characters a rendering may build: (template + the messages' text + extra strings + 1) × (messages + 1)
    (the derivation is in the comment above)."""
    text = sum(len(str(v)) for m in messages for v in (m.values() if isinstance(m, dict) else [m]))
    text += sum(len(v) for v in extra.values() if isinstance(v, str))
    return (len(template) + text + 1) * (len(messages) + 1)


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    where: str = "chat template",
    *,
    max_chars: int | None = None,
    max_chars_why: str = "",
    seconds: float | None = None,
    **extra: Any,
) -> str:
    """Render a Hugging Face chat template (Jinja, sandboxed, as transformers renders it) within the limits above.

    `max_chars` lowers the character limit (the server passes what its context can hold; `max_chars_why` says that in
    the error); `seconds` replaces TEMPLATE_SECONDS. A template that fails, or passes a limit, is one TokenizerError
    naming `where` and the `chat_template` key."""
    fix = "fix chat_template.jinja or tokenizer_config.json's chat_template"  # the phrase convert rewrites for a GGUF
    limit = template_char_limit(template, messages, extra)
    why = (
        f"({len(template)} characters of template + the messages' text + 1) × ({len(messages)} messages + 1): a "
        f"chat template renders each message once"
    )
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
                f"far longer, e.g. over range()); {fix}"
            ) from None
        made = "its output reached" if hit.what == "its output" else f"{hit.what} would make a value of"
        raise TemplateLimitError(
            f"{where}: the chat template passed its size limit of {limit:,} characters for these {len(messages)} "
            f"message(s): {made} {hit.size:,} characters (the limit: {why}); {fix}"
        ) from None
    except jinja2.exceptions.TemplateError as exc:
        raise TokenizerError(
            f"{where}: the chat template fails to render ({type(exc).__name__}: {exc}); {fix}"
        ) from None
    except Exception as exc:  # a template is code: any error inside it is the template's
        raise TokenizerError(
            f"{where}: the chat template fails to render ({type(exc).__name__}: {exc}); {fix}"
        ) from None
    finally:
        _STATE.budget = previous
