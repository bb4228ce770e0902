"""Where a rank is, as its heartbeat says it: a counter that moves with every mark, the epoch,
iteration and step of the last one. The coordinator tells a rank that is alive but stuck (its
beats go on, its marks do not) from one that waits (`liveness.py`)."""
from __future__ import annotations


class ProgressMarks:
    def __init__(self) -> None:
        self._marks, self._iteration = 0, 0
        self._where: tuple[int, str, int | None] = (0, "start", None)
        self._starting = True  # until an iteration committed: start-up's longer bound applies

    def settle(self) -> None:
        self._starting = False

    def mark(self, epoch: int, where: str, iteration: int | None, microbatch: int | None) -> None:
        self._marks += 1
        if iteration is not None:
            self._iteration = iteration
        self._where = (epoch, where, microbatch)

    def line(self) -> str:
        """The heartbeat's text: it changes with every mark, only."""
        epoch, where, microbatch = self._where
        return (f"{self._marks} e{epoch} it{self._iteration} {where}"
                + ("" if microbatch is None else f" mb{microbatch}")
                + (f" {STARTING}" if self._starting else ""))


STARTING = "starting"  # the last word of a heartbeat's progress during start-up (`liveness.py`)
