"""The data artifact's schema, shared by its writer (the data stage) and its reader (tasks/store/reader.py).

DATA_SCHEMA_VERSION   bumped when the stored layout changes; a reader refuses other versions with a hint
SPLITS                the splits every data artifact holds
COLUMNS               the MindRecord columns of a packed block
DataError             bad input, settings or files of a data artifact; the message names the file and the fix
"""

from __future__ import annotations

DATA_SCHEMA_VERSION = 1
SPLITS = ("train", "valid")
COLUMNS = {"input_ids": "int32 [seq_length + 1]", "loss_mask": "int32 [seq_length]"}


class DataError(ValueError):
    """Bad input or settings for the data stage; the message names the file (or key) and the fix."""
