"""The data stage's constants: the schema it shares with the reader (tasks/store/data_schema.py), the skip
reasons every step counts, and the writer's MindRecord sizes."""

from __future__ import annotations

from tasks.store.data_schema import COLUMNS, DATA_SCHEMA_VERSION, SPLITS, DataError  # noqa: F401 (the stage's API)

SKIP_REASONS = ("binary", "invalid_utf8", "mostly_invalid", "empty", "whitespace", "too_short", "too_long", "duplicate")
MAX_REPLACEMENT_FRACTION = 0.5  # a document with more U+FFFD than this (after repair) is `mostly_invalid`
_SNIFF_BYTES = 8192
_MR_PAGE_SIZE = 1 << 20  # MindRecord pads every blob page to this size; the default (32 MiB) bloats small shards
_MR_HEADER_SIZE = 1 << 20  # room for ~6000 page entries (a few GB per shard)
_WRITE_BATCH = 2048

