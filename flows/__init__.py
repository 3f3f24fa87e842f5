"""Prefect flows over the stages (flows/stages.py): full-pipeline, one flow per stage, continued pretraining.

Importing this package first sets one Prefect default that the project needs on small machines (only where the
environment does not set it already): Prefect's embedded server must answer within
PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, 20 s by default. Its first start on a fresh PREFECT_HOME creates
and migrates its SQLite database: 16 s on an idle 2-core machine, over 20 s on a busy one, where the flow then
fails before it runs ("Timed out while attempting to connect to ephemeral Prefect API server"). Prefect reads its
settings once, when it is first imported (docs/PIPELINE.md, "Orchestration"), so this must run before `import prefect`;
the variable also reaches child processes.
"""

import os

EPHEMERAL_STARTUP_TIMEOUT_S = "120"
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", EPHEMERAL_STARTUP_TIMEOUT_S)
