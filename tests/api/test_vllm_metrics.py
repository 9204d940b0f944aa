"""vLLM's metric names on `/metrics` (server.metrics_vllm_names), as gateways and autoscalers made for vLLM read them."""

from conftest import MAX_MODEL_LEN, MODEL, user
from metrics_scrape import delta, scrape
from prometheus_client.parser import text_string_to_metric_families

VLLM_LABELS = {"engine": "0"}


def test_vllm_load_gauges_mirror_ours(base_url):
    after = scrape(base_url)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert after.value(f"vllm:{name}", **VLLM_LABELS) == after.value(f"oai_gemma:{name}")


def test_vllm_cache_config_info_tells_the_kv_capacity(http):
    text = http.get("/metrics").text
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "vllm:cache_config_info"]
    (sample,) = family.samples
    assert sample.value == 1
    assert int(sample.labels["block_size"]) == 16
    assert int(sample.labels["num_gpu_blocks"]) * 16 >= MAX_MODEL_LEN  # at least one sequence of the longest context
    assert sample.labels["enable_prefix_caching"] == "True"


def test_prefix_cache_counters_count_prompt_tokens_and_cached_tokens(base_url, client):
    messages = user("Write one sentence about prefix caches and lighthouses.")
    before = scrape(base_url)
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And one about harbours."},
    ]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    after = scrape(base_url)
    prompt = first.usage.prompt_tokens + second.usage.prompt_tokens
    cached = first.usage.prompt_tokens_details.cached_tokens + second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens // 16 * 16  # the second turn reused every full block of the first
    for prefix in ("vllm:", "oai_gemma:"):
        assert delta(before, after, prefix + "prefix_cache_queries_total") == prompt
        assert delta(before, after, prefix + "prefix_cache_hits_total") == cached
