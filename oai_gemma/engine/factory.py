"""`load_engine(settings)`: the model loaded, the engine built from the settings and warmed up, ready to start."""

from __future__ import annotations

import logging
import time

from ..settings import Settings
from .engine import Engine
from .loader import load

log = logging.getLogger("oai_gemma.engine")


def load_engine(settings: Settings) -> Engine:
    """Everything start-up does before the server may say it is ready (seconds: run it off the event loop)."""
    started = time.monotonic()
    loaded = load(settings.model)
    loaded_at = time.monotonic()
    engine = Engine.from_settings(loaded, settings)
    built_at = time.monotonic()
    engine.warm_up()
    log.info(
        "start-up phases: load %.1f s, engine (weights re-laid out, KV cache) %.1f s, warm-up %.1f s",
        loaded_at - started, built_at - loaded_at, time.monotonic() - built_at,
    )
    return engine
