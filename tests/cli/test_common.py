"""specjax.cli.common: every command that loads a model takes the model options the same way."""
from __future__ import annotations

import pytest

from specjax.cli import common
from specjax.cli.main import build_parser
from specjax.config import ModelConfig, load_run_config

MODEL_ARGS = ["--model", "qwen2.5-coder-1.5b", "--dtype", "bfloat16", "--quantization", "int8",
              "--quantize-lm-head", "true", "--kv-cache-dtype", "int8", "--max-context", "512", "--mesh", "data=1",
              "--backend", "cpu"]
# Each command with the arguments it requires besides the model options.
COMMANDS = {
    "generate": ["generate"], "chat": ["chat"], "tune": ["tune", "--dataset", "q.jsonl"],
    "batch": ["batch", "in.jsonl", "out.jsonl"], "bench": ["bench", "--dataset", "q.jsonl"],
    "serve": ["serve"],
}


def _config(command: str, argv: list[str]):
    args = build_parser().parse_args(COMMANDS[command] + argv)
    # generate, chat, tune and batch read the whole run config; bench and serve only its model and backend.
    if command in ("bench", "serve"):
        return common.model_config(args)
    return load_run_config(args.config, common.shortcut_overrides(args))


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_takes_the_model_options(command, monkeypatch):
    cfg = _config(command, MODEL_ARGS)
    assert cfg.model == ModelConfig(model="qwen2.5-coder-1.5b", dtype="bfloat16", quantization="int8",
                                    quantize_lm_head=True, kv_cache_dtype="int8", max_context=512)
    assert cfg.backend.mesh == "data=1" and cfg.backend.backend == "cpu"
    from specjax import api

    seen = {}
    monkeypatch.setattr(api, "LLM", lambda *a, **k: seen.update(args=a, **k))
    common.make_llm(cfg)
    assert seen["args"] == ("qwen2.5-coder-1.5b", "bfloat16")
    assert {k: seen[k] for k in ("quantization", "quantize_lm_head", "kv_cache_dtype", "max_context", "mesh",
                                 "backend")} == {"quantization": "int8", "quantize_lm_head": True,
                                                 "kv_cache_dtype": "int8", "max_context": 512, "mesh": "data=1",
                                                 "backend": "cpu"}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_defaults_are_the_config_defaults(command):
    cfg = _config(command, [])
    assert cfg.model == load_run_config(None, []).model


def test_choices_come_from_the_schema():
    assert common._choices(ModelConfig, "dtype") == ["auto", "float32", "bfloat16"]
    assert common._choices(ModelConfig, "quantization") == ["int8", "int4", "gguf", "w8a8"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "fp4"])


def test_draft_option_takes_an_alias():
    args = build_parser().parse_args(["generate", "--method", "draft_model", "--draft", "qwen2.5-coder-0.5b"])
    spec = load_run_config(None, common.shortcut_overrides(args)).speculative
    assert spec.method == "draft_model" and spec.model == "qwen2.5-coder-0.5b"
