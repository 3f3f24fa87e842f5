"""Continuous batching on the fused decode kernel: several sequences decoded together, one token of each per step
(`Generator.batch(slots)`; the MindSpore serving backend with `msllm serve --parallel`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from model.fused_decode import DecodeError, FusedDecodeStep, SlotCaches

PACK_PROMPTS = 16  # prompts a PackedPrefillStep takes at most (its table's rows)


class BatchDecoder:
    """Sequences decoded together (continuous batching: a server's running requests), one token of each per step:
    `slots` KV caches (`SlotCaches`: pages resident only as positions are written), each sequence prefilled alone
    into its slot (the fused prefill in the Generator's chunks), then one `BatchDecodeStep` per round for every
    running slot, reading each weight matrix once for all of them. Every row is computed as the Generator's own
    fused steps compute that sequence alone (the same prefill chunks, the same order of every sum in the decode
    step), so a sequence's tokens equal `Generator.generate`'s whatever else runs beside it. Needs the fused steps
    and no unmerged LoRA (each sequence's adapter would be its own weights).

        batch = gen.batch(4)
        slot = batch.acquire()
        logits = batch.prefill(slot, prompt_ids)               # [V] after the prompt
        rows = batch.prefill_many([slot, ...], [prompt_ids, ...])  # several prompts in one pass: [V] each
        rows = batch.decode([slot, ...], [position, ...], [token, ...])   # [B, V]
        batch.release(slot)
    """

    def __init__(self, gen, slots: int):
        if gen.decode_path != "fused":
            raise DecodeError(f"batched decoding needs the fused steps: {gen.decode_reason}")
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self.gen, self.slots = gen, slots
        self.caches = SlotCaches(gen.net, slots, gen.max_len)
        args = (self.caches, gen._lib, gen._threads)
        self._prefill = FusedDecodeStep(*args, prefill=True, weights=gen._weights)
        self._decode = FusedDecodeStep(*args, batch=True, weights=gen._weights)
        self._packed = FusedDecodeStep(*args, packed=True, weights=gen._weights)
        # prompts of at most one prefill chunk go into one PackedPrefillStep together: up to `pack_prompts` of them in
        # a chunk of `pack_tokens` tokens (one static shape; only the prompts' own rows are computed)
        self.pack_prompts = min(slots, PACK_PROMPTS)
        self.pack_tokens = self.pack_prompts * gen.prefill_chunk
        self._free = list(range(slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise DecodeError(f"all {self.slots} decode slots are in use")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if slot not in self._free:
            self._free.append(slot)
        if len(self._free) == self.slots:  # nothing left to decode: the kernel's threads sleep now
            self._decode.park()

    def prefill(self, slot: int, ids: Sequence[int]) -> np.ndarray:
        """The prompt `ids` into `slot` (its positions 0..n-1); the logits [V] after it."""
        ids = [int(t) for t in ids]
        if not 0 < len(ids) < self.gen.max_len:
            raise ValueError(f"prompt of {len(ids)} tokens: 1..{self.gen.max_len - 1} (max_len - 1)")
        self._bind()
        logits = None
        for x, start, last in self.gen._chunks(ids, self.gen._fused_chunk(len(ids)), pad_last=True):
            where = np.array([start, last, slot], np.int32)
            logits = self.gen._fused_op(self._prefill, "prefill", start, x, where)
        return logits[0]

    def _bind(self) -> None:
        """The steps' operands where they are now (a sequence is admitted: `FusedDecodeStep.bind`)."""
        for step in (self._prefill, self._decode, self._packed):
            step.bind()

    def prefill_many(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Each prompt into its slot, the logits [V] after each: the prompts of at most `prefill_chunk` tokens
        packed into PackedPrefillStep calls (every weight matrix read once for all of them, each prompt's rows
        computed as `prefill` computes them alone: the same logits and caches, bit for bit), longer ones alone."""
        out: list[np.ndarray | None] = [None] * len(prompts)
        self._bind()
        short = []
        for i, (slot, ids) in enumerate(zip(slots, prompts, strict=True)):
            ids = [int(t) for t in ids]
            if 0 < len(ids) <= self.gen.prefill_chunk and len(ids) < self.gen.max_len:
                short.append((i, slot, ids))
            else:
                out[i] = self.prefill(slot, ids)
        while short:
            group, n = [], 0
            while short and len(group) < self.pack_prompts and n + len(short[0][2]) <= self.pack_tokens:
                group.append(short.pop(0))
                n += len(group[-1][2])
            if len(group) == 1:
                i, slot, ids = group[0]
                out[i] = self.prefill(slot, ids)
                continue
            tokens = np.zeros((1, self.pack_tokens), np.int32)
            table = np.zeros((self.pack_prompts, 3), np.int32)
            at = 0
            for k, (_, slot, ids) in enumerate(group):
                tokens[0, at : at + len(ids)] = ids
                table[k] = (slot, 0, len(ids))
                at += len(ids)
            rows = self.gen._fused_op(self._packed, "packed prefill", 0, tokens, table)
            for k, (i, _, _) in enumerate(group):
                out[i] = rows[k]
        return out

    def decode(self, slots: Sequence[int], positions: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """One token of each running sequence: `tokens[b]` at `positions[b]` of slot `slots[b]` -> logits [B, V]."""
        where = np.stack([np.asarray(slots, np.int32), np.asarray(positions, np.int32)], 1)
        tok = np.asarray(tokens, np.int32)
        return self.gen._fused_op(self._decode, "batch decode", int(max(positions)), tok, where)
