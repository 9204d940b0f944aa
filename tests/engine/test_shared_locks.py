"""engine/model/shared.py's per-key locks: two callers of one key build once, and no lock outlives its callers
(a server that loads models of many tokenizer contents over its life keeps none of their locks)."""

from __future__ import annotations

import threading
import time

from oai_gemma.engine.model import shared


class Built:
    """A weak-referenceable built object."""


def test_two_callers_of_one_key_build_once_and_leave_no_lock_behind():
    builds, results, started = [], [], threading.Event()

    def build():
        builds.append(1)
        started.set()
        time.sleep(0.05)  # the second caller arrives while this one builds (no timing asserted)
        return kept

    kept = Built()
    first = threading.Thread(target=lambda: results.append(shared.shared(("test", "locks"), build)))
    first.start()
    started.wait()
    results.append(shared.shared(("test", "locks"), build))
    first.join()
    assert len(builds) == 1 and results == [kept, kept]
    assert ("test", "locks") not in shared._locks


def test_a_build_that_fails_leaves_no_lock_either():
    def fail():
        raise RuntimeError("no")

    try:
        shared.shared(("test", "fails"), fail)
    except RuntimeError:
        pass
    assert ("test", "fails") not in shared._locks
