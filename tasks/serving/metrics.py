"""Prometheus metrics of one app (`GET /metrics`, the text exposition format), on its own registry.

    m = ServerMetrics(backend="onnxruntime", models={"base": served, "lora-a": served_a})  # .queued(), .running()
    m.request("/v1/completions", 200, "base")  # every response, by route, status and model ("" without one)
    m.finished("base", done_event)             # tokens, TTFT, inter-token gaps of a finished sequence
    body, content_type = m.render()

A registry per app (not prometheus_client's global one): several apps in one process (the tests)
each count their own requests, and nothing else in the process leaks into the page. Names follow
vLLM's where there is one (`vllm:` -> `msllm_`): time_to_first_token_seconds, inter_token_latency_seconds,
prompt_tokens_total, generation_tokens_total, num_requests_waiting / running. Every per-request series
carries the served model id as `model` (a base and each of its adapters apart); the label is "" on routes
that name no model and for requests naming an unknown one (a bounded label set).
"""

from __future__ import annotations

from typing import Any, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# seconds; from a 1 ms decode step of a tiny model up to a slow first token behind a long queue
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize",
          "/detokenize", "/tokenizer_info")


class ServerMetrics:
    def __init__(self, backend: str, models: Mapping[str, Any]):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("msllm_requests", "HTTP responses by route, status code and served model",
                                ["endpoint", "status", "model"], registry=r)
        self.prompt_tokens = Counter("msllm_prompt_tokens", "prompt tokens of finished sequences", ["model"],
                                     registry=r)
        self.generation_tokens = Counter("msllm_generation_tokens", "tokens generated", ["model"], registry=r)
        self.ttft = Histogram("msllm_time_to_first_token_seconds", "arrival to first generated token", ["model"],
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("msllm_inter_token_latency_seconds", "time between consecutive generated tokens",
                             ["model"], buckets=ITL_BUCKETS, registry=r)
        waiting = Gauge("msllm_num_requests_waiting", "requests queued, not yet decoding", ["model"], registry=r)
        running = Gauge("msllm_num_requests_running", "sequences being decoded (active)", ["model"], registry=r)
        for name, model in models.items():
            waiting.labels(name).set_function(model.queued)
            running.labels(name).set_function(model.running)
        Info("msllm_backend", "what serves the models", registry=r).info(
            {"backend": backend, "models": ",".join(models)})

    def request(self, path: str, status: int, model: str = "") -> None:
        # a bounded label set: unknown paths (404s) share one label; `model` is a served id or ""
        route = path if path in ROUTES else "/v1/models/{id}" if path.startswith("/v1/models/") else "other"
        self.requests.labels(route, str(status), model).inc()

    def finished(self, model: str, done: dict[str, Any]) -> None:
        self.prompt_tokens.labels(model).inc(done["prompt_tokens"])
        self.generation_tokens.labels(model).inc(done["completion_tokens"])
        if done["completion_tokens"]:
            self.ttft.labels(model).observe(done["ttft_s"])
        for gap in done.get("token_gaps", ()):
            self.itl.labels(model).observe(gap)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
