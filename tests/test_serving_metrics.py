"""`/metrics` speaks vLLM's families (tasks/serving/metrics.py), so a vLLM Grafana dashboard works unchanged.

A real `msllm serve` child (tests/test_serving.Server, the tiny model artifact) driven by the official `openai`
client; the page read back with prometheus_client's own text parser. Counters and histogram counts must equal
exactly what the requests sent were told in their responses (usage, finish_reason). Aborts are exercised on a
real in-process Engine, where cancelling at a chosen token is deterministic.
"""

from __future__ import annotations

import threading
import urllib.request

import pytest

from tests.helpers import tiny_model_artifact
from tests.test_serving import Server

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.integration

# what vLLM's dashboard (examples/online_serving/prometheus_grafana/grafana.json) and its docs name
HISTOGRAMS = [
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_params_max_tokens",
]
TOKEN_HISTOGRAMS = [
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:request_time_per_output_token_seconds",
]
# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py)
VLLM_TTFT = [
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
]
VLLM_LATENCY = [
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
]


def parse(text: str) -> tuple[dict[str, str], dict[str, dict[tuple, float]]]:
    """({family name: type}, {sample name: {sorted label items: value}}) by prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    types, samples = {}, {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return types, samples


def key(**labels: str) -> tuple:
    """A sample's label key as `parse` stores it: the items sorted by name."""
    return tuple(sorted(labels.items()))


def scrape(url: str):
    return parse(urllib.request.urlopen(url + "/metrics", timeout=10).read().decode())


@pytest.fixture(scope="module")
def model_art(tmp_path_factory):
    return tiny_model_artifact(tmp_path_factory.mktemp("metrics_root"))


