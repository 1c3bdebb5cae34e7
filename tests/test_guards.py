"""The leak guard tests/conftest.py puts around every test (issue 13, item 6) can fail: a thread a
test leaves running is named, one that ends within the grace time is not, nor tqdm's shared monitor;
a process group left initialised is seen and destroyed (pure tier)."""

from __future__ import annotations

import threading

from helpers.guards import leaked_threads


def test_a_thread_left_running_is_named_and_one_that_ends_is_not():
    before = {t.ident for t in threading.enumerate()}
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="left-behind", daemon=True)
    t.start()
    try:
        assert leaked_threads(before, grace_s=0.1) == ["left-behind (Thread, daemon=True)"]
    finally:
        stop.set()
        t.join()
    assert leaked_threads(before, grace_s=0.1) == []
    quick = threading.Timer(0.05, lambda: None)          # ends inside the grace time: not a leak
    quick.start()
    assert leaked_threads(before, grace_s=2.0) == []


def test_shared_library_threads_are_not_leaks():
    before = {t.ident for t in threading.enumerate()}
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="tqdm_monitor", daemon=True)
    t.start()
    try:
        assert leaked_threads(before, grace_s=0.1) == []
    finally:
        stop.set()
        t.join()


def test_a_process_group_left_initialised_is_seen_and_destroyed():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from helpers.guards import left_process_group

    assert left_process_group() is False
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        assert left_process_group() is True          # what the conftest fails the test with
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert left_process_group() is False
