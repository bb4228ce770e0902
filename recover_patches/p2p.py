"""Point-to-point activation/gradient exchange between neighbouring pipeline stages.

Every transfer goes through the replica's PP process group (`group_dst`/`group_src` addressing, so
the group object may be a wrapper that is rebuilt in place). Paired transfers post both operations
before waiting on either, so neighbours that call the mirror-image pair never deadlock.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from recover_patches.interleaved import Kind


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


class ChunkP2P:
    """`schedule.ChunkLink` over the replica's PP group: activations and gradients between virtual
    stages (chunk c of rank r is virtual stage c * P + r; the last rank's chunk c feeds rank 0's
    chunk c + 1). Receives block; sends are posted and left to complete while this rank computes,
    which the interleaved order needs (a blocked send may hold up a receive a neighbour waits on).
    Each (direction, receiving chunk) has its own tag, so a pair of ranks exchanging activations
    and gradients of several chunks can never match one for another. gloo only: NCCL would run a
    posted send and a later receive on one stream, one after the other."""

    def __init__(self, group, rank: int, stages: int, chunks: int, shape: Sequence[int],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.group, self.rank, self.stages, self.chunks = group, rank, stages, chunks
        self.shape, self.dtype, self.device = tuple(shape), dtype, torch.device(device)
        self.last = stages * chunks - 1
        # (work, tensor) until `flush` (the end of the schedule): a tensor must live until its send
        # completes, and layer 1's works only implement wait(). At most one activation or
        # gradient per action: the activations held for backward are more.
        self._sends: list = []

    def _tag(self, backward: bool, receiving_virtual_stage: int) -> int:
        return 2 * (receiving_virtual_stage // self.stages) + int(backward)

    def recv(self, kind: Kind, chunk: int, index: int) -> torch.Tensor | None:
        v = chunk * self.stages + self.rank
        backward = kind is Kind.BACKWARD
        if (v == self.last) if backward else (v == 0):
            return None
        src = (self.rank + (1 if backward else -1)) % self.stages
        received = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        work = dist.irecv(received, group=self.group, group_src=src, tag=self._tag(backward, v))
        assert work is not None  # None only for a rank outside the group
        work.wait()
        return received if backward else received.requires_grad_()

    def send(self, kind: Kind, chunk: int, index: int, tensor: torch.Tensor | None) -> None:
        v = chunk * self.stages + self.rank
        backward = kind is Kind.BACKWARD
        if tensor is None or ((v == 0) if backward else (v == self.last)):
            return
        to = v - 1 if backward else v + 1
        outgoing = tensor.detach().contiguous()
        work = dist.isend(outgoing, group=self.group, group_dst=to % self.stages,
                          tag=self._tag(backward, to))
        self._sends.append((work, outgoing))

    def flush(self) -> None:
        sends, self._sends = self._sends, []
        for work, _ in sends:
            work.wait()

    def discard(self) -> None:
        self._sends = []
