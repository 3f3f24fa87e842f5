"""The pinned dependency set imports cleanly: MindSpore runs tensor ops without the NumPy 2 ABI failure."""

from __future__ import annotations

import subprocess
import sys

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
