"""The child process of a supervised stage: `python -m tasks.runtime.child --stage NAME --child spec.json`.

The stage's entry point comes from the stage table (`tasks.stages.child_entry`); the child prints
the artifact path on success, one `error:` line on failure (see `supervise.child_main`).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", required=True)
    ap.add_argument("--child", required=True)
    args = ap.parse_args(argv)
    from tasks.runtime.supervise import child_main
    from tasks.stages import child_entry

    return child_main(child_entry(args.stage), ["--child", args.child])


if __name__ == "__main__":
    sys.exit(main())
