"""Point-to-point activation/gradient exchange between neighbouring pipeline stages.

Every transfer goes through the replica's PP process group (`group_dst`/`group_src` addressing, so
the group object may be a wrapper that is rebuilt in place). Paired transfers post both operations
before waiting on either, so neighbours that call the mirror-image pair never deadlock.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


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
