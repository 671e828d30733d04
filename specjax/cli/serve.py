"""`specjax serve`: the OpenAI-compatible server (`specjax.serve`), shaped like `vllm serve`.

    specjax serve --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
    specjax serve --model PATH --host 127.0.0.1 --port 8000 --max-batch 16 --api-key KEY

Binds to 127.0.0.1 unless --host says otherwise. SIGTERM (or Ctrl-C) stops taking requests, lets those in flight
finish for --shutdown-timeout seconds, cancels what is left, and exits with status 0.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Sequence

from specjax.cli.common import add_model_flags, make_llm, model_config
from specjax.config import ConfigError, SpeculativeConfig

# Nothing here imports JAX or FastAPI at module level: `specjax --help` builds this parser.


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_flags(p, backend=True)  # --model, --dtype, --quantization, --kv-cache-dtype, ... as every command
    p.add_argument("--served-model-name", dest="served_model_name",
                   help="the name clients give as `model` (default: --model, or the default model's name)")
    p.add_argument("--speculative-config", dest="speculative_config",
                   help="JSON object of SpeculativeConfig fields, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4}' (default: plain decoding)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", dest="api_key", default=os.environ.get("SPECJAX_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                        "$SPECJAX_API_KEY, else none)")
    p.add_argument("--max-batch", dest="max_batch", type=int, default=16, help="requests decoded together")
    p.add_argument("--max-queue", dest="max_queue", type=int, default=64,
                   help="requests waiting for a slot at most; more get 429")
    p.add_argument("--max-prompt-tokens", dest="max_prompt_tokens", type=int, default=1024,
                   help="longest prompt in tokens (fixes the compiled prompt bucket)")
    p.add_argument("--max-tokens", dest="max_tokens", type=int, default=256,
                   help="most new tokens a request may ask for (fixes the compiled output bucket); the default "
                        "max_tokens of chat requests")
    p.add_argument("--step-chunk", dest="step_chunk", type=int, default=4,
                   help="decode steps between host check-ins: streams get text and requests join this often")
    p.add_argument("--max-body-bytes", dest="max_body_bytes", type=int, default=4 << 20,
                   help="largest request body in bytes; a larger one gets 413 before it is read (default 4 MiB)")
    p.add_argument("--max-prompt-chars", dest="max_prompt_chars", type=int, default=None,
                   help="most characters of prompt text a request may send, checked before tokenizing (default: "
                        "--max-prompt-tokens times the vocabulary's longest token)")
    p.add_argument("--prepare-workers", dest="prepare_workers", type=int, default=2,
                   help="threads that tokenize prompts and render chat templates, off the event loop")
    p.add_argument("--shutdown-timeout", dest="shutdown_timeout", type=float, default=30.0,
                   help="seconds in-flight requests may run on after SIGTERM before they are cancelled")
    p.add_argument("--log-level", dest="log_level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])


def speculative_from_json(text: str | None) -> SpeculativeConfig:
    """--speculative-config's JSON object as a SpeculativeConfig (None or 'null': plain decoding)."""
    if text is None:
        return SpeculativeConfig()
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--speculative-config is not valid JSON ({e.msg} at character {e.pos}); "
                          "write e.g. '{\"method\": \"ngram\"}'") from None
    if value is not None and not isinstance(value, dict):
        raise ConfigError(f"--speculative-config must be a JSON object, got {type(value).__name__}")
    return SpeculativeConfig.from_user(value)


def run(args) -> int:
    """Load the model, compile, serve until SIGTERM / Ctrl-C. Exit status 0 after a clean shutdown."""
    try:
        import uvicorn

        from specjax.serve import build_server
    except ImportError as e:
        print(f"specjax: error: `specjax serve` needs the serve extra ({e.name} is missing): "
              "pip install 'specjax[serve]'", file=sys.stderr)
        return 2
    from specjax.runners.serving import EngineOptions
    from specjax.serve.limits import ServerLimits

    spec = speculative_from_json(args.speculative_config)
    options = EngineOptions(max_batch=args.max_batch, max_prompt_tokens=args.max_prompt_tokens,
                            max_tokens=args.max_tokens, max_queue=args.max_queue, step_chunk=args.step_chunk)
    say = lambda msg: print(f"specjax serve: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    cfg = model_config(args)
    model = cfg.model.model
    t = time.perf_counter()
    llm = make_llm(cfg)
    say(f"loaded {model} in {time.perf_counter() - t:.1f} s; compiling "
        f"(batch {args.max_batch}, method {spec.method or 'plain'})")
    limits = ServerLimits(max_body_bytes=args.max_body_bytes, max_prompt_chars=args.max_prompt_chars,
                          prepare_workers=args.prepare_workers)
    app, engine = build_server(llm, spec, options, model_name=args.served_model_name or model, api_key=args.api_key,
                               limits=limits)
    say(f"compiled in {engine.warmup_seconds:.1f} s; serving {args.served_model_name or model!r} on "
        f"http://{args.host}:{args.port}" + (" (API key required)" if args.api_key else ""))

    # uvicorn restores the handlers it found and raises the signals it caught once it has shut down: with these
    # in place that signal lands here (nothing to do: the drain already ran) instead of killing the process
    # before the engine is stopped.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    make_server(app, engine, args.host, args.port, args.shutdown_timeout, args.log_level, say).run()
    clean = engine.shutdown(0.0)
    say("stopped" + ("" if clean else " (requests still running at the deadline were cancelled)"))
    return 0


def make_server(app, engine, host: str, port: int, shutdown_timeout: float, log_level: str = "info",
                say=lambda msg: None, **config):
    """A uvicorn.Server for the app whose exit (SIGTERM, Ctrl-C, or handle_exit called directly) first drains
    the engine: new requests get 503 at once, in-flight ones get `shutdown_timeout` seconds before they are
    cancelled. Run it with .run() (or .run(sockets=[...])); `config`: more uvicorn.Config options."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:
                say(f"shutting down: finishing in-flight requests (at most {shutdown_timeout:g} s)")
            engine.drain(shutdown_timeout)
            super().handle_exit(sig, frame)

    # uvicorn's own grace period is a backstop: the engine's deadline ends every request before it.
    return Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                                 timeout_graceful_shutdown=int(shutdown_timeout) + 5, **config))


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m specjax.cli.serve ...` (the same as `specjax serve ...`)."""
    from specjax.cli.common import standalone

    return standalone("specjax serve", __doc__.split("\n")[0], add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
