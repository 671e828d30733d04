"""What every `specjax` subcommand shares: the config flags, their translation into config overrides, building the
LLM from a resolved config, and the error types whose message is meant for the user."""
from __future__ import annotations

import argparse

from specjax.config import RunConfig
from specjax.errors import SpecjaxError


def shortcut_overrides(args) -> list[str]:
    out = list(args.set or [])
    for flag, key in (("model", "model.model"), ("dtype", "model.dtype"), ("max_new_tokens", "sampling.max_new_tokens"),
                      ("temperature", "sampling.temperature"), ("top_p", "sampling.top_p"), ("top_k", "sampling.top_k"),
                      ("seed", "sampling.seed"), ("method", "speculative.method"),
                      ("num_speculative_tokens", "speculative.num_speculative_tokens"),
                      ("draft", "speculative.model"), ("backend", "backend.backend"),
                      ("attention_impl", "backend.attention_impl"), ("mesh", "backend.mesh")):
        value = getattr(args, flag, None)
        if value is not None:
            out.append(f"{key}={value}")
    return out


def add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="packaged config name (see `specjax configs`) or a YAML file")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override any config key, e.g. sampling.top_p=0.9")
    p.add_argument("--model", help="model spec: 'smollm2-135m', an HF directory or a .gguf file")
    p.add_argument("--dtype", choices=["float32", "bfloat16"])
    p.add_argument("-n", "--max-new-tokens", dest="max_new_tokens", type=int)
    p.add_argument("-t", "--temperature", type=float)
    p.add_argument("--top-p", dest="top_p", type=float)
    p.add_argument("--top-k", dest="top_k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--method", help="speculative method: ngram, draft_model, suffix, medusa, eagle, eagle3 (or 'null' for plain)")
    p.add_argument("-k", "--num-speculative-tokens", dest="num_speculative_tokens", type=int)
    p.add_argument("--draft", help="draft model / head path for the speculative method")
    p.add_argument("--backend", choices=["auto", "cpu", "gpu", "tpu", "neuron"])
    p.add_argument("--attention-impl", dest="attention_impl")
    p.add_argument("--mesh", help="run over a device mesh, e.g. data=2,model=4 (tensor parallel over model, the batch "
                                  "over data); default: one device")


def make_llm(cfg: RunConfig):
    from specjax.api import LLM

    return LLM(cfg.model.model, cfg.model.dtype, backend=cfg.backend.backend,
               attention_impl=cfg.backend.attention_impl, max_context=cfg.model.max_context, mesh=cfg.backend.mesh,
               quantization=cfg.model.quantization, quantization_group_size=cfg.model.quantization_group_size,
               quantize_lm_head=cfg.model.quantize_lm_head,
               kv_cache_dtype=cfg.model.kv_cache_dtype)


def user_errors() -> tuple[type[Exception], ...]:
    """specjax's own error types: each carries a one-line message meant for the user (no traceback)."""
    return (SpecjaxError,)


def standalone(prog: str, description: str, add_arguments, run, argv=None) -> int:
    """The `python -m specjax.cli.<command>` entry of a subcommand (the same as `specjax <command>`): parse with
    the command's own arguments, run, and print a specjax error as one line (exit status 2)."""
    import sys

    p = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except user_errors() as e:
        print(f"specjax: error: {e}", file=sys.stderr)
        return 2
