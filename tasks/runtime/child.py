"""The child process of a supervised stage: `python -m tasks.runtime.child --stage NAME --entry MODULE:FUNC --child
spec.json`.

The entry point is named by its dotted path (the stage table's `Stage.entry`, e.g. `tasks.stages.pretrain:train`,
resolved by `supervise.entry_point`),
which the supervisor reads off the function it was handed; the runtime never imports the stage table. The child
prints the artifact path on success, one `error:` line on failure (see `supervise.child_main`).
"""

from __future__ import annotations

import argparse
import sys

from tasks.runtime.supervise import child_main, entry_point


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", required=True)
    ap.add_argument("--entry", required=True)
    ap.add_argument("--child", required=True)
    args = ap.parse_args(argv)
    return child_main(entry_point(args.entry), ["--child", args.child])


if __name__ == "__main__":
    sys.exit(main())
