"""Verify-attention kernels on a real NVIDIA GPU: correctness on the Triton compiler, and speed against the roofline.

    python benchmarks/kernels_gpu.py --out $OUT/kernels_gpu.json        # on a GPU machine, ~8 min budget
    JAX_PLATFORMS=cpu python benchmarks/kernels_gpu.py --smoke --out /tmp/kg_smoke.json   # logic check on CPU

What it measures, in this order (the JSON is written even when a section fails or the time budget runs out):
  1. device, jax version, host, date;
  2. copy bandwidth: a donated (in-place) jitted elementwise pass over a large float32 buffer, bytes read + written
     over the best of several reps (the STREAM 'copy' convention) -- the memory roofline for the rows below;
  3. correctness of `tree_attention_triton` (interpret=False) and of `tree_attention_lse_merge(prefix_impl=
     "pallas_triton")` against `tree_attention_reference` in float32 and bfloat16, on random trees with per-sequence
     prefix lengths (not multiples of the block) and NaN-poisoned cache slots past each sequence's tree;
     rel. error = max|out - ref| / max|ref|, ref in float32 from the same dtype-rounded inputs, NaN = FAIL;
  4. median time of the Triton kernel, the jitted XLA reference and the model's default attention
     (`specjax.kernels.xla.prefix_tree_attention`) for SmolLM2-like and Llama-8B-like heads, with the bandwidth
     each achieves on the bytes it must read (K/V of prefix + tree, q, out) and its ratio to the copy bandwidth.
Rows are skipped (and listed) once --budget-s is spent. --smoke uses tiny sizes and the Pallas interpreter.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels.lse_merge import tree_attention_lse_merge
from specjax.kernels.pallas.tree_attention_gpu import tree_attention_triton
from specjax.kernels.reference import tree_attention_reference
from specjax.kernels.xla import prefix_tree_attention
from specjax.tree import TreeSpec

HEADS = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}  # name -> (Hq, Hkv, D)
BOUNDS = {"float32": 1e-5, "bfloat16": 1e-2}  # the acceptance bounds on the relative error
GPU_F32_BOUND = 1e-4  # f32 on GPU: Triton's and XLA's f32 dots may round differently (TF32 vs IEEE paths)

# Correctness cases: (batch, Hkv, group = Hq / Hkv, D, tree nodes T, per-sequence prefix lengths).
GPU_CASES = (
    (1, 4, 1, 64, 1, (0,)),
    (1, 3, 3, 64, 16, (2047,)),
    (2, 3, 3, 64, 9, (200, 77)),
    (3, 4, 1, 128, 33, (130, 1, 700)),
    (4, 2, 8, 128, 64, (1000, 513, 0, 257)),
    (2, 8, 4, 128, 64, (4099, 3001)),
)
SMOKE_CASES = ((1, 3, 3, 64, 4, (64,)), (2, 2, 8, 16, 9, (200, 37)))
SPARE_SLOTS = 5  # cache slots after the longest sequence's tree, poisoned with NaN like every unused slot

# Timing grid: config x batch x prefix x tree nodes, for each dtype (bfloat16 first: the production dtype).
GPU_GRID = [(c, b, p, t) for c in HEADS for b in (1, 8) for p in (512, 2048, 8192) for t in (16, 64)]
SMOKE_GRID = [("smollm2", 1, 64, 4), ("llama8b", 2, 200, 9)]
DTYPES = ("bfloat16", "float32")


def copy_bandwidth(nbytes: int, reps: int) -> float:
    """Bytes/s (read + written) of a donated elementwise pass over a float32 buffer of `nbytes`: donation makes it
    in place, so no fresh output allocation is timed."""
    step = jax.jit(lambda a: a * 1.0000001, donate_argnums=0)
    y = step(jnp.ones((nbytes // 4,), jnp.float32))  # also compiles
    y.block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        y = step(y)
        y.block_until_ready()
        best = min(best, time.perf_counter() - t)
    del y
    return 2 * nbytes / best


def random_tree_mask(rng: np.random.Generator, nodes: int) -> np.ndarray:
    """[T, T] bool ancestor-or-self mask of a random tree (parent[i] < i; half the nodes extend the previous one,
    so deep chains occur as well as bushy levels)."""
    parents = [-1] + [i - 1 if rng.random() < 0.5 else int(rng.integers(0, i)) for i in range(1, nodes)]
    return TreeSpec(tuple(parents)).ancestor_mask


def correctness_inputs(rng, batch, kv_heads, group, head_dim, nodes, lengths, dtype):
    """Random q [B, T, Hq, D], k/v [B, Hkv, S, D] in `dtype` (slots >= lengths[b] + T hold NaN), lengths [B] int32,
    tree_mask [B, T, T]."""
    seq_len = max(lengths) + nodes + SPARE_SLOTS
    q = rng.standard_normal((batch, nodes, kv_heads * group, head_dim), np.float32)
    k = rng.standard_normal((batch, kv_heads, seq_len, head_dim), np.float32)
    v = rng.standard_normal((batch, kv_heads, seq_len, head_dim), np.float32)
    for b, length in enumerate(lengths):
        k[b, :, length + nodes:] = np.nan  # a kernel that reads past the tree turns the output into NaN
        v[b, :, length + nodes:] = np.nan
    mask = np.stack([random_tree_mask(rng, nodes) for _ in range(batch)])
    cast = functools.partial(jnp.asarray, dtype=dtype)
    return cast(q), cast(k), cast(v), jnp.asarray(lengths, jnp.int32), jnp.asarray(mask)


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """max|out - ref| / max|ref|; NaN when either holds a NaN or inf."""
    if not (np.isfinite(out).all() and np.isfinite(ref).all()):
        return float("nan")
    return float(np.max(np.abs(out - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


def as_f32(x):
    return x.astype(jnp.float32)


def describe(exc: Exception) -> str:
    """One line for the JSON: the exception type and the first line of its message."""
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


def verdict(err: float | None, dtype: str, on_gpu: bool) -> str:
    if err is None or not math.isfinite(err):
        return "FAIL"
    if err < BOUNDS[dtype]:
        return "PASS"
    if dtype == "float32" and on_gpu and err < GPU_F32_BOUND:
        return "PASS(1e-4 only)"
    return "FAIL"


def run_correctness(cases, interpret: bool, on_gpu: bool, rng) -> list[dict]:
    impls = {
        "triton": functools.partial(tree_attention_triton, interpret=interpret),
        "lse_merge_triton": functools.partial(
            tree_attention_lse_merge, prefix_impl="pallas_triton", interpret=interpret
        ),
    }
    rows = []
    for batch, kv_heads, group, head_dim, nodes, lengths in cases:
        for dtype in DTYPES:
            q, k, v, lens, mask = correctness_inputs(rng, batch, kv_heads, group, head_dim, nodes, lengths, dtype)
            # The reference sees the same dtype-rounded values, in float32.
            ref = np.asarray(tree_attention_reference(as_f32(q), as_f32(k), as_f32(v), lens, mask))
            for name, fn in impls.items():
                row = dict(impl=name, dtype=dtype, batch=batch, kv_heads=kv_heads, group=group, head_dim=head_dim,
                           nodes=nodes, lengths=list(lengths), error=None, rel_err=None)
                try:
                    err = relative_error(np.asarray(as_f32(fn(q, k, v, lens, mask))), ref)
                    if math.isfinite(err):
                        row["rel_err"] = err
                    else:  # kept out of the JSON as NaN (not standard JSON); status becomes FAIL
                        row["error"] = "NaN or inf in the output or the reference"
                except Exception as exc:  # a compiler rejection is a finding to record, not a reason to stop
                    row["error"] = describe(exc)
                row["status"] = verdict(row["rel_err"], dtype, on_gpu)
                rows.append(row)
                print(f"  {name:17s} {dtype:8s} B={batch} Hkv={kv_heads} G={group} D={head_dim} T={nodes:2d} "
                      f"lengths={list(lengths)}: rel_err={row['rel_err']} {row['status']}"
                      + (f" ({row['error']})" if row["error"] else ""), flush=True)
    return rows


def median_time(fn, args, warmup: int, reps: int) -> tuple[float, float]:
    """(seconds of the first call, compile included; median seconds of `reps` calls after `warmup` calls)."""
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return first, statistics.median(times)


def time_row(config, batch, prefix, nodes, dtype, *, interpret, warmup, reps, copy_bw, key, rng) -> dict:
    q_heads, kv_heads, head_dim = HEADS[config]
    seq_len = prefix + nodes  # the tree's K/V sit at slots [prefix, prefix + T)
    keys = jax.random.split(key, 5)
    dt = jnp.dtype(dtype)
    q = jax.random.normal(keys[0], (batch, nodes, q_heads, head_dim), dt)  # [B, T, Hq, D]
    k = jax.random.normal(keys[1], (batch, kv_heads, seq_len, head_dim), dt)  # [B, Hkv, S, D]
    v = jax.random.normal(keys[2], (batch, kv_heads, seq_len, head_dim), dt)
    k_new = jax.random.normal(keys[3], (batch, nodes, kv_heads, head_dim), dt)  # [B, T, Hkv, D], not yet written
    v_new = jax.random.normal(keys[4], (batch, nodes, kv_heads, head_dim), dt)
    lengths = jnp.full((batch,), prefix, jnp.int32)
    mask = jnp.asarray(np.stack([random_tree_mask(rng, nodes) for _ in range(batch)]))  # [B, T, T]
    scale = 1.0 / math.sqrt(head_dim)
    impls = {
        "triton": (jax.jit(functools.partial(tree_attention_triton, interpret=interpret)), (q, k, v, lengths, mask)),
        "xla_reference": (jax.jit(tree_attention_reference), (q, k, v, lengths, mask)),
        "model_default": (jax.jit(functools.partial(prefix_tree_attention, scale=scale)),
                          (q, k, v, k_new, v_new, lengths, mask)),
    }
    itemsize = dt.itemsize
    needed = 2 * batch * kv_heads * seq_len * head_dim * itemsize + 2 * batch * nodes * q_heads * head_dim * itemsize
    row = dict(config=config, dtype=dtype, batch=batch, prefix=prefix, nodes=nodes, q_heads=q_heads,
               kv_heads=kv_heads, head_dim=head_dim, bytes_needed=needed)
    for name, (fn, args) in impls.items():
        try:
            first, med = median_time(fn, args, warmup, reps)
            gbps = needed / med / 1e9
            row[name] = dict(ms=med * 1e3, first_call_s=first, GBps=gbps, frac_copy=gbps * 1e9 / copy_bw)
        except Exception as exc:
            row[name] = dict(error=describe(exc))
    return row


def cell(entry: dict) -> str:
    if "error" in entry:
        return "error"
    return f"{entry['ms']:.3f} ms, {entry['GBps']:.0f} GB/s ({100 * entry['frac_copy']:.0f}%)"


def markdown(result: dict) -> str:
    lines = [f"copy bandwidth: {result.get('copy_GBps', float('nan')):.1f} GB/s", "",
             "| impl | dtype | B | Hkv | G | D | T | lengths | rel. error | status |", "|" + "---|" * 10]
    for r in result["correctness"]:
        err = "n/a" if r["rel_err"] is None else f"{r['rel_err']:.2e}"
        lines.append(f"| {r['impl']} | {r['dtype']} | {r['batch']} | {r['kv_heads']} | {r['group']} | {r['head_dim']} "
                     f"| {r['nodes']} | {r['lengths']} | {err} | {r['status']} |")
    lines += ["", "| config | dtype | B | prefix | T | triton | xla reference | model default |", "|" + "---|" * 8]
    for r in result["timing"]:
        lines.append(f"| {r['config']} | {r['dtype']} | {r['batch']} | {r['prefix']} | {r['nodes']} | "
                     f"{cell(r['triton'])} | {cell(r['xla_reference'])} | {cell(r['model_default'])} |")
    if result["skipped"]:
        lines += ["", f"skipped (budget): {len(result['skipped'])} timing rows"]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    out_dir = os.environ.get("OUT")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(out_dir, "kernels_gpu.json") if out_dir else "kernels_gpu.json")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, Pallas interpreter: runs on a CPU")
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip remaining timing rows after this")
    parser.add_argument("--reps", type=int, default=None, help="timed reps per row (default 20, smoke 2)")
    parser.add_argument("--copy-mib", type=int, default=None, help="copy-bandwidth buffer (default 1024, smoke 16)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    on_gpu = jax.default_backend() == "gpu"
    if not args.smoke and not on_gpu:
        print(f"kernels_gpu.py needs a GPU (jax backend is {jax.default_backend()!r}); use --smoke to check it on CPU.")
        return 2
    reps = args.reps or (2 if args.smoke else 20)
    warmup = 1 if args.smoke else 3
    interpret = args.smoke  # the real Triton compiler only on a GPU run
    rng = np.random.default_rng(0)
    result = dict(
        meta=dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), host=platform.node(),
                  python=platform.python_version(), jax=jax.__version__, backend=jax.default_backend(),
                  devices=[str(d) for d in jax.devices()], device_kind=jax.devices()[0].device_kind,
                  smoke=args.smoke, interpret=interpret, reps=reps, warmup=warmup, budget_s=args.budget_s,
                  bounds=BOUNDS, gpu_f32_bound=GPU_F32_BOUND),
        correctness=[], timing=[], skipped=[], errors=[],
    )
    print(f"jax {jax.__version__}, devices {jax.devices()}", flush=True)
    try:
        copy_mib = args.copy_mib or (16 if args.smoke else 1024)
        result["copy_GBps"] = copy_bandwidth(copy_mib << 20, reps=10 if not args.smoke else 3) / 1e9
        print(f"copy bandwidth ({copy_mib} MiB f32, donated): {result['copy_GBps']:.1f} GB/s", flush=True)

        print("correctness (vs tree_attention_reference, f32 ref from the same rounded inputs):", flush=True)
        result["correctness"] = run_correctness(SMOKE_CASES if args.smoke else GPU_CASES, interpret, on_gpu, rng)
        has_mosaic = importlib.util.find_spec("jax.experimental.pallas.mosaic_gpu") is not None
        result["mosaic_gpu"] = dict(jax_has_lowering=has_mosaic, run=False,
                                    note="not implemented by specjax: its GPU kernel targets the Triton lowering only")
        print(f"Mosaic GPU lowering in this jax: {has_mosaic}; {result['mosaic_gpu']['note']}", flush=True)

        print("timing (median of reps; GB/s on the K/V/q/out bytes needed; % of copy bandwidth):", flush=True)
        copy_bw = result["copy_GBps"] * 1e9
        key = jax.random.PRNGKey(0)
        for dtype in DTYPES:
            for config, batch, prefix, nodes in SMOKE_GRID if args.smoke else GPU_GRID:
                spec = dict(config=config, dtype=dtype, batch=batch, prefix=prefix, nodes=nodes)
                if time.perf_counter() - start > args.budget_s:
                    result["skipped"].append(spec)
                    continue
                key, sub = jax.random.split(key)
                row = time_row(config, batch, prefix, nodes, dtype, interpret=interpret, warmup=warmup, reps=reps,
                               copy_bw=copy_bw, key=sub, rng=rng)
                result["timing"].append(row)
                print(f"  {config} {dtype} B={batch} prefix={prefix} T={nodes}: triton {cell(row['triton'])} | "
                      f"xla {cell(row['xla_reference'])} | model {cell(row['model_default'])}", flush=True)
        if result["skipped"]:
            print(f"budget of {args.budget_s:.0f} s spent: skipped {len(result['skipped'])} timing rows", flush=True)
    except Exception as exc:  # keep what was measured: the JSON is written below whatever happened
        result["errors"].append(describe(exc))
        print(f"aborted: {type(exc).__name__}: {exc}", flush=True)
    finally:
        result["elapsed_s"] = time.perf_counter() - start
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    print(markdown(result))
    failed = sum(r["status"] == "FAIL" for r in result["correctness"])
    print(f"wrote {args.out} in {result['elapsed_s']:.0f} s; correctness FAIL rows: {failed}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