def test_vllm_metric_families_count_exactly_the_requests_sent(model_art, tmp_path):
    srv = Server(model_art, tmp_path)  # a fresh server: every count below starts at 0
    try:
        client, model = srv.client(), srv.model
        lab = (("engine", "0"), ("model_name", model))
        types, m = scrape(srv.url)
        # every family a vLLM dashboard reads is there, at 0, before the first request
        assert types["vllm:request_success"] == "counter" and types["vllm:prompt_tokens"] == "counter"
        assert types["vllm:num_requests_running"] == "gauge" and types["vllm:num_requests_waiting"] == "gauge"
        for h in HISTOGRAMS + TOKEN_HISTOGRAMS:
            assert types[h] == "histogram" and m[h + "_count"][lab] == 0, h
        for reason in ("stop", "length", "abort"):
            assert m["vllm:request_success_total"][key(**dict(lab), finished_reason=reason)] == 0
        assert m["vllm:prompt_tokens_total"][lab] == 0 and m["vllm:num_requests_running"][lab] == 0
        ttft_le = sorted(float(dict(k)["le"]) for k in m["vllm:time_to_first_token_seconds_bucket"])
        assert ttft_le[:-1] == VLLM_TTFT  # vLLM's boundaries, then +Inf
        e2e_le = sorted(float(dict(k)["le"]) for k in m["vllm:e2e_request_latency_seconds_bucket"])
        assert e2e_le[:-1] == VLLM_LATENCY

        # a stop string the greedy completion is known to contain: that request ends by "stop"
        probe = client.completions.create(model=model, prompt="ROMEO:", max_tokens=12, temperature=0)
        text = probe.choices[0].text
        stop = next(ch for ch in text[1:] if not ch.isspace())
        seqs = [(c.finish_reason, probe.usage.prompt_tokens, probe.usage.completion_tokens, 12) for c in probe.choices]
        for i in range(3):  # ends by length (or EOS: then stop): each counted as its response says
            r = client.completions.create(model=model, prompt=f"KING {i}:", max_tokens=5 + i, temperature=0)
            seqs.append((r.choices[0].finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens, 5 + i))
        r = client.completions.create(model=model, prompt="ROMEO:", max_tokens=12, temperature=0, stop=[stop])
        assert r.choices[0].finish_reason == "stop"
        seqs.append(("stop", r.usage.prompt_tokens, r.usage.completion_tokens, 12))
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Speak."}], max_tokens=6, temperature=0
        )
        seqs.append((r.choices[0].finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens, 6))
        # streamed: the usage comes in the last chunk
        chunks = list(
            client.completions.create(
                model=model,
                prompt="JULIET:",
                max_tokens=7,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage = chunks[-1].usage
        seqs.append((finish[0], usage.prompt_tokens, usage.completion_tokens, 7))
        # n = 2: two engine sequences (vLLM counts each), the prompt prefilled for each (the usage counts it once);
        # each choice's tokens from its logprobs
        r = client.completions.create(
            model=model, prompt="HAMLET:", max_tokens=4, temperature=1.0, seed=5, n=2, logprobs=0
        )
        assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
        for c in r.choices:
            seqs.append((c.finish_reason, r.usage.prompt_tokens, len(c.logprobs.tokens), 4))
        completions_calls = 7

        types, m = scrape(srv.url)
        n = len(seqs)
        reasons = {k: sum(1 for s in seqs if s[0] == k) for k in ("stop", "length")}
        assert reasons["stop"] >= 1 and reasons["length"] >= 1  # both endings exercised
        for reason, count in reasons.items():
            assert m["vllm:request_success_total"][key(**dict(lab), finished_reason=reason)] == count, reason
        assert m["vllm:request_success_total"][key(**dict(lab), finished_reason="abort")] == 0
        prompt, gen = sum(s[1] for s in seqs), sum(s[2] for s in seqs)
        assert m["vllm:prompt_tokens_total"][lab] == prompt
        assert m["vllm:generation_tokens_total"][lab] == gen
        for h in HISTOGRAMS:  # one observation per sequence
            assert m[h + "_count"][lab] == n, h
            assert m[h + "_bucket"][key(**dict(lab), le="+Inf")] == n, h
        assert m["vllm:request_prompt_tokens_sum"][lab] == prompt
        assert m["vllm:request_generation_tokens_sum"][lab] == gen
        assert m["vllm:request_params_max_tokens_sum"][lab] == sum(s[3] for s in seqs)
        assert m["vllm:time_to_first_token_seconds_count"][lab] == sum(1 for s in seqs if s[2] > 0)
        gaps = sum(s[2] - 1 for s in seqs if s[2] > 0)  # one gap between consecutive tokens
        assert m["vllm:inter_token_latency_seconds_count"][lab] == gaps
        assert m["vllm:time_per_output_token_seconds_count"][lab] == gaps
        assert m["vllm:request_time_per_output_token_seconds_count"][lab] == sum(1 for s in seqs if s[2] > 1)
        # the phases partition each request's time: e2e = queue + prefill + decode, TTFT = queue + prefill,
        # inference = prefill + decode (sums of n float64 observations of perf_counter differences: a few float64
        # ulps, 2^-52 relative each, so 1e-9 relative is ~10^6 ulps of room and independent of the order)
        s = {h: m[h + "_sum"][lab] for h in HISTOGRAMS + TOKEN_HISTOGRAMS}
        q, p, d = (s[f"vllm:request_{k}_time_seconds"] for k in ("queue", "prefill", "decode"))
        assert min(q, p, d) >= 0 and s["vllm:e2e_request_latency_seconds"] > 0
        assert s["vllm:e2e_request_latency_seconds"] == pytest.approx(q + p + d, rel=1e-9, abs=1e-9)
        assert s["vllm:time_to_first_token_seconds"] == pytest.approx(q + p, rel=1e-9, abs=1e-9)
        assert s["vllm:request_inference_time_seconds"] == pytest.approx(p + d, rel=1e-9, abs=1e-9)
        assert m["vllm:num_requests_running"][lab] == 0 and m["vllm:num_requests_waiting"][lab] == 0
        # our own names stay only where vLLM has none: HTTP responses by route and status
        assert (
            m["msllm_requests_total"][(("endpoint", "/v1/completions"), ("model", model), ("status", "200"))]
            == completions_calls
        )
        assert "msllm_prompt_tokens_total" not in m and "msllm_time_to_first_token_seconds_count" not in m
    finally:
        srv.stop()


def test_aborted_sequences_count_as_abort(model_art):
    """A sequence cancelled at its 3rd token (or the token event that passes 3) and one cancelled while queued:
    request_success{abort} 2, the tokens
    the first prefilled and generated in the token counters, neither in the latency histograms."""
    from tasks.serving.app import Served
    from tasks.serving.backends import load_backend
    from tasks.serving.engine import Engine, Sampling
    from tasks.serving.metrics import ServerMetrics

    engine = Engine(lambda: load_backend(model_art), max_active=1)
    engine.start(timeout=300)
    try:
        metrics = ServerMetrics("mindspore", {"tiny": Served(engine, model_art)})
        engine.listeners.append(metrics.listener({engine.default_model: "tiny"}))
        prompt = [engine.backend.eos_id, 5, 6, 7, 8]
        done, ready, queued, tokens, at_cancel = threading.Event(), threading.Event(), [], [0], []

        def emit_first(ev):
            ready.wait(10)  # `first` is assigned
            if ev["type"] == "token":
                tokens[0] += ev["tokens"]
                if not queued:  # a second request arrives and is cancelled while it waits (max_active 1)
                    queued.append(engine.submit(prompt, Sampling(max_tokens=4, temperature=0), lambda ev: None))
                    queued[0].cancel()
                if tokens[0] >= 3 and not at_cancel:
                    at_cancel.append(tokens[0])  # every generated token so far (each token event covers up to now)
                    first.cancel()
                    done.set()
            elif ev["type"] in ("done", "error"):
                done.set()

        first = engine.submit(prompt, Sampling(max_tokens=100, temperature=0), emit_first)
        ready.set()
        assert done.wait(120)
        # a third request that finishes: after it, both aborts have been handled (FIFO, one worker thread)
        finished = threading.Event()
        engine.submit(
            prompt,
            Sampling(max_tokens=2, temperature=0),
            lambda ev: finished.set() if ev["type"] in ("done", "error") else None,
        )
        assert finished.wait(120)
        _, m = parse(metrics.render()[0].decode())
        lab = (("engine", "0"), ("model_name", "tiny"))
        assert m["vllm:request_success_total"][key(**dict(lab), finished_reason="abort")] == 2
        done_reasons = sum(
            m["vllm:request_success_total"][key(**dict(lab), finished_reason=r)] for r in ("stop", "length")
        )
        assert done_reasons == 1
        last_gen = m["vllm:request_generation_tokens_sum"][lab]  # the finished one alone
        assert m["vllm:generation_tokens_total"][lab] == at_cancel[0] + last_gen  # the abort's tokens too
        assert m["vllm:prompt_tokens_total"][lab] == 2 * len(prompt)  # the queued abort never prefilled
        assert m["vllm:e2e_request_latency_seconds_count"][lab] == 1
        assert m["vllm:time_to_first_token_seconds_count"][lab] == 1
    finally:
        engine.stop()
