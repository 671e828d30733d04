"""What every `specjax` subcommand shares: the config flags, their translation into config overrides, building the
LLM from a resolved config, and the error types whose message is meant for the user."""
from __future__ import annotations

import argparse
import typing

from specjax.config import BackendConfig, ModelConfig, RunConfig, load_run_config
from specjax.errors import SpecjaxError

MODEL_HELP = ("the model: an alias (smollm2-135m, qwen2.5-coder-1.5b, qwen2.5-coder-0.5b), a local Hugging Face "
              "directory or .gguf file, or a Hugging Face Hub id ORG/NAME[@REVISION][:FILE.gguf]")


def _choices(cls: type, name: str) -> list[str]:
    """The values a Literal-typed config field takes (None left out): the schema is the one list of them."""
    out: list[str] = []

    def walk(tp) -> None:
        if typing.get_origin(tp) is typing.Literal:
            out.extend(typing.get_args(tp))
        else:
            for arg in typing.get_args(tp):
                walk(arg)

    walk(typing.get_type_hints(cls)[name])
    return out


# The model options, one definition for every command that loads a model (generate, chat, bench, batch, serve,
# tune, compare): (flag, argparse dest, config key, argparse options). Each becomes a config override, so the
# flag, `--set KEY=VALUE` and a YAML file all say the same thing the same way.
MODEL_FLAGS = (
    ("--model", "model", "model.model", dict(help=MODEL_HELP)),
    ("--dtype", "dtype", "model.dtype",
     dict(choices=_choices(ModelConfig, "dtype"), help="weights dtype; auto: the checkpoint's own (GGUF: float32)")),
    ("--quantization", "quantization", "model.quantization",
     dict(choices=_choices(ModelConfig, "quantization"),
          help="quantized target weights (specjax.models.quant); default: float weights in --dtype")),
    ("--quantize-lm-head", "quantize_lm_head", "model.quantize_lm_head",
     dict(choices=["true", "false"], help="the LM head quantized too, or kept float; default: with gguf as the "
                                          "file stores it when it is a native type, float otherwise")),
    ("--kv-cache-dtype", "kv_cache_dtype", "model.kv_cache_dtype",
     dict(choices=_choices(ModelConfig, "kv_cache_dtype"), help="the KV cache's dtype; default: the model's")),
    ("--max-context", "max_context", "model.max_context",
     dict(type=int, help="cap the KV cache length; default: the model's own context length")),
    ("--mesh", "mesh", "backend.mesh",
     dict(help="run over a device mesh, e.g. data=2,model=4 (tensor parallel over model, the batch over data); "
               "default: one device")),
)
BACKEND_FLAG = ("--backend", "backend", "backend.backend", dict(choices=_choices(BackendConfig, "backend")))


def add_model_flags(p: argparse.ArgumentParser, backend: bool = False) -> None:
    """The model options (MODEL_FLAGS), and --backend when `backend`; every default is the config's."""
    for flag, dest, _, options in MODEL_FLAGS + ((BACKEND_FLAG,) if backend else ()):
        p.add_argument(flag, dest=dest, default=None, **options)


def model_overrides(args) -> list[str]:
    """The config overrides of the model flags (and --backend) the user gave."""
    out = []
    for _, dest, key, _ in MODEL_FLAGS + (BACKEND_FLAG,):
        value = getattr(args, dest, None)
        if value is not None:
            out.append(f"{key}={value}")
    return out


def model_config(args, overrides=()) -> RunConfig:
    """The run config of a command that takes only the model flags: the packaged defaults, `overrides`, then
    the flags."""
    return load_run_config(None, [*overrides, *model_overrides(args)])


def shortcut_overrides(args) -> list[str]:
    out = list(args.set or []) + model_overrides(args)
    for flag, key in (("max_new_tokens", "sampling.max_new_tokens"),
                      ("temperature", "sampling.temperature"), ("top_p", "sampling.top_p"), ("top_k", "sampling.top_k"),
                      ("seed", "sampling.seed"), ("method", "speculative.method"),
                      ("num_speculative_tokens", "speculative.num_speculative_tokens"),
                      ("draft", "speculative.model"), ("attention_impl", "backend.attention_impl")):
        value = getattr(args, flag, None)
        if value is not None:
            out.append(f"{key}={value}")
    return out


def add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="packaged config name (see `specjax configs`) or a YAML file")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override any config key, e.g. sampling.top_p=0.9")
    add_model_flags(p, backend=True)
    p.add_argument("-n", "--max-new-tokens", dest="max_new_tokens", type=int)
    p.add_argument("-t", "--temperature", type=float)
    p.add_argument("--top-p", dest="top_p", type=float)
    p.add_argument("--top-k", dest="top_k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--method", help="speculative method: ngram, draft_model, suffix, medusa, eagle, eagle3 (or 'null' for plain)")
    p.add_argument("-k", "--num-speculative-tokens", dest="num_speculative_tokens", type=int)
    p.add_argument("--draft", help="the draft model (an alias such as qwen2.5-coder-0.5b, a path or a Hub id) or "
                                   "head path for the speculative method")
    p.add_argument("--attention-impl", dest="attention_impl")


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
