"""How long this replica's execute phases took, for layer 3's balance (design.md §4).

On CPU the host's clock is the compute's. On a GPU the host only enqueues kernels and runs
ahead: timing `execute()` on the host measures enqueueing (and whatever waits happened to block
it), not compute. There a span is a pair of CUDA events on the compute stream, read only once the
device has passed the end event (`query()`, never a synchronize): a span not finished when the
reduction reads the clock is reported at a later reduction. The balance's estimate is an
average over iterations, so one iteration of lag costs nothing.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class DeviceEvent(Protocol):
    """What a `torch.cuda.Event(enable_timing=True)` offers (tests pass fakes)."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end: Any) -> float: ...  # milliseconds


class Mark(Protocol):
    """A point in the compute's time."""

    def passed(self) -> bool:
        """The compute has reached it (host marks: always)."""

    def seconds_to(self, end: Any) -> float: ...


@dataclass
class HostMark:
    at: float  # time.perf_counter()

    def passed(self) -> bool:
        return True

    def seconds_to(self, end: HostMark) -> float:
        return end.at - self.at


@dataclass
class EventMark:
    event: DeviceEvent  # recorded on the current (compute) stream

    def passed(self) -> bool:
        return self.event.query()

    def seconds_to(self, end: EventMark) -> float:
        return self.event.elapsed_time(end.event) / 1000.0


@dataclass
class _Span:
    start: Mark
    end: Mark
    microbatches: int


def _cuda_event() -> DeviceEvent:
    return torch.cuda.Event(enable_timing=True)


class ExecuteClock:
    def __init__(self, device: torch.device,
                 make_event: Callable[[], DeviceEvent] = _cuda_event):
        self.on_device = device.type == "cuda"
        self._make_event = make_event
        self._open: Mark | None = None
        self._spans: deque[_Span] = deque()

    def _mark(self) -> Mark:
        if not self.on_device:
            return HostMark(time.perf_counter())
        event = self._make_event()
        event.record()  # on the current (compute) stream
        return EventMark(event)

    def start(self) -> None:
        self._open = self._mark()

    def stop(self, microbatches: int) -> None:
        """The execute phase that `start` opened ran `microbatches` microbatches."""
        if self._open is not None:
            self._spans.append(_Span(self._open, self._mark(), microbatches))
        self._open = None

    def take(self) -> tuple[float, int]:
        """Seconds and microbatches of the finished spans (oldest first), forgetting them."""
        seconds, count = 0.0, 0
        while self._spans:
            span = self._spans[0]
            if not span.end.passed():
                break  # the device is still on it: a later reduction reports it
            seconds += span.start.seconds_to(span.end)
            count += span.microbatches
            self._spans.popleft()
        return seconds, count
