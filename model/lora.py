r"""LoRA: low-rank adapters on the model's dense projections, and merging them back.

    names = inject_lora(net, ["q_proj", "v_proj"], rank=8, alpha=16)   # or a regex: r"layers\.[01]\..*proj"
    params = mark_only_lora_trainable(net)       # only lora_A / lora_B keep requires_grad
    print(trainable_summary(net).line())         # trainable params: 16,384 || all params: ... || trainable: 0.08%
    ...train `params`... adapter = lora_state_dict(net) # {"layers.0.self_attn.q_proj.lora_A": [r, in], ...lora_B: [out,
    r]} merged = merge_adapter(base_weights, adapter, scaling=alpha / rank) # numpy, no network needed
    merge_lora(net); unmerge_lora(net)           # in place on a network (idempotent)
    slots = LoRASlots(net, {"a": (adapter_a, scaling_a), ...})   # many adapters on one base, unmerged
    slots.use("a"); ...; slots.use(None)         # the net computes with adapter a's update; the base again

A `LoRALinear` replaces a `model.layers.Linear` and keeps its `weight` Parameter
(same object, same name `...q_proj.weight`), so the frozen base weights keep
their names and a merged state dict loads into a plain `LlamaForCausalLM`.
It computes, on the flattened tokens,

    y = x W^T + scaling * dropout(x) A^T B^T,   A: [r, in] random, B: [out, r] zero, scaling = alpha / r

so an adapter starts as an exact no-op. Merging writes W + scaling * B A into
`weight`; both the in-place merge and the state-dict merge call `lora_delta`,
the one place that formula lives.

`LoRASlots` serves many adapters on one network without merging (vLLM's multi-LoRA shape): the base
weights once, one `LoRALinear` per module any adapter targets, and per adapter only its A and
scaling·B on the host, written into those layers' Parameters before a call (`use`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from model.layers import Linear

LORA_A, LORA_B = "lora_A", "lora_B"


def lora_delta(lora_a: np.ndarray, lora_b: np.ndarray, scaling: float) -> np.ndarray:
    """scaling * B @ A: the [out, in] update a LoRA pair adds to its base weight (float32)."""
    return (np.float32(scaling) * (lora_b.astype(np.float32) @ lora_a.astype(np.float32))).astype(np.float32)


def _hash_uniform(x: Tensor, salt: float) -> Tensor:
    """Pseudo-random numbers in [0, 1) that are a pure function of x's values and positions.

    Why not ops.dropout: its RNG state lives inside the compiled kernel and is not
    checkpointed, so a resumed run would draw other masks than an uninterrupted
    one. Hashing the input (fract(sin(.) * 43758.5453), the classic shader hash)
    draws the same mask for the same weights and batch, so resume stays exact.
    """
    n, d = x.shape
    rows = ops.arange(n, dtype=ms.float32).reshape(-1, 1)  # [N, 1]
    cols = ops.arange(d, dtype=ms.float32).reshape(1, -1)  # [1, in]
    v = ops.sin(x * 12.9898 + rows * 78.233 + cols * 37.719 + salt) * 43758.5453
    return ops.stop_gradient(v - ops.floor(v))  # [N, in]


class LoRALinear(nn.Cell):
    """A frozen `Linear` plus a trainable low-rank update (rank, alpha, dropout); merge/unmerge in place."""

    def __init__(self, base: Linear, rank: int, alpha: float, dropout: float = 0.0, seed: int = 0):
        super().__init__()
        if rank <= 0 or alpha <= 0 or not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA needs rank > 0, alpha > 0, 0 <= dropout < 1; got {rank}, {alpha}, {dropout}")
        out_f, in_f = base.weight.shape
        self.out_features, self.in_features = out_f, in_f
        self.rank, self.alpha, self.dropout = rank, float(alpha), float(dropout)
        self.scaling = float(alpha) / rank
        self.weight = base.weight  # the base Parameter itself: its data and name are kept
        rng = np.random.RandomState(seed)
        bound = 1.0 / np.sqrt(in_f)  # kaiming_uniform(a=sqrt(5)), as PEFT initialises A
        self.lora_A = Parameter(Tensor(rng.uniform(-bound, bound, (rank, in_f)).astype(np.float32)), name=LORA_A)
        self.lora_B = Parameter(Tensor(np.zeros((out_f, rank), np.float32)), name=LORA_B)
        self.matmul = ops.MatMul(transpose_b=True)
        self.salt = float(seed % 9973)  # decorrelates the dropout masks of different layers
        self.merged = False  # a Python constant under jit: merge before compiling an inference graph

    def construct(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [N, in]
        y = self.matmul(x2, self.weight)  # [N, out]
        if not self.merged:
            h = x2
            if self.training and self.dropout > 0:
                keep = (_hash_uniform(x2, self.salt) >= self.dropout).astype(x2.dtype)
                h = x2 * keep / (1.0 - self.dropout)
            low = self.matmul(h, self.lora_A)  # [N, r]
            y = y + self.matmul(low, self.lora_B) * self.scaling  # [N, out]
        return y.reshape(x.shape[:-1] + (self.out_features,))

    def delta(self) -> np.ndarray:
        return lora_delta(self.lora_A.asnumpy(), self.lora_B.asnumpy(), self.scaling)

    def merge(self) -> None:
        """weight <- weight + scaling * B A; a no-op when already merged."""
        if not self.merged:
            self.weight.set_data(Tensor(self.weight.asnumpy() + self.delta()))
            self.merged = True

    def unmerge(self) -> None:
        """weight <- weight - scaling * B A (equal to the base up to float rounding); a no-op when not merged."""
        if self.merged:
            self.weight.set_data(Tensor(self.weight.asnumpy() - self.delta()))
            self.merged = False


# ----------------------------------------------------------------------------- choosing targets


def _as_target_list(target_modules: str | Sequence[str]) -> list[str] | None:
    """A comma-separated string of plain names ('q_proj,v_proj') is a list; any other string is a regex."""
    if isinstance(target_modules, str):
        if re.fullmatch(r"\s*\w+(\s*,\s*\w+)*\s*", target_modules):
            return [t.strip() for t in target_modules.split(",")]
        return None
    return list(target_modules)


def match_targets(module_names: Iterable[str], target_modules: str | Sequence[str]) -> list[str]:
    """The module names a target spec selects.

    A list (or 'a,b' string) of names matches a module whose last component equals
    one of them (`q_proj` matches `layers.3.self_attn.q_proj`); any other string is
    a regex searched in the full dotted name. Raises ValueError when nothing matches.
    """
    names = list(module_names)
    wanted = _as_target_list(target_modules)
    if wanted is not None:
        picked = [n for n in names if n.rsplit(".", 1)[-1] in wanted]
        leaves = {n.rsplit(".", 1)[-1] for n in names}
        unknown = [w for w in wanted if w not in leaves]
        if unknown:
            raise ValueError(f"LoRA target_modules {unknown} match no projection; available: {sorted(leaves)}")
    else:
        try:
            rx = re.compile(target_modules)
        except re.error as exc:
            raise ValueError(f"LoRA target_modules {target_modules!r} is not a valid regex: {exc}") from None
        picked = [n for n in names if rx.search(n)]
    if not picked:
        raise ValueError(
            f"LoRA target_modules {target_modules!r} match no projection; candidates look like {names[:4]}"
        )
    return picked


def inject_lora(
    net: nn.Cell, target_modules: str | Sequence[str], rank: int, alpha: float, dropout: float = 0.0, seed: int = 0
) -> list[str]:
    """Replace every `Linear` selected by `target_modules` with a `LoRALinear`; returns their names.

    Each adapter's A is drawn from its own RandomState(seed + index in module order),
    so the init is reproducible. Parameter names become `<module>.weight` (unchanged),
    `<module>.lora_A` and `<module>.lora_B`.
    """
    cells = dict(net.cells_and_names())
    if any(isinstance(c, LoRALinear) for c in cells.values()):
        raise ValueError("this network already has LoRA layers; inject once")
    linears = [name for name, c in cells.items() if isinstance(c, Linear) and name]
    chosen = match_targets(linears, target_modules)
    for i, name in enumerate(chosen):
        parent_name, _, attr = name.rpartition(".")
        parent = cells[parent_name] if parent_name else net
        layer = LoRALinear(cells[name], rank, alpha, dropout, seed=seed + i)
        setattr(parent, attr, layer)
        layer.update_parameters_name(name + ".")  # MindSpore prefixes only the attribute name; restore the full path
    return chosen


def lora_layers(net: nn.Cell) -> list[tuple[str, LoRALinear]]:
    return [(name, c) for name, c in net.cells_and_names() if isinstance(c, LoRALinear)]


def is_lora_param(name: str) -> bool:
    return name.endswith("." + LORA_A) or name.endswith("." + LORA_B)


def mark_only_lora_trainable(net: nn.Cell) -> list[Parameter]:
    """Freeze every parameter except lora_A / lora_B; returns the trainable (LoRA) parameters."""
    params = []
    for p in net.get_parameters():
        p.requires_grad = is_lora_param(p.name)
        if p.requires_grad:
            params.append(p)
    if not params:
        raise ValueError("no LoRA parameters in this network; call inject_lora first")
    return params


@dataclass
class TrainableSummary:
    trainable: int
    total: int

    @property
    def share(self) -> float:
        return self.trainable / max(self.total, 1)

    def line(self) -> str:
        return (
            f"trainable params: {self.trainable:,} || all params: {self.total:,} || trainable: {100 * self.share:.4f}%"
        )


def trainable_summary(net: nn.Cell) -> TrainableSummary:
    """Trainable and total parameter counts (LoRA parameters count towards the total)."""
    params = list(net.get_parameters())
    return TrainableSummary(
        trainable=sum(int(np.prod(p.shape)) for p in params if p.requires_grad),
        total=sum(int(np.prod(p.shape)) for p in params),
    )


def lora_state_dict(net: nn.Cell) -> dict[str, np.ndarray]:
    """The adapter weights: {"<module>.lora_A": [r, in], "<module>.lora_B": [out, r]}."""
    return {p.name: p.asnumpy() for p in net.get_parameters() if is_lora_param(p.name)}


def merge_lora(net: nn.Cell) -> int:
    """Merge every LoRA layer into its base weight (idempotent); returns how many layers."""
    layers = lora_layers(net)
    for _, layer in layers:
        layer.merge()
    return len(layers)


def unmerge_lora(net: nn.Cell) -> int:
    """Undo `merge_lora` (idempotent); returns how many layers."""
    layers = lora_layers(net)
    for _, layer in layers:
        layer.unmerge()
    return len(layers)


def merge_adapter(base: dict[str, np.ndarray], adapter: dict[str, np.ndarray], scaling: float) -> dict[str, np.ndarray]:
    """Full weights: base with W + scaling * B A for every adapter pair (base is not modified).

    Every adapter key must be used exactly once and every shape must match, so a
    wrong or partial adapter fails loudly instead of merging half.
    """
    modules = sorted({k.rsplit(".", 1)[0] for k in adapter})
    used = set()
    out = dict(base)
    for m in modules:
        a_key, b_key, w_key = f"{m}.{LORA_A}", f"{m}.{LORA_B}", f"{m}.weight"
        if a_key not in adapter or b_key not in adapter:
            raise ValueError(f"adapter has only one half of {m} (needs {LORA_A} and {LORA_B})")
        if w_key not in base:
            raise ValueError(f"adapter module {m} has no base weight {w_key}; the adapter belongs to another model")
        a, b, w = adapter[a_key], adapter[b_key], base[w_key]
        if a.ndim != 2 or b.ndim != 2 or b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != w.shape:
            raise ValueError(f"adapter {m}: A {a.shape} and B {b.shape} do not fit base weight {w.shape}")
        out[w_key] = (w.astype(np.float32) + lora_delta(a, b, scaling)).astype(w.dtype)
        used.update((a_key, b_key))
    extra = sorted(set(adapter) - used)
    if extra:
        raise ValueError(f"adapter keys not of the form <module>.{LORA_A}/{LORA_B}: {extra[:3]}")
    return out


# ----------------------------------------------------------------------------- many adapters, one base


class LoRASlots:
    """Many LoRA adapters over ONE network, unmerged: `use(name)` makes the net compute, on every module,

        y = x W^T + (x A^T)(scaling B)^T          (the adapter's A, B, scaling; W the base, shared)

    and `use(None)` makes every update exactly zero (x A^T times a zero B adds +0.0 to each output).

    The net gets one `LoRALinear` (scaling 1) per module that any adapter targets, of the largest rank among
    them; `use` copies the adapter's A and its B times its scaling into those layers' lora_A / lora_B
    (zero-padded to that rank, zeros on modules it does not target), in place: a compiled graph reads its
    Parameters' storage at each call, so one compilation serves every adapter. Why `copy_` and not
    `set_data`: set_data swaps the Parameter's tensor, and a graph compiled before keeps reading the old one
    (tests/test_lora.py shows both). Memory: the base weights once, one
    set of LoRA Parameters, and per adapter its (padded) A and scaling·B as host Tensors. A network runs one
    adapter at a time: a caller interleaving sequences of several adapters calls `use` before each call
    (a no-op when that adapter is already in place).

    `adapters`: name -> ({"<module>.lora_A": [r, in], "<module>.lora_B": [out, r]}, scaling), the finetune
    stage's adapter.safetensors and adapter.json `scaling`; every key used once and every shape checked
    against the net, as `merge_adapter` does.
    """

    def __init__(self, net: nn.Cell, adapters: dict[str, tuple[dict[str, np.ndarray], float]]):
        if not adapters:
            raise ValueError("LoRASlots needs at least one adapter")
        if any(n is None for n in adapters):
            raise ValueError("an adapter cannot be named None (None selects the base)")
        weights = {p.name: p for p in net.get_parameters()}
        modules: set[str] = set()
        for name, (ad, _) in adapters.items():
            for key in ad:
                m, _, half = key.rpartition(".")
                if half not in (LORA_A, LORA_B):
                    raise ValueError(f"adapter {name}: key {key!r} is not of the form <module>.{LORA_A}/{LORA_B}")
                if f"{m}.{LORA_A}" not in ad or f"{m}.{LORA_B}" not in ad:
                    raise ValueError(f"adapter {name} has only one half of {m} (needs {LORA_A} and {LORA_B})")
                if f"{m}.weight" not in weights:
                    raise ValueError(
                        f"adapter {name}: module {m} has no base weight {m}.weight; the adapter belongs "
                        f"to another model"
                    )
                modules.add(m)
        rank = max(a.shape[0] for ad, _ in adapters.values() for k, a in ad.items() if k.endswith("." + LORA_A))
        pattern = "^(" + "|".join(re.escape(m) for m in sorted(modules)) + ")$"
        inject_lora(net, pattern, rank=rank, alpha=float(rank))  # scaling 1: each adapter's scaling is in its B
        self.net = net
        self.rank = rank
        self.layers = lora_layers(net)
        zeros = [
            (
                Tensor(np.zeros((rank, layer.in_features), np.float32)),
                Tensor(np.zeros((layer.out_features, rank), np.float32)),
            )
            for _, layer in self.layers
        ]
        self._values: dict[str | None, list[tuple[Tensor, Tensor]]] = {None: zeros}
        for name, (ad, scaling) in adapters.items():
            vals = []
            for (m, layer), zero in zip(self.layers, zeros):
                if f"{m}.{LORA_A}" not in ad:
                    vals.append(zero)
                    continue
                a, b = ad[f"{m}.{LORA_A}"], ad[f"{m}.{LORA_B}"]
                if (
                    a.ndim != 2
                    or b.ndim != 2
                    or b.shape[1] != a.shape[0]
                    or (b.shape[0], a.shape[1]) != (layer.out_features, layer.in_features)
                ):
                    raise ValueError(
                        f"adapter {name} {m}: A {a.shape} and B {b.shape} do not fit base weight "
                        f"{(layer.out_features, layer.in_features)}"
                    )
                pa = np.zeros((rank, layer.in_features), np.float32)
                pb = np.zeros((layer.out_features, rank), np.float32)
                pa[: a.shape[0]] = a
                pb[:, : b.shape[1]] = np.float32(scaling) * b.astype(np.float32)
                vals.append((Tensor(pa), Tensor(pb)))
            self._values[name] = vals
        self.active: str | None = "(unset)"
        self.use(None)

    @property
    def names(self) -> list[str]:
        return [n for n in self._values if n is not None]

    def use(self, name: str | None) -> None:
        """Put adapter `name` (None: the base, every update zero) into the net's LoRA layers."""
        if name == self.active:
            return
        if name not in self._values:
            raise KeyError(f"no adapter {name!r}; this net holds {self.names}")
        for (_, layer), (a, b) in zip(self.layers, self._values[name]):
            layer.lora_A.copy_(a)  # in place (see the class docstring)
            layer.lora_B.copy_(b)
        self.active = name

    def adapter_nbytes(self) -> int:
        """Bytes of the adapters' A and scaling·B held beside the net (padded to the slots' rank)."""
        zeros = self._values[None]
        return sum(
            4 * (int(np.prod(a.shape)) + int(np.prod(b.shape)))
            for n, vals in self._values.items()
            if n is not None
            for ab, zero in zip(vals, zeros)
            if ab is not zero
            for a, b in [ab]
        )
