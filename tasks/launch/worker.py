"""What msrun starts on every rank: `worker.py --stage pretrain --child spec.json`.

A script (msrun runs `python <script>`), kept alone in its directory so that the
directory Python puts first on sys.path holds nothing that could shadow a module.
"""

import argparse
import importlib
import sys

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", required=True, choices=["pretrain", "finetune"])
    ap.add_argument("--child", required=True)
    args = ap.parse_args()
    sys.path.pop(0)  # this directory
    from tasks.supervise import child_main

    module = importlib.import_module(f"tasks.{args.stage}")
    sys.exit(child_main(module.train, ["--child", args.child]))
