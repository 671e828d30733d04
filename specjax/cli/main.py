"""The `specjax` command line. Every subcommand reads the one config system: the packaged default.yaml, then
`--config` (a packaged name such as `methods/ngram` or a YAML path), then `--set key=value` overrides, then the
shortcut flags (which are overrides too).

    specjax generate --config methods/draft_model --compare "Explain speculative decoding."
    specjax chat --config methods/ngram
    specjax configs
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from specjax.cli.common import add_config_flags, make_llm, shortcut_overrides, user_errors
from specjax.config import ConfigError, RunConfig, available_configs, load_run_config, to_yaml

DEMO_PROMPT = ("Summarize the following text in two sentences: Speculative decoding speeds up language models. "
               "A small draft model proposes several tokens, and the large target model checks all of them in one "
               "forward pass. Tokens that the target agrees with are kept, so the output is exactly what the target "
               "would have produced alone, but fewer slow target passes are needed.")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specjax", description="Lossless speculative decoding in JAX.")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for prompts (speculative if a method is configured)")
    add_config_flags(g)
    g.add_argument("prompts", nargs="*", help="prompts (default: the config's prompts, else a demo prompt)")
    g.add_argument("--raw", action="store_true", help="do not wrap prompts in the model's chat template")
    g.add_argument("--compare", action="store_true",
                   help="also run plain decoding on the same prompts, before and after the method, and print "
                        "the measured speedup with the spread of the two plain runs")
    g.add_argument("--json", action="store_true", help="print results as JSON lines")
    c = sub.add_parser("chat", help="interactive chat, streaming tokens")
    add_config_flags(c)
    b = sub.add_parser("bench", help="benchmark methods against plain decoding on a prompt file (e.g. Spec-Bench)")
    from specjax.cli.bench import add_arguments

    add_arguments(b)
    bt = sub.add_parser("batch", help="offline generation over a JSONL file (continuous batching, resumable)")
    from specjax.cli.batch import add_arguments as batch_arguments

    batch_arguments(bt)
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching, speculative decoding)")
    from specjax.cli.serve import add_arguments as serve_arguments

    serve_arguments(sv)
    cp = sub.add_parser("compare", help="one config on several backends/devices or methods, greedy outputs cross-checked")
    from specjax.cli.compare import add_arguments as compare_arguments

    compare_arguments(cp)
    tn = sub.add_parser("tune", help="measure costs and acceptance, pick gamma (chain methods) or the draft tree size "
                                     "(medusa, eagle, eagle3), or plain decoding where none pays; compare "
                                     "predicted and measured speedup")
    add_config_flags(tn)
    tn.add_argument("--dataset", required=True, help="prompt file (Spec-Bench format, JSONL or text)")
    tn.add_argument("--per-category", type=int, default=1)
    tn.add_argument("--limit", type=int, default=8)
    tn.add_argument("--gammas", type=int, nargs="+", default=[1, 2, 4, 6, 8],
                    help="candidate gammas (ngram, draft_model, suffix)")
    tn.add_argument("--tree-sizes", dest="tree_sizes", type=int, nargs="+", default=[4, 8, 12, 20, 32],
                    help="candidate draft tree sizes, root excluded (medusa: the first N paths of the heads' default "
                         "tree; eagle/eagle3: total_tokens N at depth min(depth, N)); sizes the method cannot "
                         "build are skipped with a message")
    tn.add_argument("--p-mins", dest="p_mins", type=float, nargs="*", default=[0.0, 0.3, 0.5, 0.7, 0.9],
                    help="candidate p_min at the chosen gamma (draft_model; none: not tuned)")
    tn.add_argument("--reps", type=int, default=2, help="timed generations per prompt and setting; each prompt keeps "
                                                        "its fastest (the least disturbed by anything else running)")
    tn.add_argument("--cost-prompts", dest="cost_prompts", type=int, default=3,
                    help="prompts on which plain and speculative steps are timed in the generation loop")
    tn.add_argument("--no-validate", action="store_true", help="skip measuring every candidate end to end")
    tn.add_argument("--json", help="write the full result here")
    th = sub.add_parser("train-head", help="train a draft model, Medusa heads or an EAGLE/EAGLE-3 head from a YAML "
                                           "config (e.g. train/eagle3); rerun to resume")
    th.add_argument("--config", required=True, help="packaged training config (train/draft, train/medusa, train/eagle, "
                                                    "train/eagle3) or a YAML file")
    th.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a training option, e.g. steps=10")
    th.add_argument("--dry-run", action="store_true", help="print the trainer command and stop")
    s = sub.add_parser("configs", help="list the packaged configs, or print one resolved config")
    s.add_argument("name", nargs="?")
    s.add_argument("--set", action="append", metavar="KEY=VALUE")
    return ap


def _spec(cfg: RunConfig):
    return cfg.speculative if cfg.speculative.enabled else None


def _timed(llm, prompts, cfg, spec, chat, warm_up: bool = True):
    """One measured call, after an untimed one that compiles (`warm_up`). Returns (outputs, seconds)."""
    if warm_up:
        llm.generate(prompts, cfg.sampling, spec, chat=chat)
    t = time.perf_counter()
    outs = llm.generate(prompts, cfg.sampling, spec, chat=chat)
    return outs, time.perf_counter() - t


def compare_lines(spec_tps: float, plain_before_tps: float, plain_after_tps: float, drafted: int, accepted: int,
                  verify_steps: int) -> list[str]:
    """The `generate --compare` verdict: the speedup over the mean of the plain runs timed before and after the
    method, with the speedup against each (their spread is the noise of the measurement), and, where the method
    accepted nothing, a warning instead of a speedup: a ratio without speculation is noise or overhead."""
    plain = (plain_before_tps + plain_after_tps) / 2
    ratio = lambda p: spec_tps / p if p > 0 else float("nan")
    spread = (f"{ratio(plain):.2f}x ({spec_tps:.1f} tok/s against plain {plain:.1f} tok/s, the mean of "
              f"{plain_before_tps:.1f} before and {plain_after_tps:.1f} after: {ratio(plain_before_tps):.2f}x and "
              f"{ratio(plain_after_tps):.2f}x; compile excluded)")
    if verify_steps == 0 or accepted == 0:
        why = ("no verify step ran: every step backed off to plain decoding" if verify_steps == 0 else
               f"no token drafted in {verify_steps} verify steps" if drafted == 0 else
               f"0 of {drafted} drafted tokens accepted in {verify_steps} verify steps")
        return [f"WARNING: the method accepted nothing ({why}); the figure below is not a speedup from speculation",
                f"tok/s ratio to plain decoding (noise or overhead): {spread}"]
    return [f"speedup over plain decoding: {spread}"]


def cmd_generate(args) -> int:
    cfg = load_run_config(args.config, shortcut_overrides(args))
    prompts = list(args.prompts) or list(cfg.prompts) or [DEMO_PROMPT]
    chat = not args.raw
    llm = make_llm(cfg)
    spec = _spec(cfg)
    print(f"model {cfg.model.model} ({llm.source.kind}: {llm.source.path}), dtype {llm.dtype}, "
          f"method {cfg.speculative.method or 'plain'}"
          + (f", gamma {cfg.speculative.num_speculative_tokens}" if spec else ""), file=sys.stderr)
    if args.compare and spec is not None:  # plain before and after the method: their spread shows the noise
        plain, t_before = _timed(llm, prompts, cfg, None, chat)
        outs, t_spec = _timed(llm, prompts, cfg, spec, chat)
        plain_after, t_after = _timed(llm, prompts, cfg, None, chat, warm_up=False)
    elif args.compare:
        outs, t_spec = _timed(llm, prompts, cfg, spec, chat)
    else:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, cfg.sampling, spec, chat=chat)
        t_spec = time.perf_counter() - t0
    for i, o in enumerate(outs):
        m = o.metrics
        if args.json:
            print(json.dumps({"prompt": prompts[i], "text": o.text, "token_ids": o.token_ids,
                              "finish_reason": o.finish_reason, "metrics": vars(m)}))
            continue
        print(f"\n=== prompt {i}: {prompts[i][:80]!r}")
        print(o.text)
        line = (f"--- {m.new_tokens} tokens, {m.tokens_per_s:.1f} tok/s, TTFT {m.time_to_first_token * 1000:.0f} ms, "
                f"finish {o.finish_reason}")
        if m.acceptance_rate is not None:
            pos = ", ".join(f"{a:.2f}" for a in m.per_position_acceptance)
            line += (f"\n--- acceptance rate {m.acceptance_rate:.3f}, mean accepted length tau "
                     f"{m.mean_accepted_length:.2f} over {m.verify_steps} verify steps, {m.tokens_per_forward:.2f} "
                     f"tokens per target forward, per position [{pos}], {m.target_forwards} target forwards"
                     + (" (LOSSY acceptance)" if m.lossy else ""))
        print(line)
    if args.compare and spec is not None:
        same = all(a.token_ids == b.token_ids for a, b in zip(outs, plain))
        tps = lambda o, t: sum(x.metrics.new_tokens for x in o) / t
        lines = compare_lines(tps(outs, t_spec), tps(plain, t_before), tps(plain_after, t_after),
                              sum(o.metrics.drafted for o in outs), sum(o.metrics.accepted for o in outs),
                              sum(o.metrics.verify_steps for o in outs))
        print("\n" + "\n".join(lines))
        print(f"output identical to plain: {same}"
              + ("" if cfg.sampling.temperature == 0 else " (sampling: equal only in distribution)"))
    return 0


def cmd_chat(args) -> int:
    cfg = load_run_config(args.config, shortcut_overrides(args))
    llm = make_llm(cfg)
    messages: list[dict] = []
    print("specjax chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        # Every method streams: a speculative loop hands its tokens over every few steps, like plain decoding.
        outs = llm.generate([messages], cfg.sampling, _spec(cfg),
                            stream=lambda i, text: print(text, end="", flush=True))
        print()
        m = outs[0].metrics
        if m.acceptance_rate is not None:
            print(f"[acceptance {m.acceptance_rate:.2f}, tau {m.mean_accepted_length:.2f}, "
                  f"{m.tokens_per_forward:.2f} tokens per target forward, {m.tokens_per_s:.1f} tok/s]", file=sys.stderr)
        messages.append({"role": "assistant", "content": outs[0].text})
    return 0


def cmd_bench(args) -> int:
    from specjax.cli.bench import run

    return run(args)


def cmd_batch(args) -> int:
    from specjax.cli.batch import run

    return run(args)


def cmd_serve(args) -> int:
    from specjax.cli.serve import run

    return run(args)


def cmd_compare(args) -> int:
    from specjax.cli.compare import run

    return run(args)


def cmd_tune(args) -> int:
    from specjax.tools import bench
    from specjax.tools import tune

    cfg = load_run_config(args.config, shortcut_overrides(args))
    if not cfg.speculative.enabled:
        raise ConfigError("tune needs a speculative method: pass --config methods/<name> or --method")
    prompts = [p.turns[0] for p in bench.load_prompts(args.dataset, per_category=args.per_category, limit=args.limit)]
    llm = make_llm(cfg)
    try:
        result = tune.tune(llm, cfg.speculative, prompts, args.gammas, cfg.sampling.max_new_tokens,
                           validate=not args.no_validate, tree_sizes=args.tree_sizes, reps=args.reps,
                           num_cost_prompts=args.cost_prompts, p_mins=args.p_mins)
    except tune.TuneError as e:
        print(f"specjax: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def cmd_configs(args) -> int:
    if args.name is None:
        print("\n".join(available_configs()))
        return 0
    print(to_yaml(load_run_config(args.name, args.set or [])), end="")
    return 0


def cmd_train_head(args) -> int:
    from specjax.train.launch import main as launch

    launch(args.config, args.set or (), dry_run=args.dry_run)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"generate": cmd_generate, "chat": cmd_chat, "bench": cmd_bench, "tune": cmd_tune, "compare": cmd_compare,
                "batch": cmd_batch, "serve": cmd_serve, "train-head": cmd_train_head,
                "configs": cmd_configs}[args.command](args)
    except user_errors() as e:
        print(f"specjax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
