"""Read `/metrics` the way Prometheus does (tests only)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


class Scrape:
    def __init__(self, text: str):
        self.samples = {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def value(self, name: str, **labels: str) -> float:
        """The sample's value; every series carries `model_name`, so it is not repeated here."""
        labels.setdefault("model_name", "gemma-3-270m")
        return self.samples[(name, frozenset(labels.items()))]


def scrape(url: str, **kw) -> Scrape:
    response = httpx.get(url + "/metrics", **kw)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return Scrape(response.text)


def delta(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return after.value(name, **labels) - before.value(name, **labels)
