"""What msrun starts on every rank: `worker.py --stage pretrain --entry tasks.stages.pretrain:train --child spec.json`.

A script (msrun runs `python <script>`), kept alone in its directory so that the
directory Python puts first on sys.path holds nothing that could shadow a module
(`tasks/runtime/distributed.py` would shadow Dask's `distributed`). The stage's
entry point is named by its dotted path (the stage table's `Stage.entry`).
"""

import argparse
import sys

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", required=True)
    ap.add_argument("--entry", required=True)
    ap.add_argument("--child", required=True)
    args = ap.parse_args()
    sys.path.pop(0)  # this directory
    from tasks.runtime.child import main

    sys.exit(main(["--stage", args.stage, "--entry", args.entry, "--child", args.child]))
