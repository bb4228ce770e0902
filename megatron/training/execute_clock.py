"""How long this replica's execute phases took, for layer 3's balance (DESIGN §4).

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

import torch


@dataclass
class _Span:
    start: object  # float (host seconds) or a recorded torch.cuda.Event
    end: object
    microbatches: int


def _cuda_event() -> object:
    return torch.cuda.Event(enable_timing=True)


class ExecuteClock:
    def __init__(self, device: torch.device, make_event: Callable[[], object] = _cuda_event):
        self.on_device = device.type == "cuda"
        self._make_event = make_event
        self._open: object | None = None
        self._spans: deque[_Span] = deque()

    def _mark(self) -> object:
        if not self.on_device:
            return time.perf_counter()
        event = self._make_event()
        event.record()  # on the current (compute) stream
        return event

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
            if self.on_device:
                if not span.end.query():
                    break  # the device is still on it: a later reduction reports it
                seconds += span.start.elapsed_time(span.end) / 1000.0
            else:
                seconds += span.end - span.start
            count += span.microbatches
            self._spans.popleft()
        return seconds, count
