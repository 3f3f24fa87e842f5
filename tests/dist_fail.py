"""Run under msrun (tests/test_distributed.py): rank 1 fails with its own error while rank 0 waits on a collective."""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)
    import mindspore as ms

    from tasks.runtime.mesh import Mesh

    ms.set_device("CPU")
    mesh = Mesh.init(dp=2, tp=1)
    if mesh.rank == 1:
        print("error: the corpus shard of rank 1 is unreadable (injected)", file=sys.stderr, flush=True)
        sys.exit(1)
    mesh.barrier()  # rank 0 blocks here until msrun stops the job
    print("rank 0 passed the barrier", flush=True)
