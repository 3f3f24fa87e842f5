"""What runs the model behind `msllm serve`: one backend per artifact kind, one interface.

    backend = load_backend(path)       # export artifact -> onnxruntime, model artifact -> MindSpore
    backend.kind, backend.context_length, backend.vocab_size, backend.eos_id, backend.tokenizer
    backend.decode_info                # {"path", "reason", "weights"}: how it decodes, chosen once at load (/health)
    backend.prompt_style               # how chat requests are rendered: the artifact's prompt_style.json
    backend.warmup()                   # compile / run once so the first request is not the slow one
    steps = backend.steps(prompt_ids)  # a coroutine: yields the logits [V] for the next position
    logits = next(steps)               # prefill (the whole prompt in one call)
    logits = steps.send(token)         # one decode step through the KV cache
    steps.close()
    logits = backend.prompt_logits(ids)  # [T, V] fp32: every position of the prompt (echo / prompt logprobs)

Each `steps` coroutine owns its KV cache, so any number of them can be interleaved (the
engine does, one token each per round) and each yields what it would yield alone.
A backend with `batched = True` (onnxruntime; MindSpore with `parallel` > 1: a KV cache slot per sequence) also keeps
a running batch for the engine, and may cap how many sequences run (`max_active`):

    logits = backend.prefill(key, prompt_ids)    # the sequence `key` alone, then it joins the batch
    rows = backend.decode({key: token, ...})     # one call for every sequence of the batch -> {key: logits}
    backend.release(key)                         # done; its row leaves before the next call

Every backend also names its sampler, `backend.sample_next` (the same arithmetic on both).

LoRA adapters unmerged (MindSpore only): `MindSporeBackend(path, adapters={"a": finetune_dir, ...})` holds the
base weights once and each adapter's A and B (`model.lora.LoRASlots`); `backend.adapter("a")` is a backend of
its own (the same interface, the same network) whose every call runs with adapter a's update, and the base
backend's calls with none."""

from __future__ import annotations

import json
from collections.abc import Generator
from pathlib import Path

import numpy as np

from model.runtime import setup_mindspore
from model.sampling import sample_next
from tasks.store.model_artifact import load_prompt_style, load_tokenizer
from tasks.store.published import verify_published
from tasks.store.tensors import read_tensors
from tasks.tokenizer import load_tokenizer as read_tokenizer
from tasks.tokenizer import tokenizer_files


