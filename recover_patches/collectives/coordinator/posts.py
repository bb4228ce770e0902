"""Numbered posts the coordinator reads in order: registrations and reports.

A client posts in two writes: it takes a number (an `add` on the count), then writes its post
under that number. The coordinator reads the numbers in order, each once. A client killed or cut
off between its two writes leaves a number with no post, and reading in order then waited for
it forever: no registration or report after it was ever read. So a number still empty `gap`
seconds after the coordinator first looked for it is passed over, and kept aside: if its post
comes later after all (a client slower than `gap` between two writes), it is read then, out of
order (registrations and reports each carry all they need). One kept aside longer than
`KEPT_FOR` gaps is forgotten.
"""
from __future__ import annotations

import time
from collections.abc import Callable

KEPT_FOR = 10  # gaps a passed-over number is still looked for


class NumberedPosts:
    def __init__(self, gap: float, clock: Callable[[], float] = time.monotonic):
        self.gap = gap  # seconds an empty number holds up the ones after it
        self.next = 1  # the first number not read yet
        self._clock = clock
        self._empty_since: float | None = None  # when `next` was first found empty
        self._passed_over: dict[int, float] = {}  # number -> when it was passed over

    def ready(self, count: int, present: Callable[[int], bool]) -> list[int]:
        """The numbers whose posts to read now, in order: late ones first, then from `next`
        up to `count` (the numbers taken so far) until an empty one that may still come."""
        now = self._clock()
        found = [n for n in list(self._passed_over) if present(n)]
        for n in found:
            del self._passed_over[n]
        for n, when in list(self._passed_over.items()):
            if now - when > KEPT_FOR * self.gap:
                del self._passed_over[n]
        while self.next <= count:
            if present(self.next):
                found.append(self.next)
            else:
                if self._empty_since is None:
                    self._empty_since = now
                if now - self._empty_since < self.gap:
                    break
                self._passed_over[self.next] = now  # its poster died between its writes
            self.next += 1
            self._empty_since = None
        return found
