"""Prometheus metrics of one app (`GET /metrics`, the text exposition format), on its own registry.

    m = ServerMetrics(backend="onnxruntime", models={"base": served, "lora-a": served_a})  # .queued(), .running()
    engine.listeners.append(m.listener({engine_name: served_id, ...}))  # build_app does this
    m.request("/v1/completions", 200, "base")  # every HTTP response, by route, status and model ("" without one)
    m.finished("base", stats)                  # one engine sequence ended (the engine's `finished` dict)
    body, content_type = m.render()

vLLM's metric families, names, label names and bucket boundaries (vllm/v1/metrics/loggers.py), so a vLLM
Grafana dashboard (examples/online_serving/prometheus_grafana/grafana.json: `{model_name="$model_name"}`)
works unchanged. Every `vllm:` series carries `model_name` (the served id: a base and each of its adapters
apart) and `engine` ("0": this server runs one engine), as vLLM's v1 engine labels them:

    vllm:num_requests_running / vllm:num_requests_waiting      gauges: sequences decoding / queued
    vllm:prompt_tokens_total, vllm:generation_tokens_total     counters: tokens prefilled / generated
    vllm:request_success_total{finished_reason}                counter: sequences ended by stop, length or abort
    vllm:e2e_request_latency_seconds                           arrival (submitted to the engine) -> finish
    vllm:request_queue_time_seconds                            arrival -> first scheduled (admitted)
    vllm:request_prefill_time_seconds                          scheduled -> first token
    vllm:request_decode_time_seconds                           first token -> finish
    vllm:request_inference_time_seconds                        scheduled -> finish (prefill + decode)
    vllm:time_to_first_token_seconds                           arrival -> first token
    vllm:inter_token_latency_seconds                           each gap between consecutive tokens
    vllm:time_per_output_token_seconds                         the same gaps (vLLM's older name, which its
                                                               dashboard plots)
    vllm:request_time_per_output_token_seconds                 per sequence: decode time / (tokens - 1)
    vllm:request_prompt_tokens, vllm:request_generation_tokens per sequence: prompt / generated tokens
    vllm:request_params_max_tokens                             per sequence: its max_tokens

As in vLLM, a "request" is one engine sequence (a completion with n = 3 is three). Sequences that finish
(stop: an EOS or a stop string; length: max_tokens or the context) are observed in every histogram; an
aborted one (the client went away, or cancelled it, before it finished) counts in request_success{abort}
and in the token counters for what it prefilled and generated, not in the latency histograms. TTFT and the
per-token histograms need a generated token (an echo with max_tokens 0 has none). The counters move when a
sequence ends (vLLM adds tokens every step), so their totals equal the sum over finished sequences.

Our own names where vLLM has none: `msllm_requests_total{endpoint,status,model}` (HTTP responses by route and
status, `model` "" on routes that name no model and for unknown ids: a bounded label set) and
`msllm_backend_info{backend,models}`. vLLM's KV-cache gauges (`vllm:kv_cache_usage_perc`, prefix-cache
counters) have no counterpart: each sequence holds its own cache, there are no blocks to count.

A registry per app (not prometheus_client's global one): several apps in one process (the tests) each count
their own requests, and nothing else in the process leaks into the page.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# vLLM's bucket boundaries (seconds), kept exactly: dashboards and recording rules summing `le` across servers
# expect them. A tiny CPU model's ~1 ms token gaps all fall in the first ITL bucket (0.01 s).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
FINISH_REASONS = ("stop", "length", "abort")  # vLLM's FinishReason values, each series present from the start
ENGINE = "0"
ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/health",
    "/metrics",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets, up to the context length)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class ServerMetrics:
    def __init__(self, backend: str, models: Mapping[str, Any]):
        self.registry = r = CollectorRegistry(auto_describe=True)
        labels = ["model_name", "engine"]
        self.requests = Counter(
            "msllm_requests",
            "HTTP responses by route, status code and served model",
            ["endpoint", "status", "model"],
            registry=r,
        )
        waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels, registry=r)
        running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", labels, registry=r
        )
        for name, model in models.items():
            waiting.labels(name, ENGINE).set_function(model.queued)
            running.labels(name, ENGINE).set_function(model.running)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r
        )
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels + ["finished_reason"],
            registry=r,
        )

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        ctx = max((getattr(m.backend, "context_length", 0) for m in models.values()), default=0) or 1
        tokens = buckets_1_2_5(ctx)
        self.request_prompt_tokens = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.request_generation_tokens = hist(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self.max_tokens = hist(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens
        )
        self.ttft = hist(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = hist(
            "vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", ITL_BUCKETS
        )
        self.request_tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.queue = hist(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference = hist(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = hist(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode = hist(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        for name in models:  # every served model's series present (at 0) before its first request, as vLLM's
            for c in (self.prompt_tokens, self.generation_tokens):
                c.labels(name, ENGINE)
            for reason in FINISH_REASONS:
                self.success.labels(name, ENGINE, reason)
            for h in (
                self.request_prompt_tokens,
                self.request_generation_tokens,
                self.max_tokens,
                self.ttft,
                self.itl,
                self.tpot,
                self.request_tpot,
                self.e2e,
                self.queue,
                self.inference,
                self.prefill,
                self.decode,
            ):
                h.labels(name, ENGINE)
        Info("msllm_backend", "what serves the models", registry=r).info(
            {"backend": backend, "models": ",".join(models)}
        )

    def request(self, path: str, status: int, model: str = "") -> None:
        # a bounded label set: unknown paths (404s) share one label; `model` is a served id or ""
        route = path if path in ROUTES else "/v1/models/{id}" if path.startswith("/v1/models/") else "other"
        self.requests.labels(route, str(status), model).inc()

    def listener(self, served_ids: Mapping[str, str]) -> Callable[[str, dict[str, Any]], None]:
        """An engine listener (`Engine.listeners`) recording each ended sequence under its served id (the engine
        names its backends, `served_ids` maps those names to the ids clients send as `model`)."""

        def on_finished(engine_model: str, stats: dict[str, Any]) -> None:
            model = served_ids.get(engine_model)
            if model is not None:
                self.finished(model, stats)

        return on_finished

    def finished(self, model: str, s: dict[str, Any]) -> None:
        """One engine sequence ended: `s` is the engine's record of it (Engine._finished): finish_reason,
        prompt_tokens (prefilled: 0 for an abort before its prefill), generation_tokens, max_tokens,
        perf_counter times t_arrival, t_start (scheduled; None: never), t_first (first token or the scored
        prompt; None: none), t_finish, and gaps (seconds between consecutive tokens)."""
        lab = (model, ENGINE)
        self.success.labels(*lab, s["finish_reason"]).inc()
        self.prompt_tokens.labels(*lab).inc(s["prompt_tokens"])
        self.generation_tokens.labels(*lab).inc(s["generation_tokens"])
        if s["finish_reason"] == "abort":
            return
        n = s["generation_tokens"]
        t_arrival, t_start, t_first, t_finish = s["t_arrival"], s["t_start"], s["t_first"], s["t_finish"]
        self.request_prompt_tokens.labels(*lab).observe(s["prompt_tokens"])
        self.request_generation_tokens.labels(*lab).observe(n)
        self.max_tokens.labels(*lab).observe(s["max_tokens"])
        self.e2e.labels(*lab).observe(t_finish - t_arrival)
        self.queue.labels(*lab).observe(t_start - t_arrival)
        self.prefill.labels(*lab).observe(t_first - t_start)
        self.decode.labels(*lab).observe(t_finish - t_first)
        self.inference.labels(*lab).observe(t_finish - t_start)
        if n:
            self.ttft.labels(*lab).observe(t_first - t_arrival)
        for gap in s["gaps"]:
            self.itl.labels(*lab).observe(gap)
            self.tpot.labels(*lab).observe(gap)
        if n > 1:
            self.request_tpot.labels(*lab).observe((t_finish - t_first) / (n - 1))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