def artifact_kind(path: str | Path) -> str:
    """'export' or 'model' by the files of the directory; ValueError naming what is missing."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(
            f"{path}: not a directory; pass an export artifact or a model artifact (pretrain, merged, convert)"
        )
    if (p / "export.json").is_file() or (p / "model.onnx").is_file():
        return "export"
    if (p / "model.json").is_file() and (p / "model.safetensors").is_file():
        return "model"
    if (p / "adapter.json").is_file():
        raise ValueError(
            f"{path}: a finetune artifact holds only the LoRA adapter; serve its merged artifact "
            f"(`msllm finetune` prints it) or an export of it"
        )
    raise ValueError(
        f"{path}: neither an export artifact (export.json, model.onnx) nor a model artifact "
        f"(model.json, model.safetensors)"
    )


class MindSporeBackend:
    """A model artifact on MindSpore: `model.generate.Generator`'s jit-compiled prefill and KV-cache decode step.

    `adapters` (name -> finetune artifact directory of a LoRA adapter trained on this model): served unmerged,
    one network for all (see the module docstring); `adapter(name)` is that adapter's backend.

    `parallel` (> 1, no adapters, the fused steps running): the running sequences are decoded together, one
    `BatchDecodeStep` per round over `parallel` KV cache slots (`model.batch_decode.BatchDecoder`: continuous batching,
    each sequence prefilled alone into its slot, every row computed as it is alone, so a request's tokens are the
    same alone or among others); `max_active` caps the engine at `parallel` sequences, the rest queue. A slot's
    cache pages are resident only as its positions are written. Otherwise (`parallel` 1, adapters, no fused
    kernel) sequences interleave, each through its own `steps` coroutine.

    `weights` fp16 / q8_0 with `lean` (and no adapters): the network is loaded with only those matrices
    (`load_network(..., weights=)`: no float32 copy; SmolLM2-135M's process is the runtime + 0.19 GB at q8_0): only
    the fused steps run such a network, so without batching its sequences run one at a time (`max_interleaved` 1:
    the engine queues the others). With lean False, or adapters, the float32 network is kept beside the copies.
    """

    kind = "mindspore"

    def __init__(
        self,
        path: str | Path,
        adapters: dict[str, Path] | None = None,
        weights: str = "fp32",
        lean: bool = True,
        parallel: int = 1,
    ):

        setup_mindspore()
        from tasks.modeling.build import generator, load_network  # lazy: MindSpore (an export needs onnxruntime only)

        self.path = Path(path)
        # the tokenizer first: its parse's transient peak then falls under the weights' load, not on top of them
        self.tokenizer = load_tokenizer(path)
        net, self.info = load_network(path, weights=weights if lean and not adapters else "fp32")
        self.net = net
        self.prompt_style = load_prompt_style(path, self.tokenizer)  # how chat requests are rendered
        # before the Generator: its compiled graphs then hold the LoRA layers, and serve every adapter
        self.slots = _lora_slots(net, adapters) if adapters else None
        # eval.fused_kernels' default (model.kernels.off_reason decides); `weights`: the fused steps' matrices
        self.generator = generator(net, fused=True, weights=weights)
        # the engine's caps on running sequences, batched and interleaved (None: the engine's own)
        self.batched = parallel > 1 and not adapters and self.generator.decode_path == "fused"
        self._batch = self.generator.batch(parallel) if self.batched else None
        self._rows: dict = {}  # a batched sequence (the engine's key) -> [slot, next position]
        self.max_active = parallel if self.batched else None
        self.max_interleaved = 1 if self.generator.lean else None
        self.sample_next = sample_next
        self.context_length = int(self.generator.max_len)
        self.vocab_size = int(net.config.vocab_size)
        self.eos_id = int(self.tokenizer.eos_id())

    @property
    def decode_info(self) -> dict[str, str]:
        """The Generator's decode path and why (chosen when it was built; a failure mid-sequence is an error)."""
        g = self.generator
        info = {"path": g.decode_path, "reason": g.decode_reason, "weights": g.weights}
        if self.batched:
            info["sequences"] = f"batched: up to {self._batch.slots} decoded together (BatchDecodeStep)"
        elif g.lean:
            info["sequences"] = "one at a time: only the fused steps run a network holding only its stored matrices"
        return info

    # ---- continuous batching (`batched`): the engine's prefill / decode / release, keyed by its sequence objects

    def prefill(self, key, prompt_ids: list[int]) -> np.ndarray:
        """The prompt into a free slot; the logits [V] after it. The sequence `key` joins the batch."""
        return self.prefill_many({key: prompt_ids})[key]

    def prefill_many(self, prompts: dict) -> dict:
        """Several sequences' prompts at once, {key: prompt ids} -> {key: logits [V]}, each into a free slot: the
        short ones in one pass (BatchDecoder.prefill_many, the same logits as `prefill` alone). Each joins the batch."""
        keys, slots = list(prompts), []
        try:
            for _ in keys:
                slots.append(self._batch.acquire())
            out = self._batch.prefill_many(slots, [prompts[k] for k in keys])
        except BaseException:
            for slot in slots:
                self._batch.release(slot)
            raise
        for k, slot in zip(keys, slots, strict=True):
            self._rows[k] = [slot, len(prompts[k])]
        return dict(zip(keys, out, strict=True))

    def decode(self, tokens: dict) -> dict:
        """One step for every sequence given: {key: token} -> {key: logits [V]}, one BatchDecodeStep."""
        keys = list(tokens)
        rows = [self._rows[k] for k in keys]
        out = self._batch.decode([r[0] for r in rows], [r[1] for r in rows], [int(tokens[k]) for k in keys])
        for r in rows:
            r[1] += 1
        return {k: out[i] for i, k in enumerate(keys)}

    def release(self, key) -> None:
        """The sequence `key` is done (idempotent): its slot is free for the next prefill."""
        row = self._rows.pop(key, None)
        if row is not None:
            self._batch.release(row[0])

    def steps(self, prompt_ids: list[int], adapter: str | None = None) -> Generator[np.ndarray, int, None]:
        # Generator.generate's own coroutine (the prompt in fixed chunks, each one kernel call or one static graph;
        # one fused or compiled decode step): the same arithmetic as `msllm predict`.
        ids = [int(t) for t in prompt_ids]
        if self.slots is None:
            return self.generator._cached_steps(ids)
        return self._adapter_steps(ids, adapter)

    def _adapter_steps(self, ids: list[int], adapter: str | None):
        """The Generator's coroutine with `adapter` (None: the base) put in place before each of its calls: the
        engine interleaves sequences of every adapter on the one network. The base's sequences may take the
        fused decode step (their LoRA updates are zero); an adapter's take the decoder's MindSpore kernels,
        which apply its update (the fused step reads the base weights alone)."""
        use = self.slots.use
        inner = self.generator._cached_steps(ids, base_only=adapter is None)
        try:
            use(adapter)
            logits = next(inner)
            while True:
                tok = yield logits
                use(adapter)
                logits = inner.send(tok)
        finally:
            inner.close()

    def prompt_logits(self, ids: list[int], adapter: str | None = None) -> np.ndarray:
        """The logits [T, V] at every position of `ids`: the decoder a layer at a time through one dynamic-shape
        layer graph, then the head (Generator.prompt_logits: compiled once, not once per prompt length)."""
        if self.slots is not None:
            self.slots.use(adapter)
        return self.generator.prompt_logits(ids)

    def warmup(self, adapter: str | None = None) -> None:
        """Compile the prefill (one graph for every prompt length) and the decode step; and, where the fused steps
        take prompts past FUSED_PREFILL_CHUNK tokens in longer chunks, that chunk's step too (~4 s at SmolLM2-135M,
        which the first long prompt would otherwise wait for)."""
        s = self.steps([self.eos_id], adapter)
        next(s)
        s.send(self.eos_id)
        s.close()
        long = self.generator.long_prompt()
        if adapter is None and long is not None:
            s = self.steps([self.eos_id] * long, adapter)
            next(s)
            s.close()
        if self._batch is not None:  # the slot prefill (short and long chunks) and every batch size's decode step
            b = self._batch
            slots = [b.acquire() for _ in range(b.slots)]
            for n in [1] + ([long] if long is not None else []):
                b.prefill(slots[0], [self.eos_id] * n)
            b.prefill_many(slots[:2], [[self.eos_id]] * 2)  # the packed prefill of admitted requests
            for k in range(1, b.slots + 1):
                b.decode(slots[:k], [1] * k, [self.eos_id] * k)
            for slot in slots:
                b.release(slot)

    def adapter(self, name: str) -> AdapterBackend:
        """Adapter `name`'s backend: this network, with its update on every call."""
        if self.slots is None or name not in self.slots.names:
            raise KeyError(f"no unmerged adapter {name!r} on {self.path}")
        return AdapterBackend(self, name)


class AdapterBackend:
    """One unmerged LoRA adapter of a `MindSporeBackend`, as a backend of its own for the engine: the base's
    network, tokenizer and sampler; every call with the adapter's update in place."""

    def __init__(self, base: MindSporeBackend, name: str):
        self.base, self.name = base, name
        self.kind, self.path, self.net = base.kind, base.path, base.net
        self.tokenizer, self.sample_next, self.eos_id = base.tokenizer, base.sample_next, base.eos_id
        self.prompt_style = base.prompt_style
        self.context_length, self.vocab_size = base.context_length, base.vocab_size

    def steps(self, prompt_ids: list[int]) -> Generator[np.ndarray, int, None]:
        return self.base.steps(prompt_ids, self.name)

    def prompt_logits(self, ids: list[int]) -> np.ndarray:
        return self.base.prompt_logits(ids, self.name)

    def warmup(self) -> None:
        """Compile the decoder's decode step (the path an adapter's tokens take; the base may have taken the fused
        one)."""
        self.base.warmup(self.name)


def _lora_slots(net, adapters: dict[str, Path]):
    """`model.lora.LoRASlots` over `net` with each finetune artifact's adapter.safetensors and adapter.json scaling."""

    from model.lora import LoRASlots  # lazy: MindSpore

    loaded = {}
    for name, ft in adapters.items():
        cfg = json.loads(verify_published(Path(ft) / "adapter.json").read_text())
        if cfg.get("method", "lora") != "lora":
            raise ValueError(
                f"adapter {name}: {ft} is a {cfg.get('method')} finetune (full weights), not LoRA; "
                f"serve its merged artifact"
            )
        weights = read_tensors(
            verify_published(Path(ft) / "adapter.safetensors"), f"rerun the finetune stage ({ft} is damaged)"
        )
        loaded[name] = (weights, float(cfg["scaling"]))
    return LoRASlots(net, loaded)


def load_backend(path: str | Path, weights: str = "fp32", lean: bool = True, parallel: int = 1):
    """The backend for an artifact directory (see `artifact_kind`); `weights`: a model artifact's decode weights
    (`lean`, `parallel`: as MindSporeBackend)."""
    kind = artifact_kind(path)
    if kind == "model":
        return MindSporeBackend(path, weights=weights, lean=lean, parallel=parallel)
    return OnnxBackend(path)


class OnnxBackend:
    """An export artifact on onnxruntime alone (numpy, onnxruntime, sentencepiece; no MindSpore import).

    `tasks.deploy.onnx_generate.OnnxGenerator` over the exported KV-cache decoder: one prefill call
    over the prompt, then one call per token feeding `present` back as `past`, and its
    `sample_next` (the same arithmetic as MindSpore's), so tokens equal `OnnxGenerator.generate`.
    """

    kind = "onnxruntime"
    batched = True  # the engine may decode all active sequences in one call (see prefill / decode / release)

    def __init__(self, path: str | Path, threads: int | None = None):
        from tasks.deploy.onnx_generate import OnnxGenerator  # lazy: onnxruntime (a model artifact needs none)

        self.path = Path(path)
        if not (self.path / "model.onnx").is_file() or not tokenizer_files(self.path):
            missing = "model.onnx" if not (self.path / "model.onnx").is_file() else "tokenizer.model or tokenizer.json"
            raise ValueError(
                f"{path}: no {missing}; pass an export artifact directory (the path `msllm export` prints)"
            )
        for f in (self.path / "model.onnx", *tokenizer_files(self.path)):
            verify_published(f)  # what is served is what the export published
        self.generator = OnnxGenerator(self.path / "model.onnx", threads=threads)  # ValueError for a pre-KV export
        self.tokenizer = read_tokenizer(self.path)  # its files verified above
        self.prompt_style = load_prompt_style(self.path, self.tokenizer)  # copied from the model by export
        self.sample_next = sample_next
        self.context_length = int(self.generator.max_len)
        self.vocab_size = int(self.generator.vocab_size or self.tokenizer.get_piece_size())
        self.eos_id = int(self.tokenizer.eos_id())
        self._state = None  # KVState of the running batch, rows in the order of self._rows
        self._rows: list = []
        self._dead: set = set()
        self.decode_info = {
            "path": "onnxruntime",
            "reason": f"an export artifact: {self.path / 'model.onnx'} on "
            "onnxruntime's CPU execution provider, batched decode",
            "weights": "fp32",
        }

    # ---- continuous batching: each sequence is prefilled alone (batch 1, exactly as `OnnxGenerator`), then
    # joins the running batch, left-padded to the batch's cache length (attention_mask 0 over the padding,
    # position_ids its own), so one call per round decodes every active sequence and each row sees what it
    # would see alone. Rows that finish are dropped (and all-padding cache columns trimmed) before the next call.

    def prefill(self, key, prompt_ids: list[int]) -> np.ndarray:
        """Logits [V] after the prompt; the sequence `key` joins the batch."""
        logits, state = self.generator.prefill([[int(t) for t in prompt_ids]])
        self._compact()
        if self._state is None:
            self._state, self._rows = state, [key]
        else:
            from tasks.deploy.onnx_generate import KVState  # lazy: onnxruntime

            a, b = self._state, state
            n = max(a.length, b.length)
            past = {
                k: np.concatenate([_left_pad(a.past[k], n - a.length, 2), _left_pad(b.past[k], n - b.length, 2)])
                for k in a.past
            }
            mask = np.concatenate(
                [_left_pad(a.attention_mask, n - a.length, 1), _left_pad(b.attention_mask, n - b.length, 1)]
            )
            self._state = KVState(past, mask, np.concatenate([a.positions, b.positions]))
            self._rows.append(key)
        return logits[0]

    def decode(self, tokens: dict) -> dict:
        """One decode step for every sequence of the batch: {key: token} -> {key: logits [V]}."""
        self._compact()
        if set(tokens) != set(self._rows):
            raise RuntimeError(f"decode got {len(tokens)} tokens for a batch of {len(self._rows)} sequences")
        logits = self.generator.step(self._state, [tokens[k] for k in self._rows])
        return {k: logits[i] for i, k in enumerate(self._rows)}

    def release(self, key) -> None:
        """The sequence `key` is done (idempotent); its row goes at the next call."""
        if key in self._rows:
            self._dead.add(key)

    def _compact(self) -> None:
        if not self._dead:
            return
        keep = [i for i, k in enumerate(self._rows) if k not in self._dead]
        self._rows = [self._rows[i] for i in keep]
        self._dead.clear()
        if not keep:
            self._state = None
            return
        st = self._state
        mask = st.attention_mask[keep]
        first = int(np.argmax(mask.any(axis=0)))  # the cache columns before it are padding in every row left
        st.past = {k: np.ascontiguousarray(v[keep][:, :, first:]) for k, v in st.past.items()}
        st.attention_mask = mask[:, first:]
        st.positions = st.positions[keep]

    def prompt_logits(self, ids: list[int]) -> np.ndarray:
        """The logits [T, V] at every position of `ids` (one forward, no cache kept)."""
        return self.generator.logits([[int(t) for t in ids]])[0]

    # ---- one sequence alone

    def steps(self, prompt_ids: list[int]) -> Generator[np.ndarray, int, None]:
        logits, state = self.generator.prefill([[int(t) for t in prompt_ids]])
        tok = yield logits[0]
        while True:
            tok = yield self.generator.step(state, [tok])[0]

    def warmup(self) -> None:
        s = self.steps([self.eos_id])
        next(s)
        s.send(self.eos_id)
        s.close()


def _left_pad(x: np.ndarray, n: int, axis: int) -> np.ndarray:
    if n == 0:
        return x
    width = [(0, 0)] * x.ndim
    width[axis] = (n, 0)
    return np.pad(x, width)
