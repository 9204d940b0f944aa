"""LoRA adapters through the real server process and the real openai client: `--lora-modules` (both of vLLM's forms),
`--max-loras` eviction and reload, `model: "<adapter>"` in chat, completions, Responses and /tokenize, /v1/models,
the prefix cache per adapter, the load/unload endpoints behind an admin key, an adapter trained here that visibly
changes the answers, and the metrics; an evicted adapter read again off the engine thread (streams go on, the idle
engine sleeps meanwhile), and loads and unloads from many clients at once. One server for the module (float32,
unquantized, as the other servers)."""

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import openai
import pytest
import torch

from conftest import MODEL, ServerProcess, user
from lora_adapters import FORMAT_PREFIX, STRONG, greedy, make_adapter, merged_model, train_format_adapter
from metrics_scrape import scrape

pytestmark = pytest.mark.slow

USER, ADMIN = "user-key", "admin-key"
PROMPT = user("Write a short poem about the sea.")


@pytest.fixture(scope="module")
def base():
    from transformers import AutoModelForCausalLM

    from oai_gemma.engine.model.loader import embedded_model_dir

    return AutoModelForCausalLM.from_pretrained(embedded_model_dir(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def paths(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    return {name: make_adapter(base, root / name, spec) for name, spec in STRONG.items()}


@pytest.fixture(scope="module")
def server(paths, tmp_path_factory):
    a, b, c = paths.values()
    with ServerProcess(
        "--lora-modules", f"all8={a}", f"qv4={b}", "--lora-modules", f'{{"name": "mlp16", "path": "{c}", "base_model_name": "{MODEL}"}}',
        "--max-loras", "2", "--lora-runtime-loading", "--api-key", USER, "--admin-api-key", ADMIN,
        log=tmp_path_factory.mktemp("lora-log") / "server.log",
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=USER, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300, headers={"Authorization": f"Bearer {ADMIN}"}) as c:
        yield c


def chat(client, model: str, messages=PROMPT, max_tokens: int = 12, **kw):
    return client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0, **kw)


def test_models_lists_each_adapter_with_the_base_as_parent(client):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL, "all8", "qv4", "mlp16"}
    assert all(cards[name].model_extra["parent"] == MODEL for name in ("all8", "qv4", "mlp16"))
    assert client.models.retrieve("qv4").id == "qv4"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_chat_under_an_adapter_gives_pefts_merged_models_greedy_text(client, http, base, paths, tokenizer):
    ids = http.post("/tokenize", json={"model": "all8", "messages": PROMPT, "add_generation_prompt": True}).json()["tokens"]
    response = chat(client, "all8")
    eos = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")}
    expected = greedy(merged_model(base, paths["all8"]), ids, 12, eos)  # PEFT's merged model, greedy
    assert response.model == "all8"
    assert response.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert chat(client, MODEL).choices[0].message.content != response.choices[0].message.content


def test_completions_responses_and_tokenize_take_the_adapter_name(client, http):
    base = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=10, temperature=0).choices[0].text
    adapted = client.completions.create(model="qv4", prompt="The sea is", max_tokens=10, temperature=0)
    assert adapted.model == "qv4" and adapted.choices[0].text != base
    response = client.responses.create(model="mlp16", input="Say hello.", max_output_tokens=8, temperature=0)
    assert response.status in ("completed", "incomplete") and response.model == "mlp16" and response.output_text
    assert http.post("/tokenize", json={"model": "qv4", "prompt": "hi"}).status_code == 200


def test_an_unknown_model_is_a_404_model_not_found(client, http):
    with pytest.raises(openai.NotFoundError) as missing:
        chat(client, "no-such-adapter")
    assert missing.value.code == "model_not_found"
    assert http.post("/tokenize", json={"model": "no-such-adapter", "prompt": "hi"}).status_code == 404


def test_the_prefix_cache_never_shares_kv_between_adapters(client):
    messages = user("Here is a long context to cache. " + "The quick brown fox jumps over the lazy dog. " * 8 + "Summarise it.")

    def cached(model: str) -> int:
        return chat(client, model, messages, max_tokens=2).usage.prompt_tokens_details.cached_tokens

    first = cached("all8")
    assert cached("all8") > first  # the same adapter: its own prefix is reused
    assert cached("qv4") == 0  # the same prompt under another adapter: nothing shared
    assert cached(MODEL) == 0


