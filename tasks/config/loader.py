"""Loading a pipeline: the file (YAML 1.2), `base:` inheritance, `--set` overrides, the `train` inheritance
(continued and finetune from pretrain.train), validation against the schema, then the cross-key rules.

    cfg = resolve_pipeline("pipelines.yaml", "demo", overrides=["pretrain.train.loop.max_steps=10"])
    cfg.pretrain.train.loop.max_steps  -> 10

Every error names its YAML path (`pipelines.demo.parallel.tensor_parallel`) and what would fix it; all
errors of a file are reported together (`ConfigError.errors`).
"""

from __future__ import annotations

import copy
import difflib
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from tasks.config.rules import check_pipeline
from tasks.config.schema import (
    _YAML_KEYS_EXCLUDED,
    FINETUNE_DEFAULTS,
    FINETUNE_INHERITS,
    ConfigError,
    PipelineConfig,
    _suggest,
)
from tasks.config.yaml12 import (
    MAX_ALIAS_NODES,
    MAX_FILE_BYTES,
    MAX_SET_BYTES,
    AliasBombError,
    DuplicateKeyError,
    _deep_merge,
    _yaml11_hint,
    load_yaml,
)


def _model_at(loc: tuple, root: type[BaseModel] = PipelineConfig) -> type[BaseModel] | None:
    m: Any = root
    for part in loc:
        if not (isinstance(m, type) and issubclass(m, BaseModel)) or part not in m.model_fields:
            return None
        ann = m.model_fields[part].annotation
        m = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return m


