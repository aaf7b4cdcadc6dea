"""Prometheus metrics of one server (``GET /metrics``), named after vLLM's (``vllm:`` -> ``atomtool:``).

Each app gets its own :class:`prometheus_client.CollectorRegistry`, so several servers in one process
(tests, the demo) never share counters. Gauges for running/waiting requests and KV-cache usage are
read at scrape time from the engine thread's :class:`~atomtool.serve.api.async_engine.EngineSnapshot`.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from atomtool.serve.api.async_engine import EngineSnapshot

# Buckets in seconds, the ranges vLLM uses for the same histograms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0)


class ServerMetrics:
    """The metrics of one server.

    Counters: ``atomtool:http_requests_total{endpoint,status}`` (every API response by HTTP status),
    ``atomtool:request_success_total{finished_reason}`` (engine requests by how they ended: stop,
    length, abort, error), ``atomtool:prompt_tokens_total``, ``atomtool:generation_tokens_total``.
    Histograms (seconds): ``atomtool:time_to_first_token_seconds`` (arrival -> first token),
    ``atomtool:time_per_output_token_seconds`` (gap between consecutive tokens of one request).
    Gauges: ``atomtool:num_requests_running``, ``atomtool:num_requests_waiting``,
    ``atomtool:kv_cache_usage_perc`` (fraction of KV blocks in use, 0..1).
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, snapshot_fn, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name}
        r = self.registry
        self.http_requests = Counter("atomtool:http_requests", "API responses by endpoint and HTTP status.",
                                     ["endpoint", "status"], registry=r)
        self.request_success = Counter("atomtool:request_success", "Finished engine requests by reason.",
                                       ["model_name", "finished_reason"], registry=r)
        self.prompt_tokens = Counter("atomtool:prompt_tokens", "Prefilled prompt tokens.", ["model_name"],
                                     registry=r).labels(**labels)
        self.generation_tokens = Counter("atomtool:generation_tokens", "Generated tokens.", ["model_name"],
                                         registry=r).labels(**labels)
        self.ttft = Histogram("atomtool:time_to_first_token_seconds", "Time to first token (s).",
                              ["model_name"], buckets=TTFT_BUCKETS, registry=r).labels(**labels)
        self.tpot = Histogram("atomtool:time_per_output_token_seconds", "Time per output token (s).",
                              ["model_name"], buckets=TPOT_BUCKETS, registry=r).labels(**labels)
        self._model_name = model_name
        self._live: dict[str, list[float]] = {}  # request id -> [arrival, last token time]

        def snap() -> EngineSnapshot:
            return snapshot_fn()

        Gauge("atomtool:num_requests_running", "Requests in the running batch.", registry=r) \
            .set_function(lambda: snap().num_running)
        Gauge("atomtool:num_requests_waiting", "Requests waiting to be scheduled.", registry=r) \
            .set_function(lambda: snap().num_waiting)
        Gauge("atomtool:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", registry=r) \
            .set_function(lambda: snap().kv_cache_usage)
        Gauge("atomtool:num_kv_blocks_total", "KV-cache blocks in the pool.", registry=r) \
            .set_function(lambda: snap().num_total_blocks)

    def arrived(self, request_id: str, now: float | None = None) -> None:
        """Start timing engine request ``request_id`` (call when its HTTP request arrived)."""
        self._live[request_id] = [time.monotonic() if now is None else now, 0.0]

    def observe(self, out) -> None:
        """Account one :class:`RequestOutput` (event loop only): tokens, TTFT, per-token gaps, finish."""
        times = self._live.get(out.request_id)
        now = time.monotonic()
        new = len(out.new_token_ids or ())
        if times is not None and new:
            if times[1] == 0.0:
                self.ttft.observe(now - times[0])
                self.prompt_tokens.inc(len(out.prompt_token_ids or ()))
            else:
                self.tpot.observe((now - times[1]) / new)
            times[1] = now
        if new:
            self.generation_tokens.inc(new)
        if out.finished:
            self._live.pop(out.request_id, None)
            self.finished(out.finish_reason or "stop")

    def forget(self, request_id: str) -> None:
        """Stop tracking a request the engine rejected (counted by the HTTP status counter only)."""
        self._live.pop(request_id, None)

    def ended_early(self, request_id: str, reason: str) -> None:
        """A request ended without a final output (``abort`` on disconnect, ``error``)."""
        if self._live.pop(request_id, None) is not None:
            self.finished(reason)

    def finished(self, reason: str) -> None:
        """Count one finished engine request (``stop`` / ``length`` / ``abort`` / ``error``)."""
        self.request_success.labels(model_name=self._model_name, finished_reason=reason).inc()

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format."""
        return generate_latest(self.registry)
