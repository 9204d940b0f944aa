"""Stored responses (`store: true`), so that `previous_response_id` continues a conversation and
`GET /v1/responses/{id}` finds it again, also after a restart.

One SQLite file through the standard library's `sqlite3`. Every query runs on one worker thread that owns the
connection, never on the event loop (a disk write can stall for milliseconds). The store is bounded: rows older
than `max_age` seconds are never returned and are deleted, and beyond `max_responses` rows the oldest go, at each
write. Each row belongs to an owner (a hash of the API key that created it, "" on an open server): every read
and delete names the owner, so one key never sees another's responses (a 404, as for an unknown id).

Durability: WAL journal, `synchronous=NORMAL`. A write is committed before the response that caused it is sent
(`response.completed` comes after the commit), and a commit survives the process being killed at any moment (it is
in the WAL file, which the next open replays). On power loss or an OS crash the last commits before the crash may
be lost (they were not yet fsynced; a checkpoint fsyncs), but the file stays consistent. A write that fails (disk
full, read-only file) raises `StoreError`, is logged and counted (`on_error`), and leaves the store as it was: once
space returns, the next write succeeds.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("oai_gemma.store")

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created_at REAL NOT NULL,
    response BLOB NOT NULL,     -- the Response as the client got it (JSON)
    input_items BLOB NOT NULL   -- every input item of the conversation up to this response (JSON list)
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at);
"""


@dataclass(frozen=True)
class StoredResponse:
    response: bytes
    input_items: bytes


def owner_of(api_key: str | None) -> str:
    """The owner a key's responses are stored under: a hash, so the database never holds a key."""
    return hashlib.sha256(api_key.encode()).hexdigest() if api_key else ""


class StoreError(RuntimeError):
    """A response could not be stored (the disk is full, the file read-only, ...)."""


class ResponseStore:
    def __init__(self, path: str | Path, max_responses: int, max_age: float, on_error=lambda: None):
        """`on_error()`: called on each failed write (the metrics count them)."""
        self.path = str(path)
        self.max_responses = max_responses
        self.max_age = max_age
        self.on_error = on_error
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="oai-gemma-store")
        self._db: sqlite3.Connection | None = None

    # ---- the asyncio side ----------------------------------------------------------------------------

    async def put(self, owner: str, response_id: str, response: bytes, input_items: bytes) -> None:
        """Store a response (committed when this returns), or raise StoreError."""
        try:
            await self._run(self._put, owner, response_id, response, input_items)
        except (sqlite3.Error, OSError) as exc:
            log.error("storing response %s in %s failed: %s", response_id, self.path, exc)
            self.on_error()
            raise StoreError(f"the response could not be stored ({exc})") from exc

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        return await self._run(self._get, owner, response_id)

    async def delete(self, owner: str, response_id: str) -> bool:
        return await self._run(self._delete, owner, response_id)

    def close(self) -> None:
        self._thread.submit(self._close).result()
        self._thread.shutdown()

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    # ---- the store's thread --------------------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            if self.path != ":memory:":
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, isolation_level=None)  # autocommit; writes are single statements or BEGIN/COMMIT
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(SCHEMA)
            self._db = db
        return self._db

    def _oldest_allowed(self) -> float:
        return time.time() - self.max_age if self.max_age > 0 else float("-inf")

    def _put(self, owner: str, response_id: str, response: bytes, input_items: bytes) -> None:
        db = self._connection()
        db.execute("BEGIN")
        try:
            db.execute(
                "INSERT OR REPLACE INTO responses (id, owner, created_at, response, input_items) VALUES (?, ?, ?, ?, ?)",
                (response_id, owner, time.time(), response, input_items),
            )
            db.execute("DELETE FROM responses WHERE created_at < ?", (self._oldest_allowed(),))
            db.execute(
                "DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY created_at DESC LIMIT -1 OFFSET ?)",
                (self.max_responses,),
            )
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:  # SQLite rolls back by itself on some errors (a full disk)
                db.execute("ROLLBACK")
            raise

    def _get(self, owner: str, response_id: str) -> StoredResponse | None:
        row = self._connection().execute(
            "SELECT response, input_items FROM responses WHERE id = ? AND owner = ? AND created_at >= ?",
            (response_id, owner, self._oldest_allowed()),
        ).fetchone()
        return StoredResponse(row[0], row[1]) if row else None

    def _delete(self, owner: str, response_id: str) -> bool:
        cursor = self._connection().execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner))
        return cursor.rowcount > 0

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
