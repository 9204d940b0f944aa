"""Prometheus metrics at `/metrics`, named as vLLM names them with an `oai_gemma:` prefix.

Latencies come from the engine's own timestamps (`arrival_time`, each event's `timestamp`, the first
event's `scheduled_time`), observed as each event is consumed; the running / waiting / KV-cache gauges
read `engine.stats()` at scrape time. One private registry per app, so several apps can live in one process.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, SummaryMetricFamily

from ..engine.observer import RequestObserver
from ..engine.types import GenerationRequest, TokenEvent
from .access_log import AccessRecord, GenerationStats, current_record
from .metrics_vllm import VLLM, LoraInfoCollector, PrefixCacheCollector, PrefixCacheCounts, SpecDecodeCollector, VllmLoadCollector

CONTENT_TYPE = CONTENT_TYPE_LATEST
disable_created_metrics()  # no `_created` twin of every series (process-wide; this server has only ours)
OUTCOMES = ("stop", "length", "tool_calls", "cancelled", "error", "rejected")

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), so dashboards built for vLLM read ours alike
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)


class ServerMetrics(RequestObserver):
    """The engine observer of an app: Prometheus series, and each request's stats for its access-log line."""

    def __init__(
        self, model_name: str, stats: Callable[[], dict | None], keep_text: bool = False, vllm_names: bool = False,
        cache_config: Callable[[], dict | None] = lambda: None, lora_stats: Callable[[], dict | None] = lambda: None,
    ):
        """`stats()`: the engine's `stats()`, or None while there is no engine (`cache_config()` and `lora_stats()`
        likewise); `vllm_names`: also serve vLLM's names (metrics_vllm.py)."""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.keep_text = keep_text
        self._live: dict[str, tuple[GenerationStats, AccessRecord | None]] = {}
        """Requests between their first hook call and their close, with the HTTP request they serve."""
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        self.ttft = histogram("oai_gemma:time_to_first_token_seconds", "Time to first token, from HTTP arrival.", TTFT_BUCKETS)
        self.itl = histogram("oai_gemma:inter_token_latency_seconds", "Time between two output tokens of a request.", ITL_BUCKETS)
        self.e2e = histogram(
            "oai_gemma:e2e_request_latency_seconds", "From HTTP arrival to the last token (or the cancel).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue = histogram(
            "oai_gemma:request_queue_time_seconds", "From HTTP arrival to a batch slot.", REQUEST_LATENCY_BUCKETS
        )
        self.prompt_tokens = counter("oai_gemma:prompt_tokens", "Prompt tokens of requests that got a first token.")
        self.generation_tokens = counter("oai_gemma:generation_tokens", "Tokens generated.")
        outcomes = Counter(
            "oai_gemma:request_success", "Requests by how they ended (per choice; `rejected`: refused, never started).",
            labels + ["finished_reason"], registry=self.registry,
        )
        self.outcomes = {reason: outcomes.labels(model_name, reason) for reason in OUTCOMES}
        self.backlog_cancels = counter(
            "oai_gemma:stream_backlog_cancels", "Requests cancelled because their client fell server.max_stream_backlog events behind.",
        )
        self.lora_requests = Counter(
            "oai_gemma:lora_requests", "Requests served under each LoRA adapter (per request, however it ended).",
            labels + ["lora_name"], registry=self.registry,
        )
        self.store_errors = counter("oai_gemma:response_store_errors", "Writes to the Responses store that failed (disk full, read-only).")
        self.registry.register(_StatsCollector(model_name, stats))
        self.prefix_cache = PrefixCacheCounts()
        self.registry.register(PrefixCacheCollector("oai_gemma:", model_name, self.prefix_cache))
        self.registry.register(LoraInfoCollector("oai_gemma:", lora_stats))
        self.registry.register(SpecDecodeCollector("oai_gemma:", model_name, stats))
        if vllm_names:
            self.registry.register(PrefixCacheCollector(VLLM, model_name, self.prefix_cache))
            self.registry.register(LoraInfoCollector(VLLM, lora_stats))
            self.registry.register(SpecDecodeCollector(VLLM, model_name, stats))
            self.registry.register(VllmLoadCollector(model_name, stats, cache_config))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- the engine observer ----------------------------------------------------------------------

    def _stats(self, request: GenerationRequest) -> tuple[GenerationStats, AccessRecord | None]:
        live = self._live.get(request.request_id)
        if live is None:
            stats, record = GenerationStats(request.arrival_time, text=[] if self.keep_text else None), current_record()
            if record is not None:
                record.generations[request.request_id] = stats
                record.model = self.model_name
            live = self._live[request.request_id] = (stats, record)
        return live

    def on_event(self, request: GenerationRequest, event: TokenEvent) -> None:
        stats, _ = self._stats(request)
        stats.prompt_tokens = event.num_prompt_tokens
        if event.finish_reason is not None:
            stats.outcome, stats.finish_time = event.finish_reason, event.timestamp
        if stats.text is not None:
            stats.text.append(event.text)
        if event.token_id is None:
            return
        if stats.first_token_time is None:
            stats.first_token_time = event.timestamp
            self.ttft.observe(event.timestamp - stats.arrival)
            self.prompt_tokens.inc(event.num_prompt_tokens)
            self.prefix_cache.count(event.num_prompt_tokens, event.num_cached_tokens)
            if event.scheduled_time is not None:
                self.queue.observe(event.scheduled_time - stats.arrival)
        previous = stats.last_token_times.get(event.index)
        if previous is not None:
            self.itl.observe(event.timestamp - previous)
        stats.last_token_times[event.index] = event.timestamp
        stats.output_tokens += 1
        self.generation_tokens.inc()

    def on_close(self, request: GenerationRequest, cancelled: bool) -> None:
        stats, record = self._stats(request)
        del self._live[request.request_id]
        if request.adapter is not None:
            self.lora_requests.labels(self.model_name, request.adapter).inc()
        if cancelled or stats.outcome is None:  # closed before its last event
            stats.outcome, stats.finish_time = "cancelled" if cancelled else "error", time.perf_counter()
        self.e2e.observe(stats.finish_time - stats.arrival)
        if record is None or record.done:
            self._count(stats.outcome)
        # else counted with the record once the response is over: the API layer may still rename it (tool_calls)

    def on_reject(self, reason: str) -> None:
        record = current_record()
        if record is not None:
            record.rejected = True
            record.model = self.model_name
        self._count("rejected")

    def on_backlog_full(self, request: GenerationRequest) -> None:
        self.backlog_cancels.inc()

    def count_outcomes(self, record: AccessRecord) -> None:
        """The response is over: count the outcomes of its engine requests (the access log's `on_done`).

        One still open (a dropped stream not yet closed) has none yet; its `on_close` counts it."""
        for stats in record.generations.values():
            if stats.outcome is not None:
                self._count(stats.outcome)

    def _count(self, outcome: str) -> None:
        self.outcomes.get(outcome, self.outcomes["error"]).inc()


