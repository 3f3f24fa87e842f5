"""YAML 1.2 reading of pipelines files and `--set` values (`Loader`, `load_yaml`): numbers, booleans and
duplicate keys as YAML 1.2 reads them, not PyYAML's YAML 1.1."""

from __future__ import annotations

import copy
import re
from typing import Any

import yaml

_SEXAGESIMAL = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$")
_YAML11_BOOLS = {"yes", "no", "on", "off", "y", "n"}


def _yaml11_hint(value: Any) -> str:
    """Why a value YAML 1.1 would have read as a number or a boolean is text here (see `Loader`)."""
    if not isinstance(value, str):
        return ""
    if _SEXAGESIMAL.match(value):
        return (
            f" ('{value}' is text: pipelines files are read as YAML 1.2, which has no base-60 numbers; "
            "write the number itself)"
        )
    if value.lower() in _YAML11_BOOLS:
        return f" ('{value}' is text: pipelines files are read as YAML 1.2, where booleans are true and false)"
    return ""


def _deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


class DuplicateKeyError(yaml.YAMLError):
    def __init__(self, key: Any, line: int, first: int):
        self.key, self.line, self.first = key, line, first
        super().__init__(f"duplicate key '{key}' (first at line {first})")


MAX_FILE_BYTES = 256 * 1024
"""The largest pipelines file read (the shipped one is ~7 KB). PyYAML's pure-Python scanner reads ~1 MB/s of
comments and far less of dense flow lists (~90 KB/s), so a bound on the size is a bound on the time: ~3 s at
worst here, where a 50 MB file ran for minutes."""
MAX_SET_BYTES = 64 * 1024
"""The largest `--set` VALUE read (a command line holds at most 128 KiB per argument anyway)."""
MAX_ALIAS_NODES = 100_000
"""The most nodes that aliases (`*name`, merge keys `<<: *name`) may add to a document once expanded. A
"billion laughs" file nests aliases of aliases: ten lines expand to 10^10 nodes, which validation would walk
for hours. Real anchors (a shared `train` section reused by a few pipelines) add hundreds."""


class AliasBombError(yaml.YAMLError):
    """Aliases expand past MAX_ALIAS_NODES, or an alias refers to a node that contains it."""

    def __init__(self, line: int, anchor: str, why: str):
        self.line, self.anchor, self.why = line, anchor, why
        super().__init__(f"line {line}: alias *{anchor} {why}")


class Loader(yaml.SafeLoader):
    """yaml.SafeLoader with the YAML 1.2 core schema's scalars (pipelines files and `--set` values):

    - Numbers as YAML 1.2 reads them. PyYAML follows YAML 1.1, where `1:20` is the base-60 integer 80,
      `010` is octal 8, a float needs a dot and a signed exponent (`1.0e+6`, so `1e-3` is a string) and
      `2024-01-01` is a date. Here `1e-3`, `1.0e6`, `2E5` are floats, `10` and `010` are ten, `0x10` and
      `0o17` are hex and octal, and `1:20`, `0b101` and dates stay strings (so `max_steps: 1:20` fails
      validation instead of running 80 steps). `_` between digits is still allowed (`1_000`).
    - Booleans are only `true`/`false` (any case style of YAML 1.2): `yes`, `no`, `on`, `off`, `y`, `n`
      are strings, so a value such as `normalize: no` or a name `on` is never turned into a boolean.
    - Null is `~`, `null` or empty, as before; merge keys (`<<: *anchor`) work as before.
    - A key repeated in one mapping is an error naming the key and both lines (PyYAML keeps the
      last value silently). Keys brought in by a merge (`<<: *anchor`) may be overridden as usual.
    - Aliases are counted while the document is composed: once the nodes they add (each alias adds the
      expanded size of its anchor) pass MAX_ALIAS_NODES, or an alias names a node that contains it (a
      recursive structure), composing stops with AliasBombError, before anything is constructed.
    """

    _alias_nodes = 0
    _sizes: dict[int, int] | None = None

    def compose_node(self, parent, index):
        if self._sizes is None:
            self._sizes = {}
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            target = self.anchors.get(event.anchor)
            if target is not None:  # an undefined alias: the base class says so
                size = self._sizes.get(id(target))
                if size is None:  # the anchored node is still open: the alias is inside it
                    raise AliasBombError(
                        event.start_mark.line + 1,
                        event.anchor,
                        "refers to a node that contains it (a recursive structure)",
                    )
                self._alias_nodes += size
                if self._alias_nodes > MAX_ALIAS_NODES:
                    raise AliasBombError(
                        event.start_mark.line + 1, event.anchor, f"expands the document past {MAX_ALIAS_NODES:,} nodes"
                    )
            return super().compose_node(parent, index)
        node = super().compose_node(parent, index)
        if isinstance(node, yaml.SequenceNode):
            size = 1 + sum(self._sizes[id(n)] for n in node.value)
        elif isinstance(node, yaml.MappingNode):
            size = 1 + sum(self._sizes[id(k)] + self._sizes[id(v)] for k, v in node.value)
        else:
            size = 1
        self._sizes[id(node)] = size
        return node

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = first.setdefault(key, key_node)
                except TypeError:  # an unhashable key: the base class names it
                    continue
                if seen is not key_node:
                    raise DuplicateKeyError(key, key_node.start_mark.line + 1, seen.start_mark.line + 1)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        """YAML 1.2 integers: decimal (a leading 0 is still decimal), 0x hex, 0o octal; no base 60."""
        text = str(self.construct_scalar(node)).replace("_", "")
        sign, digits = (-1, text[1:]) if text[:1] == "-" else (1, text.lstrip("+"))
        if digits[:2] in ("0x", "0X"):
            return sign * int(digits[2:], 16)
        if digits[:2] in ("0o", "0O"):
            return sign * int(digits[2:], 8)
        return sign * int(digits, 10)


Loader.add_constructor("tag:yaml.org,2002:int", Loader.construct_yaml_int)

# The implicit resolvers of the YAML 1.2 core schema (https://yaml.org/spec/1.2.2/#1032-tag-resolution), plus
# `_` digit separators and the merge key; SafeLoader's YAML 1.1 ones (base 60, yes/no/on/off, timestamps, `=`)
# are dropped. A fresh dict, so yaml.SafeLoader itself is untouched.
_KEEP = {"tag:yaml.org,2002:null", "tag:yaml.org,2002:merge"}
Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag in _KEEP]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(
        r"""^(?:
      [-+]?[0-9][0-9_]*
    | [-+]?0[xX][0-9a-fA-F][0-9a-fA-F_]*
    | [-+]?0[oO][0-7][0-7_]*)$""",
        re.X,
    ),
    list("-+0123456789"),
)
Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:
      [-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    | [-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
    | [-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
    | [-+]?\.(?:inf|Inf|INF)
    | \.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def load_yaml(text: str) -> Any:
    """Parse YAML with `Loader` (safe: plain data only)."""
    return yaml.load(text, Loader=Loader)  # noqa: S506  (Loader is a yaml.SafeLoader)
