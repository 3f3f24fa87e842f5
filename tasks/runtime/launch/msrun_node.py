"""msrun for a node other than 0 (`parallel.node_rank > 0`): the same launcher, minus the scheduler.

MindSpore's msrun starts the cluster's scheduler on every node that owns `master_addr`
(mindspore/parallel/cluster/process_entity/_api.py: `is_master = _is_local_ip(master_addr)`),
not on node 0 only. When two nodes share one host (containers on the host network, or the
two "nodes" of tests/test_scaleout.py) both would start one: the loser's bind fails and its
msrun exits 1 after training. Here node 0 always hosts the scheduler, so the other nodes run
msrun with that check answering "not this host". Arguments are msrun's own.
"""

import sys

if __name__ == "__main__":
    sys.path.pop(0)  # this directory
    from mindspore.parallel.cluster.process_entity import _api

    if not callable(getattr(_api, "_is_local_ip", None)):
        sys.exit(
            "error: this MindSpore's msrun decides where the scheduler runs differently (no "
            "process_entity._api._is_local_ip); update tasks/runtime/launch/msrun_node.py for it"
        )
    _api._is_local_ip = lambda address: False  # only decides whether this msrun starts the scheduler
    from mindspore.parallel.cluster.run import main

    sys.argv[0] = "msrun"
    sys.exit(main())
