"""Prometheus metrics of `specjax serve`, named like vLLM's (prefix `specjax:` where vLLM has `vllm:`).

Counters (exposed with a `_total` suffix):
  specjax:request_success{finished_reason}         requests that finished with a result ("stop" / "length")
  specjax:request_failure{reason}                  requests that ended without one: cancelled (client gone),
                                                   error (generation failed, or a server defect: 500),
                                                   shutdown, and the refusals: bad_request (400: any body the
                                                   server cannot read or serve, unreadable JSON included),
                                                   unauthorized (401), not_found (404: route or model),
                                                   method_not_allowed (405), too_large (413), queue_full (429),
                                                   unavailable (503)
  specjax:prompt_tokens, specjax:generation_tokens  summed over finished requests (usage.prompt_tokens /
                                                   usage.completion_tokens)
  specjax:spec_decode_num_drafts                   verify steps of finished requests (spec_decode.verify_steps)
  specjax:spec_decode_num_draft_tokens             drafted tokens (spec_decode.drafted)
  specjax:spec_decode_num_accepted_tokens          accepted tokens (spec_decode.accepted)
  specjax:spec_decode_num_accepted_tokens_per_pos{position}  (spec_decode.per_position_accepted[position])
Gauges: specjax:num_requests_running, specjax:num_requests_waiting, specjax:jit_compiles (XLA compilations since
the engine started: flat after warm-up). Histograms: specjax:time_to_first_token_seconds,
specjax:e2e_request_latency_seconds, specjax:request_queue_time_seconds. Plus the process collector's
process_resident_memory_bytes.

The speculative counters add up exactly the per-response `spec_decode` objects of the requests that finished, so
over a run they equal the sums a client computes from the responses it received (requests cancelled before
finishing count in neither).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from specjax.runners.serving import EngineObserver, Result

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)


class ServerMetrics(EngineObserver):
    """The server's metrics in their own registry (several servers in one process stay apart). Observes the
    engine (`EngineObserver`: called on its thread; prometheus_client is thread-safe)."""

    def __init__(self, engine=None):
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        self.success = Counter("specjax:request_success", "Requests finished with a result", ["finished_reason"],
                               registry=r)
        self.failure = Counter("specjax:request_failure", "Requests ended without a result", ["reason"], registry=r)
        self.prompt_tokens = Counter("specjax:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("specjax:generation_tokens", "Tokens generated for finished requests",
                                         registry=r)
        self.num_drafts = Counter("specjax:spec_decode_num_drafts", "Verify steps of finished requests", registry=r)
        self.num_draft_tokens = Counter("specjax:spec_decode_num_draft_tokens", "Drafted tokens", registry=r)
        self.num_accepted = Counter("specjax:spec_decode_num_accepted_tokens", "Accepted draft tokens", registry=r)
        self.accepted_per_pos = Counter("specjax:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens per draft position", ["position"], registry=r)
        self.ttft = Histogram("specjax:time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram("specjax:e2e_request_latency_seconds", "End-to-end request latency", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.queue = Histogram("specjax:request_queue_time_seconds", "Time waiting for a slot", registry=r,
                               buckets=_LATENCY_BUCKETS)
        self.running = Gauge("specjax:num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("specjax:num_requests_waiting", "Requests waiting for a slot", registry=r)
        self.compiles = Gauge("specjax:jit_compiles", "XLA compilations since the engine started", registry=r)
        if engine is not None:
            self.attach(engine)

    def attach(self, engine) -> None:
        """Read the gauges from `engine` at every scrape."""
        self.running.set_function(lambda: engine.num_running)
        self.waiting.set_function(lambda: engine.num_waiting)
        self.compiles.set_function(lambda: engine.compiles)

    # EngineObserver
    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def finished(self, result: Result) -> None:
        self.success.labels(result.finish_reason).inc()
        self.prompt_tokens.inc(result.prompt_tokens)
        self.generation_tokens.inc(result.completion_tokens)
        self.e2e.observe(result.e2e_latency)
        self.queue.observe(result.queue_time)
        m = result.spec
        if m is not None:
            self.num_drafts.inc(m["verify_steps"])
            self.num_draft_tokens.inc(m["drafted"])
            self.num_accepted.inc(m["accepted"])
            for pos, n in enumerate(m["per_position_accepted"]):
                self.accepted_per_pos.labels(str(pos)).inc(n)

    def failed(self, reason: str) -> None:
        self.failure.labels(reason).inc()

    def exposition(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)
