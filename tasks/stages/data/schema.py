"""The data artifact's schema, its error type and the counters every step shares."""

from __future__ import annotations

from typing import TYPE_CHECKING


if TYPE_CHECKING:
    pass

DATA_SCHEMA_VERSION = 1
SPLITS = ("train", "valid")
SKIP_REASONS = ("binary", "invalid_utf8", "mostly_invalid", "empty", "whitespace", "too_short", "too_long", "duplicate")
MAX_REPLACEMENT_FRACTION = 0.5  # a document with more U+FFFD than this (after repair) is `mostly_invalid`
COLUMNS = {"input_ids": "int32 [seq_length + 1]", "loss_mask": "int32 [seq_length]"}
_SNIFF_BYTES = 8192
_MR_PAGE_SIZE = 1 << 20  # MindRecord pads every blob page to this size; the default (32 MiB) bloats small shards
_MR_HEADER_SIZE = 1 << 20  # room for ~6000 page entries (a few GB per shard)
_WRITE_BATCH = 2048


class DataError(ValueError):
    """Bad input or settings for the data stage; the message names the file (or key) and the fix."""
