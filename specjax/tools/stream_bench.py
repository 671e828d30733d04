"""What streaming costs: tokens/s of a generation without streaming against the same generation streamed with a
callback, for several chunk sizes (loop steps between two looks at the output), per method.

    python -m specjax.tools.stream_bench [--model smollm2-135m] [--methods plain ngram eagle3] [--chunks 1 2 4 8]
                                          [--rounds 5] [--max-new-tokens 128] [--json out.json]

Every call generates the same tokens (greedy, end tokens ignored, the learned back-off state put back before each
call), so they differ only in how the host drives the loop. A round runs the non-streaming call first, then one
streamed call per chunk size (their order rotates from round to round), then the non-streaming call again; each
streamed call is compared with the mean of its round's two non-streaming calls, whose own ratio (last / first)
shows the noise. Printed per method and chunk: the median ratio over the rounds with its min and max, by wall
time and by the process's CPU time (steadier on a loaded machine, but blind to the device idling while the host
looks at a chunk), and the median tokens/s. Then the host's own cost per chunk boundary, measured directly with loop calls that run no
step (`boundary_cost`), and the streaming cost it predicts from the median step time: steadier than the paired
ratios when the machine is busy. Compilation and the back-off calibration happen in an untimed warm-up. A figure, not a test:
anything else running on the machine moves it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from specjax.api import LLM
from specjax.config import SamplingParams, load_run_config
from specjax.drafters.base import capabilities_of
from specjax.requests import num_stop, pad_prompts, sampling_arrays
from specjax.runners import speculative
from specjax.runners.base import TextStream, generate as run_variant
from specjax.runners.plain import PlainVariant

PROMPT = ("Repeat the following list exactly, then add one line saying how many items it has: apples, pears, "
          "plums, cherries, grapes, lemons, limes, oranges, peaches, apricots, figs, dates, melons, kiwis.")


def one_call(llm, ids, sp, spec, chunk: int | None) -> tuple[float, float, int, int, int]:
    """(wall seconds, CPU seconds of the process, new tokens, stream events, loop steps) of one generation; chunk
    None = not streamed. The CPU seconds count every thread (XLA's compute threads too): the work done, which another job
    on the machine slows down but does not add to, so it is the steadier figure on a loaded machine; the wall
    time also holds the device's idle time while the host looks at a chunk."""
    events = []
    stream = None if chunk is None else (lambda i, text: events.append(text))
    kw = {} if chunk is None else {"chunk": chunk}
    t, c = time.perf_counter(), time.process_time()
    if spec is None:
        outs = run_variant(llm, [ids], [ids], [sp], PlainVariant(llm, stream, **kw))
    else:
        outs = speculative.generate(llm, [ids], [ids], [sp], spec, stream=stream, **kw)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    m = outs[0].metrics
    steps = m.new_tokens - 1 if m.target_forwards is None else m.target_forwards - 1
    return wall, cpu, sum(len(o.token_ids) for o in outs), len(events), steps


def boundary_cost(llm, ids, sp, spec, calls: int = 50) -> tuple[float, float] | None:
    """(wall, CPU) seconds the host adds at each chunk boundary, measured directly: a loop call that runs no
    step (chunk 0: the copy of the output and the dispatch of the compiled loop, `runners.base.chunk_views`),
    the look at the output (`TextStream.push`) and the check whether a row still runs; the median over `calls`
    calls on a prefilled state (a median:
    on a busy machine a few calls are descheduled for far longer than the call itself). Streaming at chunk c
    then costs about this / (c x seconds per step). None for host-stepped drafters (their loop syncs every
    step)."""
    variant = PlainVariant(llm, chunk=0) if spec is None else speculative.variant_for(llm, spec, chunk=0)
    if capabilities_of(variant.drafter).host_side:
        return None
    b = variant.buckets(1, len(ids), sp.max_new_tokens, num_stop(llm.tokenizer, [sp]))
    tokens, lens, active = pad_prompts([ids], b.batch, b.prompt_len)
    sampling = sampling_arrays(llm.tokenizer, [sp], b.batch, b.num_stop)
    state = variant.prefill(b, tokens, lens, active, sampling)
    text = TextStream(llm.tokenizer, 1)
    chunks = variant.chunks(b, state, sampling, [ids])  # chunk 0: never finishes, one empty chunk per next()
    next(chunks)
    wall, cpu = [], []
    for _ in range(calls):
        t, c = time.perf_counter(), time.process_time()
        list(text.push(next(chunks)))
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return statistics.median(wall), statistics.median(cpu)


def measure(llm, ids, sp, spec, chunks: list[int], rounds: int, out=sys.stdout) -> dict:
    """Paired rounds for one method (see the module docstring). Returns {"tokens": n, "plain_tps": [...],
    "noise": [...], "cpu_noise": [...], chunk: {"ratio": [...], "cpu_ratio": [...], "tps": [...], "events": n}}:
    tps and ratio from wall time, cpu_* the same from the process's CPU time."""
    one_call(llm, ids, sp, spec, None)  # compiles, calibrates the back-off
    if spec is not None and spec.adaptive and not any(k[0] == spec for k in llm.runtime.break_even):
        print(f"  warning: the back-off was not calibrated (the generation ended within its first steps), so every "
              f"call calibrates again; raise --max-new-tokens", file=out)
    saved = speculative.learned_state(llm)
    tokens = None
    for c in chunks:  # warm: nothing may compile inside a timed call
        speculative.restore_learned(llm, saved)
        one_call(llm, ids, sp, spec, c)
    res = {"plain_tps": [], "noise": [], "cpu_noise": [], "step_s": [],
           **{c: {"ratio": [], "cpu_ratio": [], "tps": [], "events": 0} for c in chunks}}

    def timed(chunk):
        """(tokens per wall second, tokens per CPU second, events)."""
        nonlocal tokens
        speculative.restore_learned(llm, saved)
        wall, cpu, n, events, steps = one_call(llm, ids, sp, spec, chunk)
        if tokens is not None and n != tokens:
            raise RuntimeError(f"a call generated {n} tokens, another {tokens}: the runs are not comparable")
        tokens = n
        if chunk is None:
            res["step_s"].append(wall / max(steps, 1))
        return n / wall, n / cpu, events

    for r in range(rounds):
        order = chunks[r % len(chunks):] + chunks[:r % len(chunks)]
        first = timed(None)
        streamed = {c: timed(c) for c in order}
        last = timed(None)
        base, cpu_base = (first[0] + last[0]) / 2, (first[1] + last[1]) / 2
        res["plain_tps"] += [first[0], last[0]]
        res["noise"].append(last[0] / first[0])
        res["cpu_noise"].append(last[1] / first[1])
        for c, (tps, cpu_tps, events) in streamed.items():
            res[c]["ratio"].append(tps / base)
            res[c]["cpu_ratio"].append(cpu_tps / cpu_base)
            res[c]["tps"].append(tps)
            res[c]["events"] = events
        print(f"  round {r + 1}: not streamed {first[0]:.1f} / {last[0]:.1f} tok/s; "
              + ", ".join(f"chunk {c}: {streamed[c][0]:.1f}" for c in chunks), file=out, flush=True)
    res["tokens"] = tokens
    speculative.restore_learned(llm, saved)
    res["boundary_s"] = boundary_cost(llm, ids, sp, spec)
    return res


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def report(method: str, res: dict, chunks: list[int]) -> list[str]:
    """Lines for one method: the noise of the non-streaming pair, then per chunk the median ratio [min, max] of
    streamed to not streamed tokens/s, by wall time and by CPU time."""
    lines = [f"{method}: {res['tokens']} tokens per call; not streamed {statistics.median(res['plain_tps']):.1f} "
             f"tok/s (median); last/first non-streamed call of a round: wall {_spread(res['noise'])}, "
             f"CPU {_spread(res['cpu_noise'])}"]
    step = statistics.median(res["step_s"])
    if res.get("boundary_s") is not None:
        wall, cpu = res["boundary_s"]
        lines.append(f"  host cost per chunk boundary {wall * 1e3:.2f} ms ({cpu * 1e3:.2f} ms CPU), loop step "
                     f"{step * 1e3:.1f} ms (medians): predicted streaming cost "
                     + ", ".join(f"chunk {c}: {100 * wall / (c * step):.1f}%" for c in chunks))
    for c in chunks:
        lines.append(f"  chunk {c:>2}: streamed/not wall {_spread(res[c]['ratio'])}, CPU {_spread(res[c]['cpu_ratio'])}"
                     f"; {statistics.median(res[c]['tps']):.1f} tok/s, {res[c]['events']} events")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specjax.tools.stream_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model spec (default: the packaged default, SmolLM2-135M)")
    ap.add_argument("--methods", nargs="+", default=["plain", "ngram", "eagle3"],
                    help="'plain' or packaged method configs (methods/<name>)")
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8], help="loop steps per streamed chunk")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=128)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--json", help="write every measurement here")
    args = ap.parse_args(argv)
    llm = LLM() if args.model is None else LLM(args.model)
    ids = llm.encode_prompt(args.prompt, True)
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True, temperature=0.0, seed=0)
    results, lines = {}, []
    for method in args.methods:
        spec = None if method == "plain" else load_run_config(f"methods/{method}").speculative
        print(f"{method}:", flush=True)
        results[method] = measure(llm, ids, sp, spec, args.chunks, args.rounds)
        lines += report(method, results[method], args.chunks)
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({m: {str(k): v for k, v in r.items()} for m, r in results.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
