"""What torch and megatron-core ask of a process group: every collective and p2p operation, each
handed to the group's one issuing path (`_issue`: the failure checks, the watchdog, the wait)."""
from __future__ import annotations

import torch.distributed as dist


class Operations(dist.ProcessGroup):
    """The torch ProcessGroup's operations; a subclass supplies `_issue(op, start, peer=None)`
    and `members`."""

    members: tuple[int, ...]

    def _issue(self, op: str, start, peer: int | None = None):
        raise NotImplementedError

    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._issue("allreduce", lambda b: b.allreduce(tensors, opts))

    def allgather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._issue("allgather", lambda b: b.allgather(output_lists, inputs, opts))

    def all_gather_single(self, output, input, opts=None):
        opts = opts if opts is not None else dist.AllgatherOptions()
        return self._issue("allgather", lambda b: b._allgather_base(output, input, opts))
    _allgather_base = all_gather_single

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._issue("reduce_scatter", lambda b: b._reduce_scatter_base(output, input, opts))
    _reduce_scatter_base = reduce_scatter_single

    def all_to_all_single(self, output, input, out_splits, in_splits, opts=None):
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._issue("alltoall", lambda b: b.alltoall_base(output, input, out_splits,
                                                                 in_splits, opts))

    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else dist.BroadcastOptions()
        return self._issue("broadcast", lambda b: b.broadcast(tensors, opts))

    def barrier(self, opts=None):
        opts = opts if opts is not None else dist.BarrierOptions()
        return self._issue("barrier", lambda b: b.barrier(opts))

    def send(self, tensors, dst: int, tag: int = 0):
        return self._issue("send", lambda b: b.send(tensors, dst, tag), peer=self.members[dst])

    def recv(self, tensors, src: int, tag: int = 0):
        return self._issue("recv", lambda b: b.recv(tensors, src, tag), peer=self.members[src])

    def recv_anysource(self, tensors, tag: int = 0):
        raise NotImplementedError("recv from any source cannot notice a dead peer: name the source")

