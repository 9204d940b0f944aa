"""vLLM's own metric names beside ours (`server.metrics_vllm_names`), so tools written for a vLLM backend read
this server unmodified: the Gateway API Inference Extension's endpoint picker, llm-d, KEDA recipes, vLLM's
production stack. They read the load gauges, `vllm:cache_config_info` and the prefix-cache counters.

The KV cache here is one slot of `max_model_len` tokens per sequence, not vLLM's paged blocks: the cache
config reports it as `num_gpu_blocks` = slots of `block_size` = `max_model_len` tokens, so blocks x size is
the true token capacity. Prefix-cache counters count prompt tokens looked up and found (a reused slot's
`cached_tokens`), as vLLM counts them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

VLLM = "vllm:"


class PrefixCacheCounts:
    """Prompt tokens of admitted requests (queries) and those served from the cache (hits)."""

    def __init__(self) -> None:
        self.queries = 0
        self.hits = 0

    def count(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.queries += prompt_tokens
        self.hits += cached_tokens


class PrefixCacheCollector:
    """`<prefix>prefix_cache_queries_total` and `<prefix>prefix_cache_hits_total`, in tokens."""

    def __init__(self, prefix: str, model_name: str, counts: PrefixCacheCounts):
        self.prefix, self.model_name, self.counts = prefix, model_name, counts

    def collect(self):
        for name, doc, value in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", self.counts.queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache (cached_tokens).", self.counts.hits),
        ):
            counter = CounterMetricFamily(self.prefix + name, doc, labels=["model_name"])
            counter.add_metric([self.model_name], value)
            yield counter


class VllmLoadCollector:
    """vLLM's load gauges and cache config, read from the engine at scrape time (`engine="0"`, as vLLM's V1)."""

    def __init__(self, model_name: str, load: Callable[[], dict | None], cache_config: Callable[[], dict | None]):
        self.model_name, self.load, self.cache_config = model_name, load, cache_config

    def collect(self):
        load = self.load() or {}
        labels, values = ["model_name", "engine"], [self.model_name, "0"]
        for name, doc, key in (
            ("num_requests_running", "Number of requests in model execution batches.", "running"),
            ("num_requests_waiting", "Number of requests waiting to be processed.", "waiting"),
            ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"),
            ("gpu_cache_usage_perc", "KV-cache usage (vLLM's older name). 1 means 100 percent usage.", "kv_cache_usage"),
        ):
            gauge = GaugeMetricFamily(VLLM + name, doc, labels=labels)
            gauge.add_metric(values, load.get(key, 0))
            yield gauge
        config = self.cache_config()
        if config:
            info = GaugeMetricFamily(VLLM + "cache_config_info", "Information of the LLMEngine CacheConfig", labels=sorted(config))
            info.add_metric([str(config[k]) for k in sorted(config)], 1)
            yield info


class LoraInfoCollector:
    """`<prefix>lora_requests_info` as vLLM's (v1 PrometheusStatLogger): one series whose labels carry the adapters of
    running and waiting requests (comma-joined names) and `max_lora`, its value the scrape time; nothing while
    adapters are off. Gateways (the Inference Extension's endpoint picker) route by those labels."""

    def __init__(self, prefix: str, lora_stats: Callable[[], dict | None]):
        self.prefix, self.lora_stats = prefix, lora_stats

    def collect(self):
        stats = self.lora_stats()
        if not stats:
            return
        labels = {"max_lora": str(stats["max_lora"]), "running_lora_adapters": ",".join(stats["running"]),
                  "waiting_lora_adapters": ",".join(stats["waiting"])}
        gauge = GaugeMetricFamily(self.prefix + "lora_requests_info", "Running stats on lora requests.", labels=sorted(labels))
        gauge.add_metric([labels[k] for k in sorted(labels)], time.time())
        yield gauge
class SpecDecodeCollector:
    """Speculative decoding's counters as vLLM names them (`<prefix>spec_decode_num_drafts_total`, ...), read from
    the engine's stats at scrape time: drafts verified, draft tokens, accepted tokens, and accepted tokens by their
    position in the draft (`position` label, 0 first)."""

    def __init__(self, prefix: str, model_name: str, stats: Callable[[], dict | None]):
        self.prefix, self.model_name, self.stats = prefix, model_name, stats

    def collect(self):
        stats = self.stats() or {}
        labels, values = ["model_name", "engine"], [self.model_name, "0"]
        for name, doc, key in (
            ("spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_num_drafts"),
            ("spec_decode_num_draft_tokens", "Number of draft tokens.", "spec_num_draft_tokens"),
            ("spec_decode_num_accepted_tokens", "Number of accepted tokens.", "spec_num_accepted_tokens"),
        ):
            counter = CounterMetricFamily(self.prefix + name, doc, labels=labels)
            counter.add_metric(values, stats.get(key, 0))
            yield counter
        per_pos = CounterMetricFamily(
            self.prefix + "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.", labels=[*labels, "position"],
        )
        for position, count in enumerate(stats.get("spec_accepted_per_pos", ())):
            per_pos.add_metric([*values, str(position)], count)
        yield per_pos
