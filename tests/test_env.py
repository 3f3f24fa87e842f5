"""The pinned dependency set imports cleanly: MindSpore runs tensor ops without the NumPy 2 ABI failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CODE = r"""
import numpy as np
import mindspore as ms
ms.set_device("CPU")
from mindspore import nn, ops
emb = nn.Embedding(10, 4)                      # goes through MindSpore's NumPy bridge
out = emb(ms.Tensor(np.array([[1, 2]], np.int32)))
y = ops.matmul(ms.Tensor(np.ones((2, 3), np.float32)), ms.Tensor(np.ones((3, 2), np.float32)))
assert out.shape == (1, 2, 4) and float(y.asnumpy().sum()) == 12.0
import datasets, prefect, lm_eval, onnx, onnxruntime, sentencepiece, pyarrow  # noqa: F401
print("numpy", np.__version__, "pyarrow", pyarrow.__version__, "mindspore", ms.__version__)
"""


def test_mindspore_tensor_ops_without_numpy2_warning():
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "compiled using NumPy 1.x cannot be run in NumPy 2" not in out
    assert "SystemError" not in out
    assert "numpy 1." in r.stdout


def test_importing_flows_gives_prefects_embedded_server_time_to_start():
    """Prefect's embedded server gets 20 s to answer by default; its first start (a fresh SQLite database, migrated)
    took 16 s on an idle 2-core machine and over 20 s in CI, failing the flow before it ran. Importing `flows`
    raises the default before Prefect reads its settings, and leaves a value the environment sets alone."""
    code = (
        "import flows\n"  # what every flow module imports first
        "from prefect.settings import get_current_settings\n"
        "print(get_current_settings().server.ephemeral.startup_timeout_seconds)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"}
    repo = str(Path(__file__).resolve().parent.parent)
    for given, expected in ((None, "120"), ("7", "7")):
        e = dict(env, **({"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": given} if given else {}))
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=repo, env=e)
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.split()[-1] == expected, (given, r.stdout)
