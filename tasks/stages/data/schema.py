"""The data stage's constants: the skip reasons every step counts, and the writer's MindRecord sizes. The
schema it shares with the reader (COLUMNS, SPLITS, DataError, ...) is tasks/store/data_schema.py's."""

from __future__ import annotations

SKIP_REASONS = ("binary", "invalid_utf8", "mostly_invalid", "empty", "whitespace", "too_short", "too_long", "duplicate")
MAX_REPLACEMENT_FRACTION = 0.5  # a document with more U+FFFD than this (after repair) is `mostly_invalid`
_SNIFF_BYTES = 8192
_MR_PAGE_SIZE = 1 << 20  # MindRecord pads every blob page to this size; the default (32 MiB) bloats small shards
_MR_HEADER_SIZE = 1 << 20  # room for ~6000 page entries (a few GB per shard)
_WRITE_BATCH = 2048