class _StatsCollector:
    """Running / waiting requests and KV-cache use, read from the engine at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], dict | None]):
        self.model_name = model_name
        self.stats = stats

    def collect(self):
        stats = self.stats() or {}
        for name, doc, key in (
            ("oai_gemma:num_requests_running", "Requests in the running batch.", "running"),
            ("oai_gemma:num_requests_waiting", "Requests waiting for a batch slot.", "waiting"),
            ("oai_gemma:kv_cache_usage_perc", "KV-cache usage (share of blocks running requests hold). 1 means 100 percent.", "kv_cache_usage"),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric([self.model_name], stats.get(key, 0))
            yield gauge
        vision = SummaryMetricFamily(
            "oai_gemma:vision_encode_seconds", "The vision tower's time per encoded image set (however many steps it spanned).",
            labels=["model_name"],
        )
        vision.add_metric([self.model_name], stats.get("vision_encodes", 0), stats.get("vision_seconds", 0.0))
        yield vision


def merge_expositions(parts: list[bytes]) -> bytes:
    """Several registries' text (one per model, api/model_router.py) as one exposition: each family's `# HELP` and
    `# TYPE` once, then every registry's samples of it (a family named twice is invalid to Prometheus)."""
    families: dict[str, list[bytes]] = {}
    current: list[bytes] | None = None
    for part in parts:
        earlier = set(families)  # families an earlier part opened: their header lines are there already
        for line in part.splitlines():
            if line.startswith(b"# HELP ") or line.startswith(b"# TYPE "):
                name = line.split(b" ", 3)[2].decode()
                current = families.setdefault(name, [])
                if name not in earlier:
                    current.append(line)
            elif line and current is not None:
                current.append(line)
    return b"".join(line + b"\n" for lines in families.values() for line in lines)