def _format_pydantic(prefix: str, exc: ValidationError) -> list[str]:
    out = []
    for e in exc.errors():
        loc = tuple(str(x) for x in e["loc"])
        path = ".".join([prefix, *loc])
        if e["type"] == "extra_forbidden":
            parent = _model_at(tuple(e["loc"][:-1]))
            valid = [k for k in (parent.model_fields if parent else []) if k not in _YAML_KEYS_EXCLUDED]
            out.append(f"{path}: unknown key '{loc[-1]}'; {_suggest(loc[-1], valid)}")
        elif e["type"] == "finite_number":
            out.append(f"{path}: {e['input']!r} is not a finite number; use a finite value (no .inf / .nan)")
        elif e["type"] == "literal_error":
            out.append(f"{path}: {e['input']!r} is not allowed; {e['msg'].lower()}")
        elif e["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
            out.append(f"{path}: {e['input']!r} is out of range; value must be {e['msg'].split('be ', 1)[-1]}")
        else:
            out.append(f"{path}: {e['msg']} (got {e['input']!r}); fix the type of this value{_yaml11_hint(e['input'])}")
    return out


def read_pipelines_file(path: str | os.PathLike) -> dict[str, Any]:
    """The raw YAML of a pipelines file: {'default': name, 'pipelines': {...}}."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError([f"{p}: pipelines file not found; pass --config PATH or create pipelines.yaml"])
    with p.open("rb") as fh:  # read one byte past the cap, never the whole of a huge file
        data = fh.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(
            [
                f"{p}: {p.stat().st_size:,} bytes, over the {MAX_FILE_BYTES // 1024} KiB limit for a "
                "pipelines file; keep long text (descriptions, source lists) in files the pipeline "
                "names, such as data.sources globs"
            ]
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [
                f"{p}: not a text file (invalid UTF-8 at byte {exc.start}); --config must name a "
                "YAML pipelines file such as pipelines.yaml"
            ]
        ) from None
    try:
        raw = load_yaml(text)
    except DuplicateKeyError as exc:
        raise ConfigError(
            [f"{p}:{exc.line}: duplicate key '{exc.key}' (first at line {exc.first}); keep one of them"]
        ) from None
    except AliasBombError as exc:
        raise ConfigError([f"{p}:{exc.line}: alias *{exc.anchor} {exc.why}; {_ALIAS_FIX}"]) from None
    except yaml.YAMLError as exc:
        hint = "; --config must name a YAML pipelines file such as pipelines.yaml" if "\x00" in text else ""
        raise ConfigError([f"{p}: not valid YAML: {exc}{hint}"]) from None
    if not isinstance(raw, dict) or not isinstance(raw.get("pipelines"), dict) or not raw["pipelines"]:
        raise ConfigError([f"{p}: expected a mapping with a non-empty 'pipelines:' mapping of named pipelines"])
    if (bad := _non_string_key(raw)) is not None:
        where, key = bad
        kind = _KINDS.get(type(key), type(key).__name__)
        raise ConfigError(
            [
                f"{p}: {where + ': ' if where else ''}the key {key!r} is a {kind}, "
                "not text (YAML reads unquoted keys such as `0:`, `1.5:`, `true:` or `null:` so); quote it or rename it"
            ]
        )
    unknown = set(raw) - {"default", "pipelines"}
    if unknown:
        k = sorted(unknown)[0]
        raise ConfigError([f"{k}: unknown top-level key '{k}'; {_suggest(k, ['default', 'pipelines'])}"])
    return raw


_KINDS = {int: "number", float: "number", bool: "boolean", type(None): "null"}


def _non_string_key(doc) -> tuple[str, object] | None:
    """(the dotted path of the mapping, the key) of the first mapping key anywhere in `doc` that is not a string, or
    None. Every key path, "did you mean" hint and schema field is text; `0:` or `true:` as a key (a YAML int or bool)
    reached them as a TypeError (found by fuzz/, target pipelines). Iterative: the document's depth is the input's."""
    stack = [("", doc)]
    while stack:
        where, node = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                if not isinstance(k, str):
                    return where, k
                stack.append((f"{where}.{k}" if where else k, v))
        elif isinstance(node, list):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(node))
    return None


def _raw_pipeline(raw: dict, name: str, seen: tuple[str, ...] = ()) -> dict:
    pipes = raw["pipelines"]
    if name not in pipes:
        near = difflib.get_close_matches(name, list(pipes), n=1)
        hint = f" did you mean '{near[0]}'?" if near else ""
        where = f"pipelines.{seen[-1]}.base" if seen else "--pipeline"
        raise ConfigError([f"{where}: no pipeline named '{name}';{hint} defined: {', '.join(sorted(pipes))}"])
    if name in seen:
        raise ConfigError(
            [f"pipelines.{name}.base: circular 'base:' chain {' -> '.join([*seen, name])}; remove one link"]
        )
    body = pipes[name]
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise ConfigError([f"pipelines.{name}: expected a mapping of sections, got {type(body).__name__}"])
    body = dict(body)
    base = body.pop("base", None)
    if base is None:
        return body
    if not isinstance(base, str):
        raise ConfigError([f"pipelines.{name}.base: must be the name of another pipeline, got {base!r}"])
    inherited = _raw_pipeline(raw, base, (*seen, name))
    for section in TRAINED:
        _replace_budget(_loop_of(inherited, section), _loop_of(body, section))
    return _deep_merge(inherited, body)


BUDGET_KEYS = ("max_steps", "max_tokens")
"""A run's two ways to say how long to train (`train.loop`); exactly one is set."""
TRAINED = ("pretrain", "continued", "finetune")
"""The sections that hold a `train` section."""


def _loop_of(body: Any, section: str) -> dict | None:
    """body[section].train.loop when every level is a mapping (else None: validation reports the shape)."""
    node = body
    for key in (section, "train", "loop"):
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def _replace_budget(below: dict | None, above: dict | None) -> str | None:
    """A layer (`above`: a pipeline's own train.loop over its base's, the `--set` values over the pipeline,
    continued's loop over pretrain's) that sets one budget key replaces the other key of the loop below: the
    run uses the one the user named last. Returns the key it cleared, or None. Both in one layer stay (an error)."""
    if not isinstance(above, dict) or not isinstance(below, dict):
        return None
    named = [k for k in BUDGET_KEYS if above.get(k) is not None]
    if len(named) != 1:
        return None
    other = BUDGET_KEYS[1 - BUDGET_KEYS.index(named[0])]
    if below.get(other) is None or other in above:
        return None
    del below[other]
    return other


def _dotted(d: dict, path: str) -> tuple[bool, Any]:
    node: Any = d
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return False, None
        node = node[key]
    return True, node


def _nest(flat: dict[str, Any]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split(".")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = copy.deepcopy(value)
    return out


def inherit_train(body: dict) -> dict:
    """Resolve continued.train and finetune.train from pretrain.train (in place; returns body).

    - continued.train = pretrain.train with continued.train on top (all of it is inherited; a budget key set
      in continued replaces pretrain's other one).
    - finetune.train = FINETUNE_DEFAULTS, then the FINETUNE_INHERITS keys that pretrain.train sets, then
      finetune.train on top. Nothing else of pretrain.train reaches finetune.
    """
    pre = body.get("pretrain") if isinstance(body.get("pretrain"), dict) else {}
    pt = pre.get("train") if isinstance(pre.get("train"), dict) else {}
    for section in ("continued", "finetune"):
        sec = body.get(section, {})
        if sec is None:
            sec = {}
        if not isinstance(sec, dict) or not isinstance(sec.get("train", {}), dict):
            continue  # validation names the bad shape
        own = sec.get("train") or {}
        if section == "continued":
            below = copy.deepcopy(pt)
        else:
            picked = {p: v for p in FINETUNE_INHERITS for found, v in [_dotted(pt, p)] if found}
            below = _deep_merge(FINETUNE_DEFAULTS, _nest(picked))
        _replace_budget(_loop_of({"s": {"train": below}}, "s"), _loop_of({"s": {"train": own}}, "s"))
        body[section] = {**sec, "train": _deep_merge(below, own)}
    return body


MOVED = {
    **{
        f"pretrain.{k}": f"pretrain.train.loop.{k}"
        for k in (
            "max_steps",
            "max_tokens",
            "micro_batch_size",
            "gradient_accumulation",
            "grad_clip",
            "log_steps",
            "eval_steps",
            "eval_batches",
            "max_nonfinite_steps",
            "peak_flops",
        )
    },
    "pretrain.optimizer": "pretrain.train.optimizer",
    "pretrain.schedule": "pretrain.train.schedule",
    "pretrain.precision": "pretrain.train.precision.dtype",
    "pretrain.loss_scale": "pretrain.train.precision.loss_scale",
    "pretrain.loss_scale_window": "pretrain.train.precision.loss_scale_window",
    "pretrain.fused_kernels": "pretrain.train.fused_kernels",
    **{
        f"finetune.{k}": f"finetune.train.loop.{k}"
        for k in ("max_steps", "micro_batch_size", "log_steps", "eval_steps", "eval_batches", "save_steps")
    },
    "finetune.lr": "finetune.train.optimizer.lr",
    "finetune.min_lr": "finetune.train.optimizer.min_lr",
    "finetune.weight_decay": "finetune.train.optimizer.weight_decay",
    "finetune.warmup_steps": "finetune.train.schedule.warmup_steps",
    "finetune.decay": "finetune.train.schedule.decay",
    "continued.max_steps": "continued.train.loop.max_steps",
    "continued.lr": "continued.train.optimizer.lr",
    "continued.warmup_steps": "continued.train.schedule.warmup_steps",
    "parallel.pipeline_parallel": "plan.pipeline_parallel",
    "parallel.micro_batch_num": "plan.micro_batch_num",
}
"""Keys of the shape before issue 26 -> where they live now. An old key is an error naming its new home,
never reinterpreted (pipeline stages are not built: their two keys only inform `msllm plan`)."""


def moved_key_errors(body: dict, prefix: str) -> list[str]:
    """One error per old key in a pipeline body, naming the new key (a one-line migration)."""
    errs = []
    for old, new in MOVED.items():
        section, key = old.split(".")
        sec = body.get(section)
        if isinstance(sec, dict) and key in sec:
            why = " (pipeline stages are not built; only `msllm plan` estimates them)" if section == "parallel" else ""
            errs.append(
                f"{prefix}.{old}: moved to {new}{why}; write `{new}` instead "
                f"(one `train` section per stage; pipelines.yaml says what inherits)"
            )
    return errs


_ALIAS_FIX = (
    f"aliases may add at most {MAX_ALIAS_NODES:,} nodes (a 'billion laughs' of nested aliases is refused); "
    "write the values out or use fewer levels of aliases"
)


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=VALUE` -> (['a','b','c'], yaml-parsed VALUE)."""
    if len(item.encode("utf-8", "surrogatepass")) > MAX_SET_BYTES:
        raise ConfigError(
            [
                f"--set {item.partition('=')[0][:80]}: {len(item):,} characters, over the {MAX_SET_BYTES // 1024} KiB "
                "limit for one --set value; put long values in the pipelines file"
            ]
        )
    if "=" not in item:
        raise ConfigError([f"--set {item}: expected dotted.key=VALUE, e.g. --set pretrain.train.loop.max_steps=100"])
    key, _, value = item.partition("=")
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError([f"--set {item}: empty key; expected dotted.key=VALUE"])
    try:
        parsed = load_yaml(value) if value.strip() else None
    except DuplicateKeyError as exc:
        raise ConfigError([f"--set {item}: duplicate key '{exc.key}' in VALUE; keep one of them"]) from None
    except AliasBombError as exc:
        raise ConfigError([f"--set {key}: alias *{exc.anchor} in VALUE {exc.why}; {_ALIAS_FIX}"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"--set {item}: VALUE is not valid YAML ({exc})"]) from None
    return parts, parsed


def apply_overrides(body: dict, overrides: list[str] | None) -> dict:
    body = copy.deepcopy(body)
    for item in overrides or []:
        parts, value = parse_override(item)
        node = body
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ConfigError([f"--set {item}: '{p}' is a value, not a section"])
            node = nxt
        node[parts[-1]] = value
    return body


def default_pipeline_name(raw: dict, path: str | os.PathLike = "pipelines.yaml") -> str:
    name = raw.get("default")
    if name is None:
        return "demo" if "demo" in raw["pipelines"] else sorted(raw["pipelines"])[0]
    if name not in raw["pipelines"]:
        raise ConfigError(
            [f"default: '{name}' is not a pipeline in {path}; defined: {', '.join(sorted(raw['pipelines']))}"]
        )
    return name


def resolve_pipeline(
    path: str | os.PathLike = "pipelines.yaml",
    name: str | None = None,
    overrides: list[str] | None = None,
    check_files: bool = True,
) -> PipelineConfig:
    """Load, inherit (`base:`), override (`--set`) and validate one pipeline. Raises ConfigError."""
    raw = read_pipelines_file(path)
    name = name or default_pipeline_name(raw, path)
    body = _raw_pipeline(raw, name)
    prefix = f"pipelines.{name}"
    given = apply_overrides({}, overrides)
    notes = []
    for section in TRAINED:
        cleared = _replace_budget(_loop_of(body, section), _loop_of(given, section))
        if cleared:
            used = next(k for k in BUDGET_KEYS if k != cleared)
            value = _loop_of(given, section)[used]
            notes.append(
                f"--set {section}.train.loop.{used}={value} replaces {prefix}.{section}.train.loop.{cleared} "
                f"of {path}: training stops after {value} {'steps' if used == 'max_steps' else 'tokens'}"
            )
    body = apply_overrides(body, overrides)
    if moved := moved_key_errors(body, prefix):
        raise ConfigError(moved)
    inherit_train(body)
    bad_top = [k for k in body if k in _YAML_KEYS_EXCLUDED]
    if bad_top:
        raise ConfigError([f"{prefix}.{bad_top[0]}: '{bad_top[0]}' is set by the loader, not in YAML; remove it"])
    try:
        cfg = PipelineConfig.model_validate(body)
    except ValidationError as exc:
        raise ConfigError(_inherited_once(prefix, _format_pydantic(prefix, exc))) from None
    cfg.name = name
    cfg.base_dir = str(Path(path).resolve().parent)
    cfg.notes = notes
    errors = check_pipeline(cfg, prefix, check_files=check_files)
    if errors:
        raise ConfigError(errors)
    return cfg


def _inherited_once(prefix: str, errors: list[str]) -> list[str]:
    """Drop the copy of a pretrain.train error that continued/finetune inherited (reported once, at pretrain)."""
    out = []
    for e in errors:
        for section in ("continued", "finetune"):
            head = f"{prefix}.{section}.train."
            if e.startswith(head) and f"{prefix}.pretrain.train.{e[len(head) :]}" in errors:
                break
        else:
            out.append(e)
    return out


def validate_file(path: str | os.PathLike = "pipelines.yaml") -> dict[str, list[str]]:
    """Validate every pipeline of a file; {name: [errors]} (empty lists when fine)."""
    raw = read_pipelines_file(path)
    out = {}
    for name in raw["pipelines"]:
        try:
            resolve_pipeline(path, name)
            out[name] = []
        except ConfigError as exc:
            out[name] = exc.errors
    return out


def to_yaml(cfg: PipelineConfig) -> str:
    data = cfg.model_dump(mode="json", exclude=_YAML_KEYS_EXCLUDED)
    return yaml.safe_dump({cfg.name: data}, sort_keys=False)
