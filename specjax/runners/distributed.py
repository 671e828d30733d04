"""A batch job over several processes joined by `jax.distributed` (several hosts, or several processes on one).

Each process serves its own share of the requests (the i-th valid request goes to process i mod N: data
parallelism across processes) on its own local devices, with its own local mesh if one is given (tensor
parallelism stays inside a host, where the links are fast), and writes its own output shard
`OUTPUT.part-<process_index>` with the crash-safe, resumable writer of `runners.batch`. Shapes (prompt and output
buckets, slot count) come from every valid request of the input, so a process compiles the programs a single
process would and its results are the ones a single process gives. When every process is done (a barrier over
the distributed runtime) process 0 merges the shards into OUTPUT, in input order, after checking that every
valid request is there exactly once.

Resuming: rerun the same command on every process. Each skips the ids already in its shard; a merge that had
already happened is redone (the shards are kept), giving the same file.

    initialize("localhost:8476", num_processes=2, process_id=0)   # before anything else touches JAX
    run_shard(llm, "in.jsonl", "out.jsonl")                        # this process's share, then the merge

On CPU the processes' collectives (the barrier) run over gloo (`jax_cpu_collectives_implementation`).
"""
from __future__ import annotations

import json
import os
import sys

from specjax.runners.batch_io import BatchError


SHUTDOWN_TIMEOUT_S = 7 * 24 * 3600  # how long a finished process waits at exit for the others
BARRIER_TIMEOUT_MS = 7 * 24 * 3600 * 1000  # how long a finished process waits at a barrier for the others


class DistributedError(BatchError):
    """A multi-process run that cannot start or finish (bad process ids, shards missing or inconsistent)."""


def check_processes(num_processes: int, process_id: int, coordinator: str | None = "") -> None:
    """Raise DistributedError unless the process layout is usable (coordinator None: not checked)."""
    if num_processes < 1:
        raise DistributedError(f"num_processes must be >= 1, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise DistributedError(f"process_id {process_id} is outside 0..{num_processes - 1}; give each of the "
                               f"{num_processes} processes its own id")
    if num_processes > 1 and coordinator is not None and not coordinator:
        raise DistributedError("several processes need --coordinator HOST:PORT (process 0's address, the same "
                               "for every process)")


def initialize(coordinator: str, num_processes: int, process_id: int, *, timeout_s: int = 300) -> None:
    """Join the distributed runtime (`jax.distributed.initialize`): call before any other JAX call. On CPU the
    collectives go over gloo. num_processes = 1 does nothing."""
    check_processes(num_processes, process_id, coordinator)
    if num_processes == 1:
        return
    import jax

    if os.environ.get("JAX_PLATFORMS", "cpu").split(",")[0] in ("", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Processes finish their shares at different times, and the runtime's shutdown waits for all of them: its
    # default limit (5 minutes) would abort the first one done on a long job.
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
                               initialization_timeout=timeout_s, shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)


def shard_path(output: str, process_id: int) -> str:
    """Where process `process_id` writes its results."""
    return f"{output}.part-{process_id}"


def run_shard(llm, input_path: str, output_path: str, *, process_id: int | None = None,
              num_processes: int | None = None, merge: bool = True, err=None, **job):
    """Serve this process's share of the job into its shard, wait for every process, and (process 0) merge.

    process_id / num_processes: default to the distributed runtime's (`jax.process_index()`, `process_count()`).
    job: run_job's keywords (sampling, speculative, batch_size, chat, max_steps, progress).
    Returns (this process's JobSummary, the merged record count on process 0, else None)."""
    import jax

    from specjax.runners.batch import run_job

    pid = jax.process_index() if process_id is None else process_id
    n = jax.process_count() if num_processes is None else num_processes
    check_processes(n, pid, None)
    err = err or sys.stderr
    summary = run_job(llm, input_path, shard_path(output_path, pid), err=err,
                      select=lambda i, _r: i % n == pid, **job)
    if n > 1:
        barrier("specjax_batch_shards_done")
    merged = None
    if merge and pid == 0:
        merged = merge_shards(input_path, output_path, n)
        print(f"specjax batch: merged {merged} results from {n} shards into {output_path}", file=err, flush=True)
    if n > 1:
        barrier("specjax_batch_merged")
    return summary, merged


def barrier(name: str) -> None:
    """Wait until every process reaches this point, however long the others take: the distributed runtime's own
    barrier. A device collective (multihost_utils.sync_global_devices) is not used: gloo gives up on a collective
    after a fixed time, long before the slowest process of a real job finishes its share."""
    from jax._src import distributed as runtime  # the coordination client: no public barrier API in jax 0.10

    client = runtime.global_state.client
    if client is None:
        raise DistributedError("barrier outside a distributed run: call distributed.initialize first")
    client.wait_at_barrier(name, BARRIER_TIMEOUT_MS)


def merge_shards(input_path: str, output_path: str, num_processes: int) -> int:
    """Merge OUTPUT.part-0 .. part-(N-1) into OUTPUT (written whole, then renamed into place), records in the
    input's order. Checks: every shard exists, no id twice, and every id of the shards is in the input. Returns
    the number of records. Ids that failed validation in the input are in no shard and not expected."""
    order = _input_ids(input_path)
    records: dict[str, bytes] = {}
    for pid in range(num_processes):
        path = shard_path(output_path, pid)
        if not os.path.exists(path):
            raise DistributedError(f"shard {path!r} is missing: rerun process {pid} of {num_processes}")
        with open(path, "rb") as f:
            data = f.read()
        for line in data.split(b"\n")[:-1]:
            key = json.dumps(json.loads(line)["id"])
            if key in records:
                raise DistributedError(f"id {key} is in two shards ({path!r} and an earlier one): the shards come "
                                       "from different jobs; remove them and rerun")
            if key not in order:
                raise DistributedError(f"id {key} in {path!r} is not in {input_path!r}: the shards belong to "
                                       "another input")
            records[key] = line
    tmp = output_path + ".merging"
    with open(tmp, "wb") as f:
        for key in sorted(records, key=order.__getitem__):
            f.write(records[key] + b"\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, output_path)
    return len(records)


def _input_ids(input_path: str) -> dict[str, int]:
    """{json id: position} of the input lines that parse and carry an id (invalid lines are in no shard)."""
    order: dict[str, int] = {}
    with open(input_path, "rb") as f:
        for n, raw in enumerate(f):
            try:
                obj = json.loads(raw)
            except ValueError:
                continue
            if isinstance(obj, dict) and "id" in obj:
                order.setdefault(json.dumps(obj["id"]), n)
    return order
