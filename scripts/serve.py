"""Register and serve the deployments on a Prefect server (PREFECT_API_URL), until interrupted.

    prefect server start                     # in another terminal (or any reachable server)
    python scripts/serve.py [--pipeline demo] [--cron "0 3 * * 1"] [--artifacts DIR]
    prefect deployment run 'full-pipeline/full-pipeline'

Deployments: full-pipeline/full-pipeline, one per stage (data-stage/data-only,
pretrain-stage/pretrain-only, …, eval-stage/eval-only), and
continued-pretraining/scheduled on a cron schedule.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def deployments(pipeline: str, config: str, artifacts: str, cron: str | None, inbox: str | None):
    from flows import stage_flows
    from flows.continued import continued_pretraining
    from flows.full_pipeline import full_pipeline

    params = {"pipeline": pipeline, "config": str(Path(config).resolve()), "artifacts": str(Path(artifacts).resolve())}
    out = [full_pipeline.to_deployment(name="full-pipeline", parameters=params)]
    for name, fl in stage_flows.STAGE_FLOWS.items():
        out.append(fl.to_deployment(name=f"{name}-only", parameters=params))
    cont = dict(params, **({"inbox": inbox} if inbox else {}))
    out.append(continued_pretraining.to_deployment(name="scheduled", parameters=cont, cron=cron) if cron
               else continued_pretraining.to_deployment(name="scheduled", parameters=cont))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipeline", default="demo")
    ap.add_argument("--config", default=str(REPO / "pipelines.yaml"))
    ap.add_argument("--artifacts", default=str(REPO / "artifacts"))
    ap.add_argument("--cron", default=os.environ.get("MSLLM_CONTINUED_CRON", "0 3 * * 1"),
                    help="schedule of continued-pretraining/scheduled ('' for none); default Mondays 03:00")
    ap.add_argument("--inbox", default=None, help="inbox directory (default: the pipeline's continued.inbox)")
    a = ap.parse_args()
    from prefect import serve

    serve(*deployments(a.pipeline, a.config, a.artifacts, a.cron or None, a.inbox))
    return 0


if __name__ == "__main__":
    sys.exit(main())