def test_more_adapters_than_slots_are_evicted_and_read_again_answering_the_same(client, server):
    first = {name: chat(client, name).choices[0].message.content for name in ("all8", "qv4", "mlp16")}
    again = {name: chat(client, name).choices[0].message.content for name in ("mlp16", "all8", "qv4")}
    assert again == first and len(set(first.values())) == 3
    health = httpx.get(server.url + "/health").json()
    adapters = {a["name"]: a for a in health["lora_adapters"]}
    assert set(adapters) == {"all8", "qv4", "mlp16"} and sum(a["resident"] for a in adapters.values()) <= 2
    assert "reading it again" in server.log_path.read_text()


def test_loading_bad_adapters_is_a_400_and_needs_an_admin_key(client, http, server, tmp_path):
    as_user = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)},
                         headers={"Authorization": f"Bearer {USER}"})
    assert as_user.status_code == 403
    (tmp_path / "adapter_config.json").write_text("{not json")
    for body, reason in [
        ({"lora_name": "x", "lora_path": str(tmp_path / "missing")}, "no adapter directory"),
        ({"lora_name": "x", "lora_path": str(tmp_path)}, "adapter_config.json cannot be read"),
        ({"lora_name": "all8", "lora_path": str(tmp_path)}, "already been loaded"),
        ({"lora_name": "x"}, "lora_path"),
    ]:
        refused = http.post("/v1/load_lora_adapter", json=body)
        assert refused.status_code == 400 and reason in refused.json()["error"]["message"], refused.text
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "never-loaded"}).status_code == 404
    assert chat(client, "all8").choices[0].message.content  # the server serves on


def test_an_adapter_trained_here_answers_in_its_format_once_loaded_at_run_time(client, http, base, tokenizer, tmp_path):
    path = train_format_adapter(base, tokenizer, tmp_path / "pirate")
    loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "pirate", "lora_path": str(path)})
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'pirate' added successfully."
    messages = user("What is your favourite colour?")  # not one of the training questions
    answer = chat(client, "pirate", messages, max_tokens=10).choices[0].message.content
    assert answer.startswith(FORMAT_PREFIX.strip()), answer
    assert not chat(client, MODEL, messages, max_tokens=10).choices[0].message.content.startswith("Ahoy")


def test_unloading_lets_requests_in_flight_finish_and_refuses_new_ones(client, http, paths):
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "tmp", "lora_path": str(paths["all8"])}).status_code == 200
    expected = chat(client, "tmp", max_tokens=40, extra_body={"ignore_eos": True}).choices[0].message.content
    stream = client.chat.completions.create(
        model="tmp", messages=PROMPT, max_tokens=40, temperature=0, stream=True, extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    text = "".join(c.choices[0].delta.content or "" for c in [next(chunks), next(chunks)])
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "tmp"}).status_code == 200  # mid-stream
    finish = None
    for chunk in chunks:
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "length" and text == expected
    with pytest.raises(openai.NotFoundError):
        chat(client, "tmp")
    assert "tmp" not in {m.id for m in client.models.list().data}


def test_metrics_carry_vllms_lora_info_and_requests_per_adapter(server, client):
    chat(client, "qv4", max_tokens=2)
    metrics = scrape(server.url, headers={"Authorization": f"Bearer {USER}"})
    info = [labels for (name, labels) in metrics.samples if name == "vllm:lora_requests_info"]
    assert len(info) == 1 and dict(info[0])["max_lora"] == "2"
    assert set(dict(info[0])) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
    assert metrics.value("oai_gemma:lora_requests_total", lora_name="qv4") >= 2


