"""An etcd cluster reached through any of its members (no single point of failure).

etcd's v3 API through its JSON gateway (`/v3/kv/...`, served by every etcd >= 3.4 on the client
port), with OpenStack's `etcd3gw` client. Why that client: it is maintained (OpenStack ships it),
pure Python over `requests`, and speaks the v3 API that leases and transactions need; the gRPC
client `etcd3` is unmaintained and breaks with current protobuf, and torchelastic's `python-etcd`
speaks only the removed v2 API.

`EtcdCluster` keeps one client per endpoint (`--rdzv-endpoint h1:2379,h2:2379,h3:2379`, torchrun's
flag) and sends each operation to the member that answered last; a member that does not answer
within `timeout` costs that much once, then the next is tried. etcd's own Raft keeps the data
consistent across members: any member answers a linearizable read or a write while a majority
lives, so which member a client reaches changes nothing but latency.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import ConnectionFailedError, ConnectionTimeoutError, Etcd3Exception

T = TypeVar("T")
DEFAULT_PORT = 2379


class EndpointError(ValueError):
    """A malformed --rdzv-endpoint (the message names the flag and the fix)."""


def parse_endpoints(spec: str) -> list[tuple[str, int]]:
    """`h1:2379,h2,h3:2380` -> [(h1, 2379), (h2, 2379), (h3, 2380)], or EndpointError."""
    endpoints = []
    for item in (part.strip() for part in spec.split(",")):
        host, _, port = item.rpartition(":") if ":" in item else (item, "", str(DEFAULT_PORT))
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise EndpointError(f"--rdzv-endpoint {spec!r}: {item!r} is not host[:port]; pass "
                                f"the etcd members' client addresses, e.g. h1:2379,h2:2379,h3:2379")
        endpoints.append((host, int(port)))
    if len(set(endpoints)) != len(endpoints):
        raise EndpointError(f"--rdzv-endpoint {spec!r} names a member twice; name each once")
    return endpoints


class ClusterUnreachable(RuntimeError):
    """No member of the etcd cluster answered (or none with a majority behind it)."""


class EtcdCluster:
    def __init__(self, endpoints: Sequence[tuple[str, int]], timeout: float = 2.0,
                 make_client: Callable[[str, int, float], Etcd3Client] | None = None,
                 first: int = 0):
        make = make_client or (lambda host, port, t: Etcd3Client(host=host, port=port, timeout=t))
        self.endpoints = list(endpoints)
        self._clients = [make(host, port, timeout) for host, port in self.endpoints]
        self._current = first  # the member that answered last: tried first
        self.answered_at = time.monotonic()  # when a member with a majority last answered
        self._lock = threading.Lock()

    @property
    def current(self) -> tuple[str, int]:
        return self.endpoints[self._current]

    @property
    def current_index(self) -> int:
        """For a client made elsewhere (a forked coordinator's) to start where this one is."""
        return self._current

    def call(self, operation: Callable[[Etcd3Client], T]) -> T:
        """`operation` on the member that answered last, else on each other in turn; a member
        without quorum answers with an error (etcd refuses rather than serve stale data) and is
        passed over like a dead one."""
        with self._lock:
            first = self._current
        errors = []
        for step in range(len(self._clients)):
            index = (first + step) % len(self._clients)
            try:
                result = operation(self._clients[index])
            except (ConnectionFailedError, ConnectionTimeoutError, Etcd3Exception) as e:
                errors.append(f"{self.endpoints[index][0]}:{self.endpoints[index][1]}: "
                              f"{type(e).__name__}")
                continue
            with self._lock:
                self._current = index
            self.answered_at = time.monotonic()
            return result
        raise ClusterUnreachable("no etcd member answered: " + "; ".join(errors))
