"""One process of a two-process batch job joined by jax.distributed (tests/test_mesh.py starts two of these):

    python tests/mesh_dist_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID INPUT OUTPUT [PACE_S]

The tiny byte-level model of tests/runners/test_batch.py (same seed in every process), plain greedy decoding,
3 slots. PACE_S > 0 sleeps after every written result, so a test can kill the process mid-job.
"""
from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    coordinator, n, pid, inp, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    pace = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from specjax.runners import distributed

    distributed.initialize(coordinator, n, pid, timeout_s=120)
    sys.path[:0] = [os.path.join(HERE, "runners"), HERE]
    import test_batch
    from specjax.runners import batch

    if pace > 0:
        write = batch.ResultFile.write

        def paced(self, record):
            write(self, record)
            time.sleep(pace)

        batch.ResultFile.write = paced
    distributed.run_shard(test_batch.tiny_llm(), inp, out, batch_size=test_batch.SLOTS, progress=False)


if __name__ == "__main__":
    main()
