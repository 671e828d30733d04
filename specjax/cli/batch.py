"""`specjax batch INPUT OUTPUT [options]`: the command line of the batch job (`specjax.runners.batch.run_job`)."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from specjax.cli.common import add_config_flags, make_llm, shortcut_overrides
from specjax.config import load_run_config
from specjax.runners.batch_io import BatchError, check_paths  # no JAX: `specjax --help` stays fast


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`specjax batch INPUT OUTPUT [options]`: the config flags of `generate` plus the batch options."""
    p.add_argument("input", help="JSONL input: one {\"id\": ..., \"prompt\" or \"messages\": ..., "
                                 "\"sampling\": {...}} object per line")
    p.add_argument("output", help="JSONL output; results already there are skipped (resume)")
    add_config_flags(p)
    p.add_argument("-b", "--batch-size", dest="batch_size", type=int,
                   help="sequences decoded together (default 8, or the config's batch_size when --set)")
    p.add_argument("--chat", action="store_true", help="wrap plain-text prompts in the model's chat template")
    p.add_argument("--max-steps", dest="max_steps", type=int, default=32,
                   help="decode steps between host check-ins at most (default 32)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--num-processes", dest="num_processes", type=int, default=1,
                   help="processes sharing the job (jax.distributed); each writes OUTPUT.part-<id>, process 0 "
                        "merges them into OUTPUT (default 1)")
    p.add_argument("--process-id", dest="process_id", type=int, default=0, help="this process's id, 0..N-1")
    p.add_argument("--coordinator", help="HOST:PORT of process 0, the same on every process (several processes)")


def run(args) -> int:
    """Run `specjax batch`. Exit status 0 when every input line was served, 1 when bad lines were skipped,
    2 on errors that stop the job (before it starts, or a failed write), 130 on Ctrl-C, 143 when SIGTERM
    stopped it after the requests in flight (rerun the command to resume)."""

    try:
        check_paths(args.input, args.output)
        # A default batch size of 8 sits under the user's overrides, so `--set batch_size=N` still wins.
        overrides = ["batch_size=8"] + shortcut_overrides(args)
        if args.batch_size is not None:
            overrides.append(f"batch_size={args.batch_size}")
        cfg = load_run_config(args.config, overrides)
        nproc = getattr(args, "num_processes", 1)
        if nproc != 1 or getattr(args, "process_id", 0) != 0:
            from specjax.runners import distributed

            # Before the model loads: joining the distributed runtime must come before any other JAX call.
            distributed.initialize(args.coordinator, nproc, args.process_id)
        llm = make_llm(cfg)
        spec = cfg.speculative if cfg.speculative.enabled else None
        job = dict(sampling=cfg.sampling, speculative=spec, batch_size=cfg.batch_size, chat=args.chat,
                   max_steps=args.max_steps, progress=args.progress)
        if nproc != 1:
            summary, _ = distributed.run_shard(llm, args.input, args.output, process_id=args.process_id,
                                               num_processes=nproc, **job)
        else:
            from specjax.runners.batch import run_job

            summary = run_job(llm, args.input, args.output, **job)
    except BatchError as e:
        print(f"specjax: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"specjax batch: interrupted; finished results are in {args.output!r}, rerun the same command to "
              "resume", file=sys.stderr)
        # Every finished result is on disk (fsync per line). Leave without the interpreter's teardown, which
        # can crash while a device computation interrupted mid-flight is still being torn down.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    if summary.stopped:
        return 143  # 128 + SIGTERM: stopped early on purpose, resumable
    return 1 if summary.skipped_lines else 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m specjax.runners.batch INPUT OUTPUT ...` (the same as `specjax batch`)."""
    from specjax.cli.common import standalone

    return standalone("specjax batch", __doc__.split("\n")[0], add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
