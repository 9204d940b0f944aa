"""`oai-gemma serve` with faults a test switches on and off by creating and removing files (tests only).

    OAI_GEMMA_FAULT_KV_OOM=<path>      while <path> exists, the engine step's scheduling (where KV blocks are
                                       allocated) raises torch.OutOfMemoryError, as a KV allocation out of memory
                                       would: the engine thread dies
    OAI_GEMMA_FAULT_STORE_FULL=<path>  while <path> exists, the Responses store's SQLite file may not grow (SQLite's
                                       own "database or disk is full", as on a full disk)
    OAI_GEMMA_FAULT_STORE_READONLY=<path>  while <path> exists, the store refuses writes (SQLITE_READONLY)
    OAI_GEMMA_FAULT_HASH_COLLIDE=<path>  while <path> exists, every prefix-cache block hash is 0 (a crafted collision
                                       for every block)

Run as `python tests/fault_server.py serve ...` (conftest's `ServerProcess(..., launcher=FAULT_SERVER)`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def _switch(name: str):
    path = os.environ.get(name)
    return (lambda: os.path.exists(path)) if path else (lambda: False)


def install() -> None:
    import torch

    from oai_gemma.api.responses.store import ResponseStore
    from oai_gemma.engine import scheduler
    from oai_gemma.engine.scheduler import Scheduler

    kv_oom, full, readonly = _switch("OAI_GEMMA_FAULT_KV_OOM"), _switch("OAI_GEMMA_FAULT_STORE_FULL"), _switch("OAI_GEMMA_FAULT_STORE_READONLY")
    collide = _switch("OAI_GEMMA_FAULT_HASH_COLLIDE")
    schedule, connection, block_hashes = Scheduler.schedule, ResponseStore._connection, scheduler.block_hashes

    def colliding_hashes(keys, size, parent=None):
        return [0] * (len(keys) // size) if collide() else block_hashes(keys, size, parent)

    def faulty_schedule(self, now):
        if kv_oom():
            raise torch.OutOfMemoryError("injected: out of memory allocating KV blocks")
        return schedule(self, now)

    def faulty_connection(self):
        db = connection(self)
        pages = db.execute("PRAGMA page_count").fetchone()[0] if full() else 1073741823
        db.execute(f"PRAGMA max_page_count = {pages}")
        db.execute(f"PRAGMA query_only = {int(readonly())}")
        return db

    Scheduler.schedule, ResponseStore._connection, scheduler.block_hashes = faulty_schedule, faulty_connection, colliding_hashes


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    install()
    from oai_gemma.cli import main

    sys.exit(main())
