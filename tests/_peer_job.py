"""A two-process job that shows how `train.launcher.peers.PeerWatch` is used (run by tests/test_lost_process.py).

    python tests/_peer_job.py PROCESS_ID PORT CHECKPOINT_DIR DIST_TIMEOUT STEPS [TAIL_SECONDS]

Each process has 2 CPU devices; every step sums an array sharded over all 4
devices (a gloo collective across the processes) and prints ``step N``. After
the last step a process waits TAIL_SECONDS (longer than the watch's grace, to
show that a peer that has finished is not taken for lost), then closes the watch.
"""

import os
import sys
import time
from pathlib import Path

_flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
os.environ["XLA_FLAGS"] = " ".join([*_flags, "--xla_force_host_platform_device_count=2"])  # the suite's others kept
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    process_id, port, checkpoint_dir, timeout, steps = sys.argv[1:6]
    tail = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0
    from train.launcher.distributed import DistributedConfig, initialize
    from train.launcher.peers import watch_peers

    config = DistributedConfig(f"127.0.0.1:{port}", 2, int(process_id), int(timeout))
    initialize(config)
    watch = watch_peers(config, checkpoint_dir)  # after initialize, before the first collective
    import jax
    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))
    x = jax.make_array_from_callback((4,), NamedSharding(mesh, P("data")), lambda index: np.ones((1,), np.float32))
    total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))
    for step in range(1, int(steps) + 1):
        assert float(total(x)) == 4.0
        print(f"step {step}", flush=True)
        time.sleep(0.2)
    time.sleep(tail)
    watch.close()  # this process ends on purpose: the others must not report it lost
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
