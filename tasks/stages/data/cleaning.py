"""Step 2: clean documents (normalize, drop binary/invalid/empty/short/long/duplicate ones), counting every drop."""

from __future__ import annotations

import hashlib
import unicodedata
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tasks.stages.data.schema import MAX_REPLACEMENT_FRACTION, SKIP_REASONS

if TYPE_CHECKING:
    from tasks.config.schema import CleanSection

# ----------------------------------------------------------------------------- cleaning


@dataclass
class CleanStats:
    """What cleaning saw and dropped; every document seen is kept or counted under one reason."""

    seen: int = 0
    kept: int = 0
    bytes_seen: int = 0
    bytes_kept: int = 0
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SKIP_REASONS, 0))
    repaired: dict[str, int] = field(default_factory=lambda: {"invalid_utf8": 0, "normalized": 0})
    files: int = 0
    skipped_files: list[dict[str, str]] = field(default_factory=list)


class Cleaner:
    """Apply `data.clean` to documents one at a time; `kept` holds the surviving texts in order."""

    def __init__(self, clean: CleanSection, stats: CleanStats | None = None):
        self.c = clean
        self.stats = stats or CleanStats()
        self.kept: list[str] = []
        self.kept_bytes: list[int] = []
        self._hashes: set[bytes] = set()

    def _skip(self, reason: str) -> None:
        self.stats.skipped[reason] += 1

    def add(self, text: str) -> bool:
        s = self.stats
        s.seen += 1
        try:
            raw, valid = text.encode("utf-8"), True
        except UnicodeEncodeError:  # lone surrogates: undecodable input bytes or JSON \ud800 escapes
            try:
                raw = text.encode("utf-8", "surrogateescape")
            except UnicodeEncodeError:
                raw = text.encode("utf-8", "surrogatepass")
            valid = False
        s.bytes_seen += len(raw)
        if "\x00" in text:
            self._skip("binary")
            return False
        if not valid:
            if self.c.invalid_utf8 == "skip":
                self._skip("invalid_utf8")
                return False
            text = raw.decode("utf-8", "replace")
        if text and text.count("\ufffd") > MAX_REPLACEMENT_FRACTION * len(text):
            self._skip("mostly_invalid")
            return False
        if not valid:
            s.repaired["invalid_utf8"] += 1
        if self.c.normalize != "none" and not unicodedata.is_normalized(self.c.normalize, text):
            text = unicodedata.normalize(self.c.normalize, text)
            s.repaired["normalized"] += 1
        if not text:
            self._skip("empty")
            return False
        if text.isspace():
            self._skip("whitespace")
            return False
        if len(text) < self.c.min_chars:
            self._skip("too_short")
            return False
        if self.c.max_chars is not None and len(text) > self.c.max_chars:
            self._skip("too_long")
            return False
        data = text.encode("utf-8")
        if self.c.dedup:
            h = hashlib.sha256(data).digest()
            if h in self._hashes:
                self._skip("duplicate")
                return False
            self._hashes.add(h)
        s.kept += 1
        s.bytes_kept += len(data)
        self.kept.append(text)
        self.kept_bytes.append(len(data))
        return True
