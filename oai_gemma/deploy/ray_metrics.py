"""One `/metrics` for all engine replicas: each replica's own series with a `replica` label.

Every replica pushes its rendered `/metrics` text every `PUSH_PERIOD_S` seconds to one small named actor
(the hub); the ingress reads them all from it and relabels. A replica that stops pushing (it died) drops out
after a few periods, and the one Ray starts in its place appears under its own `replica` label, as a
Prometheus target that restarted would.

The hub also keeps the last `POST /models/load` or `/models/unload` order per model (several models, api/model_router.py):
the ingress sends such a request to one replica and, once it answered 200, leaves the order here; every replica
reads the orders when it pushes and carries out those it has not yet (a replica Ray starts later too), so a model is
loaded or unloaded on every replica within a push period or so (its own load's time added).
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("oai_gemma.ray")

PUSH_PERIOD_S = 2.0
STALE_AFTER_S = 3 * PUSH_PERIOD_S


@ray.remote(num_cpus=0)
class MetricsHub:
    def __init__(self) -> None:
        self.latest: dict[str, tuple[float, str]] = {}
        self.orders: dict[str, tuple[int, str]] = {}
        """Model id -> (the order's number, "load" or "unload"): its last order."""
        self.count = 0

    def order(self, model: str, action: str) -> None:
        self.count += 1
        self.orders[model] = (self.count, action)

    def get_orders(self) -> dict[str, tuple[int, str]]:
        return dict(self.orders)

    def put(self, replica: str, text: str) -> None:
        self.latest[replica] = (time.monotonic(), text)

    def forget(self, replica: str) -> None:
        self.latest.pop(replica, None)

    def get(self) -> dict[str, str]:
        now = time.monotonic()
        for replica in [r for r, (at, _) in self.latest.items() if now - at > STALE_AFTER_S]:
            del self.latest[replica]
        return {replica: text for replica, (_, text) in self.latest.items()}


def hub(app_name: str):
    """The app's hub, created by whoever asks first (it lives as long as the Ray cluster)."""
    return MetricsHub.options(
        name=f"oai-gemma-metrics:{app_name}", namespace="serve", get_if_exists=True, lifetime="detached"
    ).remote()


async def push_forever(app_name: str, replica: str, render, follow=None) -> None:
    """A replica's task: push `render()` (its `/metrics` bytes) to the hub until cancelled; and hand the model
    orders to `follow(orders)` each time."""
    target = None
    while True:
        try:
            target = target or hub(app_name)
            await target.put.remote(replica, render().decode())
            if follow is not None:
                follow(await target.get_orders.remote())
        except Exception as exc:  # noqa: BLE001 - the hub was killed (or not up yet): a new one next time
            log.warning("pushing metrics failed (%r); retrying", exc)
            target = None
        await asyncio.sleep(PUSH_PERIOD_S)


class _Merged:
    def __init__(self, texts: dict[str, str]):
        self.texts = texts

    def collect(self):
        families: dict[str, Metric] = {}
        for replica, text in sorted(self.texts.items()):
            for family in text_string_to_metric_families(text):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                for s in family.samples:
                    merged.add_sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
        yield from families.values()


def merge(texts: dict[str, str]) -> bytes:
    """Prometheus text of every replica's series, each with its `replica` label."""
    registry = CollectorRegistry()
    registry.register(_Merged(texts))
    return generate_latest(registry)
