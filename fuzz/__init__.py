"""Fuzz targets for every parser that reads untrusted bytes (issue 53), on hypothesis:

    .venv/bin/python -m fuzz --list                         # the targets
    .venv/bin/python -m fuzz gguf --examples 2000           # one target, in a process of its own
    .venv/bin/python -m fuzz all --seconds 30               # every target, 30 s each (the CI smoke run: fewer)

Each target (fuzz/targets.py) feeds generated inputs (mutations of a valid seed built from the tests' own inputs:
fuzz/seeds.py, and structured values) to one reader and holds the contract: a valid result, or one error of the
project's own type for that reader, within a time bound per input and a memory limit on the process (RLIMIT_AS);
never another exception, a hang or a crash. A violation prints the input and exits 1. docs/RELIABILITY.md has how
long each ran and what it found.
"""
