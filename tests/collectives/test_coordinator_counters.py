"""An idle coordinator's tick: one request to the store for both counters it polls.

The coordinator ticks every 20 ms for the whole job; each request costs it, and the store
server, CPU that a failure-free iteration competes for on a loaded host (the ranks' own cores).
"""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from recover_patches.collectives import protocol as P
from recover_patches.collectives.coordinator import Coordinator, CoordinatorConfig, start_server

TOKEN = "counted-job"
pytestmark = pytest.mark.timeout(30)


class RequestCountingStore(dist.Store):
    """A TCPStore seen through a Python store that counts the requests made of it."""

    def __init__(self, inner: dist.TCPStore) -> None:
        super().__init__()
        self.inner, self.requests = inner, 0

    def _count(self, result):
        self.requests += 1
        return result

    def set(self, key, value):
        return self._count(self.inner.set(key, value))

    def get(self, key):
        return self._count(self.inner.get(key))

    def add(self, key, amount):
        return self._count(self.inner.add(key, amount))

    def check(self, keys):
        return self._count(self.inner.check(keys))

    def compare_set(self, key, expected, desired):
        return self._count(self.inner.compare_set(key, expected, desired))

    def multi_get(self, keys):
        return self._count(self.inner.multi_get(keys))

    def delete_key(self, key):
        return self._count(self.inner.delete_key(key))

    def wait(self, keys, timeout: timedelta | None = None):
        return self._count(self.inner.wait(keys) if timeout is None else
                           self.inner.wait(keys, timeout))


def test_the_job_key_is_where_the_prefix_store_puts_it():
    server = start_server("127.0.0.1", 0)
    dist.PrefixStore(P.job_prefix(TOKEN), server).add(P.REPORTS_COUNT, 3)
    assert server.get(P.job_key(TOKEN, P.REPORTS_COUNT)) == b"3"


def test_an_idle_tick_makes_one_request():
    counted = RequestCountingStore(start_server("127.0.0.1", 0))
    coordinator = Coordinator(counted, CoordinatorConfig(world_size=2, token=TOKEN))
    coordinator.tick()  # anything left of the set-up
    before = counted.requests
    for _ in range(5):
        coordinator.tick()
    assert counted.requests - before == 5


def test_a_report_counted_between_ticks_is_read_at_the_next():
    server = start_server("127.0.0.1", 0)
    coordinator = Coordinator(server, CoordinatorConfig(world_size=2, token=TOKEN))
    coordinator.tick()
    P.post_report(dist.PrefixStore(P.job_prefix(TOKEN), server),
                  {"kind": "exit", "rank": 1, "code": -9})
    coordinator.tick()
    assert coordinator.state.epoch == 1 and coordinator.state.dead == {1}
