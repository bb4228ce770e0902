"""NCCL: layer 3 reads compute time, not the host's enqueue time: on a GPU a span is timed by
CUDA events and read only once the device passed its end (fake events here: no GPU)."""
from __future__ import annotations

import time

import torch

from megatron.training.step.execute_clock import ExecuteClock


class FakeEvent:
    """A CUDA event on a fake device: `done` once the device passed it, at device time `at`."""
    device_time = 0.0

    def __init__(self):
        self.at, self.done = None, False

    def record(self) -> None:
        self.at = FakeEvent.device_time

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "FakeEvent") -> float:  # milliseconds, as torch's
        return (end.at - self.at) * 1000.0


def test_device_spans_are_read_from_events_and_only_when_finished():
    events: list[FakeEvent] = []

    def make() -> FakeEvent:
        events.append(FakeEvent())
        return events[-1]
    clock = ExecuteClock(torch.device("cuda", 0), make_event=make)
    FakeEvent.device_time = 10.0
    clock.start()
    time.sleep(0.01)  # host time passes; the device's does not matter to it
    FakeEvent.device_time = 10.5  # the device computed for 0.5 s
    clock.stop(4)
    assert clock.take() == (0.0, 0)  # the device has not reached the end event yet
    events[1].done = True
    seconds, count = clock.take()
    assert abs(seconds - 0.5) < 1e-9 and count == 4
    assert clock.take() == (0.0, 0)  # read once


def test_host_spans_on_cpu():
    clock = ExecuteClock(torch.device("cpu"))
    clock.start()
    time.sleep(0.02)
    clock.stop(3)
    clock.start()  # an execute that failed: never stopped, never counted
    seconds, count = clock.take()
    assert count == 3 and 0.02 <= seconds < 1.0
