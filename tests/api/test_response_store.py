"""The SQLite store behind `/v1/responses`, without a server: bounds, owners, a reopened file."""

import asyncio

from oai_gemma.api.responses.store import ResponseStore, owner_of


def run(coro):
    return asyncio.run(coro)


def test_a_reopened_file_still_holds_its_responses(tmp_path):
    path = tmp_path / "store" / "responses.sqlite3"
    store = ResponseStore(path, max_responses=10, max_age=3600)
    run(store.put("", "resp_1", b'{"id":"resp_1"}', b"[]"))
    store.close()
    reopened = ResponseStore(path, max_responses=10, max_age=3600)
    stored = run(reopened.get("", "resp_1"))
    assert stored.response == b'{"id":"resp_1"}' and stored.input_items == b"[]"
    reopened.close()


def test_beyond_the_count_the_oldest_go(tmp_path):
    store = ResponseStore(tmp_path / "r.sqlite3", max_responses=3, max_age=0)

    async def main():
        for i in range(5):
            await store.put("", f"resp_{i}", b"{}", b"[]")
        return [await store.get("", f"resp_{i}") is not None for i in range(5)]

    assert run(main()) == [False, False, True, True, True]
    store.close()


def test_past_the_age_a_response_is_neither_returned_nor_kept(tmp_path, monkeypatch):
    import oai_gemma.api.responses.store as module

    now = [1_000_000.0]
    monkeypatch.setattr(module.time, "time", lambda: now[0])
    store = ResponseStore(tmp_path / "r.sqlite3", max_responses=100, max_age=60)
    run(store.put("", "old", b"{}", b"[]"))
    now[0] += 61
    assert run(store.get("", "old")) is None
    run(store.put("", "new", b"{}", b"[]"))  # a write deletes what aged out
    count = store._thread.submit(lambda: store._connection().execute("SELECT COUNT(*) FROM responses").fetchone()[0]).result()
    assert count == 1
    store.close()


def test_an_owner_never_reads_or_deletes_another_owners_response(tmp_path):
    a, b = owner_of("key-a"), owner_of("key-b")
    assert a != b and "key-a" not in a
    store = ResponseStore(tmp_path / "r.sqlite3", max_responses=10, max_age=0)
    run(store.put(a, "resp_1", b"{}", b"[]"))
    assert run(store.get(b, "resp_1")) is None
    assert run(store.delete(b, "resp_1")) is False
    assert run(store.get(a, "resp_1")) is not None
    assert run(store.delete(a, "resp_1")) is True
    assert run(store.get(a, "resp_1")) is None
    store.close()
