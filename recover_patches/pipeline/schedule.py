"""1F1B pipeline schedule over an arbitrary list of global microbatch ids.

The list may be empty or shorter than the pipeline (a replica's quota after re-planning can be
anything), with one model chunk per rank (`run_1f1b`) or several (`run_interleaved`, the order from
`recover_patches.pipeline.interleaved`); gradients accumulate into `.grad` and stay local -- reduction is the caller's business.
What one forward/backward *means* lives in `recover_patches.pipeline.stage`; this module only orders them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from recover_patches.collectives import NO_PROBE, Probe
from recover_patches.pipeline.interleaved import Kind, best_group, interleaved_orders
from recover_patches.pipeline.p2p import StageLink


class Stage(Protocol):
    def forward(self, microbatch_id: int, input_tensor: torch.Tensor | None) -> torch.Tensor: ...

    def backward(self, microbatch_id: int, input_tensor: torch.Tensor | None,
                 output: torch.Tensor, output_grad: torch.Tensor | None
                 ) -> torch.Tensor | None: ...

    def tokens(self, microbatch_id: int) -> int: ...

    def measured(self, microbatch_id: int) -> torch.Tensor | None:
        """What the stage's meter took in this microbatch's forward and backward, if any."""


@dataclass
class ScheduleResult:
    """What this rank computed: ids done, their summed loss (last stage only) and token count.
    The loss stays a device tensor (float64): reading it per microbatch would make the host wait
    for the GPU; the reduction reads it once."""
    ids: list[int] = field(default_factory=list)
    loss_sum: float | torch.Tensor = 0.0
    tokens: int = 0
    measures: torch.Tensor | None = None  # summed over the microbatches (MoE's aux losses)

    def add(self, microbatch: int, tokens: int) -> None:
        """One microbatch done; a filler (id < 0: expert parallelism's padding, `stage.py`)
        is computed but not counted."""
        if microbatch >= 0:
            self.ids.append(microbatch)
        self.tokens += tokens

    def add_measured(self, measured: torch.Tensor | None) -> None:
        if measured is not None:
            self.measures = measured if self.measures is None else self.measures + measured

    def add_loss(self, microbatch: int, loss: torch.Tensor) -> None:
        """The last stage's loss of one microbatch (a filler's, zeroed, is left out whole: zero
        times an overflowed loss would be a NaN)."""
        if microbatch >= 0:
            self.loss_sum = self.loss_sum + loss.detach().double()


def _nothing() -> None:
    pass


def run_1f1b(ids: Sequence[int], stage: Stage, link: StageLink, probe: Probe = NO_PROBE,
             before_last_backward: Callable[[], None] = _nothing) -> ScheduleResult:
    """`before_last_backward` runs just before this rank's last backward of the list: the moment
    gradient buckets may start reducing as they become final (--overlap-grad-reduce)."""
    ids = list(ids)
    n = len(ids)
    warmup = min(link.num_stages - link.stage - 1, n)
    steady = n - warmup
    in_flight: list[tuple[int, torch.Tensor | None, torch.Tensor]] = []
    result = ScheduleResult()
    backwards = 0  # done so far (fillers included)

    def forward(k: int, x: torch.Tensor | None) -> torch.Tensor:
        probe.at("forward", ids[k])
        y = stage.forward(ids[k], x)
        in_flight.append((ids[k], x, y))
        return y

    def backward(dy: torch.Tensor | None) -> torch.Tensor | None:
        nonlocal backwards
        g, x, y = in_flight.pop(0)
        probe.at("backward", g)
        if backwards == n - 1:
            before_last_backward()
        dx = stage.backward(g, x, y, dy)
        backwards += 1
        if link.is_last:
            result.add_loss(g, y)
        result.add(g, stage.tokens(g))
        result.add_measured(stage.measured(g))
        return dx

    for k in range(warmup):
        probe.at("p2p", ids[k])
        x = link.recv_forward()
        y = forward(k, x)
        probe.at("p2p", ids[k])
        link.send_forward(y)

    if steady:
        probe.at("p2p", ids[warmup])
        x = link.recv_forward()
    for k in range(warmup, n):
        y = forward(k, x)
        probe.at("p2p", ids[k])
        dy = link.send_forward_recv_backward(y)
        dx = backward(dy)
        probe.at("p2p", ids[k])
        if k == n - 1:
            link.send_backward(dx)
        else:
            x = link.send_backward_recv_forward(dx)

    for _ in range(warmup):
        probe.at("p2p", in_flight[0][0])
        dy = link.recv_backward()
        dx = backward(dy)
        link.send_backward(dx)
    return result


def run_forward_only(ids: Sequence[int], stage: Stage, link: StageLink,
                     probe: Probe = NO_PROBE) -> ScheduleResult:
    """Evaluation: forward passes only, activations handed straight down the pipeline."""
    result = ScheduleResult()
    for g in ids:
        probe.at("eval", g)
        y = stage.forward(g, link.recv_forward())
        link.send_forward(y)
        if link.is_last:
            result.add_loss(g, y)
        result.add(g, stage.tokens(g))
        stage.measured(g)  # taken and dropped: an evaluation commits nothing
    return result


# -- running an order ---------------------------------------------------------------------------
class ChunkLink(Protocol):
    """Activations and gradients between virtual stages. `recv` blocks and returns None where the
    action has no input (virtual stage 0's forward, the last one's backward); `post` starts that
    receive ahead of `recv` (a no-op where there is nothing to receive); `send` must not block
    the receives after it (see the module docstring) and drops what has no receiver; `flush`
    waits for every send; `discard` forgets the operations posted so far (after a failure: they
    belong to a broken group, and a later schedule must not wait on them)."""

    def post(self, kind: Kind, chunk: int, index: int) -> None: ...

    def recv(self, kind: Kind, chunk: int, index: int) -> torch.Tensor | None: ...

    def send(self, kind: Kind, chunk: int, index: int, tensor: torch.Tensor | None) -> None: ...

    def flush(self) -> None: ...

    def discard(self) -> None: ...


def _posting_ahead(order: Sequence, warmup_flush: bool) -> range:
    """The positions after which the next action's receive is posted before the compute:
    Megatron overlaps p2p in the steady phase (from the first backward to the last forward),
    and in the warm-up and the flush too with --overlap-p2p-communication-warmup-flush."""
    if warmup_flush:
        return range(len(order) - 1)
    first_backward = next((i for i, a in enumerate(order) if a.kind is Kind.BACKWARD), len(order))
    last_forward = max((i for i, a in enumerate(order) if a.kind is Kind.FORWARD), default=-1)
    return range(first_backward, min(last_forward + 1, len(order) - 1))


def run_interleaved(ids: Sequence[int], chunks: Sequence[Stage], link: ChunkLink, *, rank: int,
                    stages: int, group: int, probe: Probe = NO_PROBE,
                    before_backwards: Callable[[int], None] = lambda backwards: None,
                    overlap_warmup_flush: bool = False) -> ScheduleResult:
    """This rank's part of the interleaved schedule over `ids`: `chunks[c]` is its model chunk c
    (virtual stage c * stages + rank). A microbatch counts as done here when its chunk-0 backward
    ends; its loss is taken on the last virtual stage. `before_backwards(n)` runs before the
    first action of a non-empty list: every parameter will see n backwards (one per id), so
    gradient buckets can start reducing as soon as their chunk's last one is done, while the
    other chunks still run (--overlap-grad-reduce)."""
    order = interleaved_orders(len(ids), stages, len(chunks),
                               best_group(len(ids), stages, len(chunks), group))[rank]
    ahead = _posting_ahead(order, overlap_warmup_flush)
    last = stages * len(chunks) - 1
    in_flight: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
    result = ScheduleResult()
    if ids:
        before_backwards(len(ids))
    try:
        for i, a in enumerate(order):
            g, stage = ids[a.index], chunks[a.chunk]
            probe.at("p2p", g)
            received = link.recv(a.kind, a.chunk, a.index)
            if i in ahead:  # Megatron's overlap: the next input arrives during this compute
                link.post(order[i + 1].kind, order[i + 1].chunk, order[i + 1].index)
            if a.kind is Kind.FORWARD:
                probe.at("forward", g)
                y = stage.forward(g, received)
                in_flight[(a.chunk, a.index)] = (received, y)
                link.send(a.kind, a.chunk, a.index, y)
                continue
            x, y = in_flight.pop((a.chunk, a.index))
            probe.at("backward", g)
            dx = stage.backward(g, x, y, received)
            if a.chunk * stages + rank == last:
                result.add_loss(g, y)
            tokens = stage.tokens(g)  # every chunk counted them in its forward
            result.add_measured(stage.measured(g))  # each chunk its own layers
            if a.chunk == 0:
                result.add(g, tokens)
            link.send(a.kind, a.chunk, a.index, dx)
    except BaseException:  # a failed peer: these sends belong to a broken group
        link.discard()
        raise
    link.flush()
    return result


def run_forward_only_interleaved(ids: Sequence[int], chunks: Sequence[Stage], link: ChunkLink, *,
                                 rank: int, stages: int, probe: Probe = NO_PROBE
                                 ) -> ScheduleResult:
    """Evaluation with model chunks: each microbatch through every chunk in turn. Valid with
    blocking receives and non-blocking sends: virtual stage v's forward of microbatch k waits only
    on v - 1's of k, which no rank orders after anything that waits on v's."""
    result = ScheduleResult()
    last = stages * len(chunks) - 1
    try:
        for index, g in enumerate(ids):
            probe.at("eval", g)
            for c, stage in enumerate(chunks):
                y = stage.forward(g, link.recv(Kind.FORWARD, c, index))
                link.send(Kind.FORWARD, c, index, y)
                tokens = stage.tokens(g)
                stage.measured(g)  # taken and dropped: an evaluation commits nothing
                if c * stages + rank == last:
                    result.add_loss(g, y)
                if c == 0:
                    result.add(g, tokens)
    except BaseException:
        link.discard()
        raise
    link.flush()
    return result


class PipelineSchedule(Protocol):
    """How this rank runs a list of microbatch ids through its stages, chosen once for the job
    (`one_f_one_b` or `interleaved`): training and evaluation both ask it, and nobody asks which
    one it is."""
    def train(self, ids: Sequence[int], stages: Sequence[Stage], probe: Probe,
              arm: Callable[..., None]) -> ScheduleResult:
        """Forwards and backwards; `arm` runs before the last backwards (overlapped reduction)."""
        ...

    def forward_only(self, ids: Sequence[int], stages: Sequence[Stage],
                     probe: Probe) -> ScheduleResult: ...


@dataclass(frozen=True)
class OneFOneB:
    """One model chunk per rank: 1F1B."""
    link: StageLink

    def train(self, ids, stages, probe, arm) -> ScheduleResult:
        return run_1f1b(ids, stages[0], self.link, probe, arm)

    def forward_only(self, ids, stages, probe) -> ScheduleResult:
        return run_forward_only(ids, stages[0], self.link, probe)


@dataclass(frozen=True)
class Interleaved:
    """Several model chunks per rank: the interleaved 1F1B schedule over the chunks' channels."""
    link: ChunkLink
    rank: int  # this rank's pipeline stage
    stages: int  # the pipeline's size
    group: int  # --microbatch-group-size-per-virtual-pipeline-stage
    overlap_warmup_flush: bool = False

    def train(self, ids, stages, probe, arm) -> ScheduleResult:
        return run_interleaved(ids, stages, self.link, rank=self.rank, stages=self.stages,
                               group=self.group, probe=probe, before_backwards=arm,
                               overlap_warmup_flush=self.overlap_warmup_flush)

    def forward_only(self, ids, stages, probe) -> ScheduleResult:
        return run_forward_only_interleaved(ids, stages, self.link, rank=self.rank,
                                            stages=self.stages, probe=probe)
