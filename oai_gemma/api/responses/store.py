"""Stored responses (`store: true`), so that `previous_response_id` continues a conversation and
`GET /v1/responses/{id}` finds it again, also after a restart.

One SQLite file through the standard library's `sqlite3`. Every query runs on one worker thread that owns the
connection, never on the event loop (a disk write can stall for milliseconds). The store is bounded: rows older
than `max_age` seconds are never returned and are deleted, and beyond `max_responses` rows the oldest go, at each
write. Each row belongs to an owner (a hash of the API key that created it, "" on an open server): every read
and delete names the owner, so one key never sees another's responses (a 404, as for an unknown id).
"""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

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


class ResponseStore:
    def __init__(self, path: str | Path, max_responses: int, max_age: float):
        self.path = str(path)
        self.max_responses = max_responses
        self.max_age = max_age
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="oai-gemma-store")
        self._db: sqlite3.Connection | None = None

    # ---- the asyncio side ----------------------------------------------------------------------------

    async def put(self, owner: str, response_id: str, response: bytes, input_items: bytes) -> None:
        await self._run(self._put, owner, response_id, response, input_items)

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
