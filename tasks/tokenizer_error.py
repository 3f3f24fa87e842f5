"""The tokenizer's one error class, in a module of its own: `tasks.tokenizer` (the files) and `tasks.prompts` (the chat
template's bounded rendering, which the tokenizer calls) both raise it without importing each other."""

from __future__ import annotations


class TokenizerError(ValueError):
    """A tokenizer file is missing, unreadable or inconsistent; the message names the file and the fix."""
