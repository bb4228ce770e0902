"""Point-to-point activation/gradient exchange between neighbouring pipeline stages.

1F1B (`StageLink`): every transfer goes through the replica's PP process group (`group_dst` /
`group_src` addressing, so the group object may be a wrapper that is rebuilt in place); paired
transfers post both operations before waiting on either, even stages sending first, so neighbours
that call the mirror-image pair never deadlock, under NCCL's rules too. The interleaved schedule
(`ChunkP2P`): one communicator per channel, see there.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from recover_patches.pipeline.interleaved import Kind


class StageLink:
    def __init__(self, group, stage: int, num_stages: int, shape: Sequence[int],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        """`shape`/`dtype`: the activation between stages ([seq (/TP with sequence parallelism),
        micro batch, hidden] in the pipeline dtype), received into buffers on `device`."""
        self.group = group
        self.stage = stage
        self.num_stages = num_stages
        self.shape = tuple(shape)
        self.dtype = dtype
        self.device = torch.device(device)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def _exchange(self, send: torch.Tensor | None, send_to: int | None,
                  recv_from: int | None) -> torch.Tensor | None:
        # Even stages send first, odd stages receive first (Megatron's order without batching):
        # NCCL runs a rank's p2p kernels one after another on one stream, so two neighbours that
        # both posted their receive first would wait for each other forever. gloo does not care.
        works: list = []
        received = None
        outgoing = send.contiguous() if send is not None and send_to is not None else None
        sends_first = self.stage % 2 == 0
        if outgoing is not None and sends_first:
            works.append(dist.isend(outgoing, group=self.group, group_dst=send_to))
        if recv_from is not None:
            received = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            works.append(dist.irecv(received, group=self.group, group_src=recv_from))
        if outgoing is not None and not sends_first:
            works.append(dist.isend(outgoing, group=self.group, group_dst=send_to))
        for work in works:
            work.wait()
        return received

    def _next(self) -> int | None:
        return None if self.is_last else self.stage + 1

    def _prev(self) -> int | None:
        return None if self.is_first else self.stage - 1

    def recv_forward(self) -> torch.Tensor | None:
        x = self._exchange(None, None, self._prev())
        return None if x is None else x.requires_grad_()

    def send_forward(self, y: torch.Tensor | None) -> None:
        self._exchange(None if y is None else y.detach(), self._next(), None)

    def recv_backward(self) -> torch.Tensor | None:
        return self._exchange(None, None, self._next())

    def send_backward(self, dx: torch.Tensor | None) -> None:
        self._exchange(dx, self._prev(), None)

    def send_forward_recv_backward(self, y: torch.Tensor | None) -> torch.Tensor | None:
        return self._exchange(None if y is None else y.detach(), self._next(), self._next())

    def send_backward_recv_forward(self, dx: torch.Tensor | None) -> torch.Tensor | None:
        x = self._exchange(dx, self._prev(), self._prev())
        return None if x is None else x.requires_grad_()


@dataclass(frozen=True)
class Channel:
    """One direction of traffic between two pipeline ranks on a communicator of its own."""
    group: dist.ProcessGroup  # of the two ranks
    peer: int  # the other end's rank in `group`
    # gloo matches by (source, tag): channels sharing one group (no recovery, CPU only) differ
    # by tag; a channel with a group of its own needs none
    tag: int = 0


class ChunkP2P:
    """`schedule.ChunkLink` between virtual stages (chunk c of rank r is virtual stage c * P + r;
    the last rank's chunk c feeds rank 0's chunk c + 1), correct under NCCL's rules as well as
    gloo's (`tests/test_p2p_nccl_rules.py` checks it under a model of NCCL).

    NCCL ignores tags, matches a pair's messages in posting order and runs a rank's operations on
    one communicator one after another, on one stream: over one communicator per pair of ranks, a
    posted send would hold back the receives behind it, and an activation and a gradient of the
    same shape could be matched one for the other. So every *channel* -- (kind, direction): this
    rank's forward sends, forward receives, backward sends, backward receives -- has a
    communicator of its own (`channels`), on which this rank only sends or only receives. Each
    channel carries its messages in the order its receiver reads them (the schedule's order
    guarantees it), so no tag is needed, and a send never holds back a receive. Receives block
    (the compute needs them) and may be posted ahead (`post`: the schedule posts the next one
    before computing, Megatron's overlap); sends are posted and left to complete while this rank
    computes, until `flush` at the end of the schedule."""

    def __init__(self, channels: Mapping[tuple[Kind, bool], Channel], rank: int, stages: int,
                 chunks: int, shape: Sequence[int], dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        """`channels[(kind, True)]`: where this rank sends `kind`; `[(kind, False)]`: where it
        receives it from."""
        self.channels, self.rank, self.stages, self.chunks = channels, rank, stages, chunks
        self.shape, self.dtype, self.device = tuple(shape), dtype, torch.device(device)
        self.last = stages * chunks - 1
        # (work, tensor) until `flush`: a tensor must live until its send completes, and layer
        # 1's works only implement wait(). At most one activation or gradient per action.
        self._sends: list = []
        self._posted: dict[tuple[Kind, int, int], tuple] = {}  # receives posted ahead

    def _has_input(self, kind: Kind, chunk: int) -> bool:
        v = chunk * self.stages + self.rank
        return v != (self.last if kind is Kind.BACKWARD else 0)

    def post(self, kind: Kind, chunk: int, index: int) -> None:
        """Post the receive of (kind, chunk, index) now; `recv` of the same waits for it."""
        if not self._has_input(kind, chunk) or (kind, chunk, index) in self._posted:
            return
        channel = self.channels[(kind, False)]
        received = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        work = dist.irecv(received, group=channel.group, group_src=channel.peer,
                          tag=channel.tag)
        assert work is not None  # None only for a rank outside the group
        self._posted[(kind, chunk, index)] = (work, received)

    def recv(self, kind: Kind, chunk: int, index: int) -> torch.Tensor | None:
        if not self._has_input(kind, chunk):
            return None
        self.post(kind, chunk, index)
        work, received = self._posted.pop((kind, chunk, index))
        work.wait()
        return received if kind is Kind.BACKWARD else received.requires_grad_()

    def send(self, kind: Kind, chunk: int, index: int, tensor: torch.Tensor | None) -> None:
        v = chunk * self.stages + self.rank
        if tensor is None or v == (0 if kind is Kind.BACKWARD else self.last):
            return
        channel = self.channels[(kind, True)]
        outgoing = tensor.detach().contiguous()
        work = dist.isend(outgoing, group=channel.group, group_dst=channel.peer,
                          tag=channel.tag)
        self._sends.append((work, outgoing))

    def flush(self) -> None:
        sends, self._sends = self._sends, []
        for work, _ in sends:
            work.wait()

    def discard(self) -> None:
        """After a failure: the posted operations belong to broken groups."""
        self._sends, self._posted = [], {}
