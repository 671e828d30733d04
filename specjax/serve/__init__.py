"""`specjax serve`: the OpenAI-compatible HTTP server (FastAPI, the `[serve]` extra) over the serving engine
(`specjax.runners.serving`). `serve.app.create_app` builds the ASGI app, `serve.protocol` holds the request
models, `serve.limits` the checks made before a body is read, `serve.prepare` the prompt checks and tokenizing
off the event loop, `serve.metrics` the Prometheus metrics; `build_server` puts them together.

Nothing here is imported by `import specjax`: FastAPI stays optional.
"""
from __future__ import annotations


def build_server(llm, speculative=None, options=None, *, model_name: str = "default", api_key: str | None = None,
                 warmup: bool = True, limits=None):
    """(app, engine): a started engine (programs compiled when `warmup`) for `llm` with one speculative config
    (None: plain decoding) and `runners.serving.EngineOptions`, its metrics, and the app over it with
    `serve.limits.ServerLimits` (None: the defaults). Stop the engine with engine.shutdown(deadline) after the
    app is done."""
    from specjax.runners.serving import ServingEngine
    from specjax.serve.app import create_app
    from specjax.serve.metrics import ServerMetrics

    metrics = ServerMetrics()
    engine = ServingEngine(llm, speculative, options, observer=metrics)
    metrics.attach(engine)
    engine.start(warmup=warmup)
    return create_app(engine, model_name, api_key=api_key, metrics=metrics, limits=limits), engine