def test_structured_output_and_tools_work_under_an_adapter(client):
    import json

    schema = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"], "additionalProperties": False}
    answer = chat(client, "all8", user("Name a colour as JSON."), max_tokens=24,
                  response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    assert set(json.loads(answer.choices[0].message.content)) == {"colour"}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    called = chat(client, "qv4", user("What is the weather in Paris?"), max_tokens=32, tools=[tool],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert called.choices[0].message.tool_calls[0].function.name == "get_weather"


@pytest.fixture(scope="module")
def held(http, client, tmp_path_factory):
    """An adapter (`HELD`) loaded and used once, whose next read from disk waits until the test lets it go on (`hold`)."""
    from oai_gemma.bench.lora import make_adapter
    from oai_gemma.engine.model.loader import embedded_model_dir

    path = make_adapter(tmp_path_factory.mktemp("held") / HELD, str(embedded_model_dir()), rank=8, seed=7)
    assert http.post("/v1/load_lora_adapter", json={"lora_name": HELD, "lora_path": str(path)}).status_code == 200
    chat(client, HELD, max_tokens=1)
    return path


HELD = "held"


@contextmanager
def hold(path):
    """Within the block, a read of the adapter's weights waits (the file is a FIFO no one writes yet); at its end the
    reader gets the very same bytes, and the file is a file again."""
    weights = path / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.unlink()
    os.mkfifo(weights)
    try:
        yield
    finally:
        writer = threading.Thread(target=weights.write_bytes, args=(data,), daemon=True)  # opens once a reader has
        writer.start()
        writer.join(120)
        weights.unlink()
        weights.write_bytes(data)


def evict(client, server, name: str = HELD) -> None:
    for other in ("all8", "qv4"):  # two slots: `name`, the least recently used, is dropped
        chat(client, other, max_tokens=1)
    assert not {a["name"]: a for a in health(server)["lora_adapters"]}[name]["resident"]


def health(server) -> dict:
    return httpx.get(server.url + "/health").json()


def reads(server, name: str = HELD) -> int:
    return server.log_path.read_text().count(f"LoRA adapter '{name}': reading it again")


def wait_for(condition, timeout: float = 120) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_an_evicted_adapter_is_read_again_while_other_streams_go_on(client, server, held):
    evict(client, server)
    stream = client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=1500, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    arrivals, stop = [], threading.Event()

    def consume():
        for _ in stream:
            arrivals.append(time.monotonic())
            if stop.is_set():
                break

    consumer = threading.Thread(target=consume)
    consumer.start()
    before = reads(server)
    with ThreadPoolExecutor(1) as pool, hold(held):
        assert wait_for(lambda: len(arrivals) >= 2)  # streaming
        answer = pool.submit(chat, client, HELD, max_tokens=1)
        assert wait_for(lambda: reads(server) == before + 1)  # its read has begun, and waits for the file
        during = len(arrivals)
        wait_for(lambda: len(arrivals) >= during + 3)
        during = len(arrivals) - during  # read on the engine thread: none
    assert answer.result().choices[0].finish_reason == "length"
    stop.set()
    consumer.join()
    stream.close()
    assert during >= 3, f"{during} tokens of the stream arrived while the adapter's read was held"


def test_a_request_parked_on_an_adapters_read_leaves_the_idle_engine_asleep(client, server, held):
    evict(client, server)
    before = reads(server)
    with ThreadPoolExecutor(1) as pool, hold(held):
        answer = pool.submit(chat, client, HELD, max_tokens=1)
        assert wait_for(lambda: reads(server) == before + 1 and health(server)["waiting"] == 1)  # parked on its read
        turns = health(server)["loop_turns"]
        time.sleep(1)
        turns = health(server)["loop_turns"] - turns  # a loop that polled while it waited: thousands in a second
    assert answer.result().choices[0].finish_reason == "length"
    assert turns < 5


def test_loads_and_unloads_from_many_clients_leave_one_registration_per_name_and_every_slot(client, http, server, paths):
    names = [f"many{i}" for i in range(6)]

    def load(name: str) -> int:
        return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(paths["qv4-rs"])}).status_code

    def unload(name: str) -> int:
        return http.post("/v1/unload_lora_adapter", json={"lora_name": name}).status_code

    def use(name: str) -> str:
        try:
            # ignore_eos: served means "length" whatever the adapter's first token (a stop token ends it otherwise)
            return chat(client, name, max_tokens=1, extra_body={"ignore_eos": True}).choices[0].finish_reason
        except openai.NotFoundError:  # unloaded before the route saw it, or after it and before the engine did
            return "gone"

    with ThreadPoolExecutor(16) as pool:
        loads = list(pool.map(load, names * 3))
        jobs = [pool.submit(unload, name) for name in names[:3] * 3] + [pool.submit(use, name) for name in names]
        unloads, uses = [job.result() for job in jobs[:9]], [job.result() for job in jobs[9:]]
    assert all(sorted(loads[i::6]) == [200, 400, 400] for i in range(6)), loads  # one load of each name wins
    assert all(sorted(unloads[i::3]) == [200, 404, 404] for i in range(3)), unloads  # one unload of each wins
    assert uses[3:] == ["length"] * 3 and set(uses[:3]) <= {"length", "gone"}
    adapters = health(server)["lora_adapters"]
    assert sorted(a["name"] for a in adapters if a["name"].startswith("many")) == names[3:]
    slots = [a["slot"] for a in adapters if a["resident"]]
    assert len(slots) == len(set(slots)) and set(slots) <= {1, 2}
    # both slots still there: two adapters stream at once, each in its own slot
    streams = [client.chat.completions.create(model=name, messages=PROMPT, max_tokens=200, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True}) for name in names[3:5]]
    for chunks in map(iter, streams):
        next(chunks), next(chunks)
    resident = {a["name"]: a["slot"] for a in health(server)["lora_adapters"] if a["resident"]}
    for stream in streams:
        stream.close()
    assert {resident.get(name) for name in names[3:5]} == {1, 2}
