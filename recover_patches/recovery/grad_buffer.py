"""Persistent main-grad buffers and the out-of-place, bucketed DP reduction (design.md §9).

One flat fp32 buffer `local` holds every parameter's accumulated gradient; `param.main_grad` is a
view into it, and a post-accumulate-grad hook adds each microbatch's gradient there (and drops
`param.grad`), as megatron-core's param-and-grad buffer does. Parameters are laid out in reverse
order, so buckets fill up in the order backward produces them.

The DP reduction never touches `local`: bucket by bucket it copies into a second buffer `reduced`
and all-reduces that, so an interrupted reduction leaves the local gradients intact for recovery.
The commit bookkeeping (microbatch count, tokens, the two id checksums, the loss sum, each
replica's time per microbatch) rides in a tail of the last bucket: a failure-free iteration issues
exactly one collective per bucket on the DP group and nothing else.

The tail's layout and encoding: `reduction_tail.py`.

With --recover-exact-reduction (`FixedPointScales`) both buffers are float64 holding integers: each
microbatch's gradient enters as round(g x 2^e) with its parameter's exponent (`fixed_point.py`),
every sum is exact, and after the reduction the integers become fp32 gradients
(`reduced_grads`) once.

With the distributed optimizer and every replica live (`Scatter`), each bucket is instead
reduce-scattered over the optimizer instance into the rank's range (the layout pads buckets to a
multiple of the instance size) and all-reduced across instances over the rank's position group, as
Megatron's HSDP does; only the rank's ranges of `reduced` then hold reduced gradients. The tail
goes alone in one all-reduce over the DP group. With expert parallelism the expert buckets are
reduce-scattered over their own holders (`Scatter.experts`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from recover_patches.collectives import PeerFailure
from recover_patches.recovery.fixed_point import FixedPointScales
from recover_patches.recovery.reduce import Totals
from recover_patches.recovery.reduction_tail import ReducedGradients, TailLayout

__all__ = ["FlatLayout", "GradBuffer", "ReducedGradients", "Scatter", "flat_layout", "is_expert"]


def is_expert(param: torch.Tensor) -> bool:
    """An expert's weight under expert parallelism: megatron-core marks it `allreduce=False`
    (it is summed over the expert-data-parallel group, not the data-parallel one)."""
    return getattr(param, "allreduce", True) is False


@dataclass
class Scatter:
    """Reduce-scatter instead of all-reduce: this rank is `shard` of the `shards` live replicas of
    its optimizer instance (`instance`), and `across` holds the ranks at its position in the other
    instances."""
    instance: dist.ProcessGroup
    across: dist.ProcessGroup | None
    shard: int
    shards: int
    experts: Scatter | None = None  # EP > 1: the expert buckets', over their own holders


@dataclass
class FlatLayout:
    """Where each parameter's gradient lives in the flat buffers, and the buckets reduced as one.
    The distributed optimizer shards each bucket over an instance in this same space."""
    offsets: dict[torch.Tensor, int]
    buckets: list[tuple[int, int]]  # [start, end): consecutive, padded to a multiple of `pad_to`
    numel: int  # the end of the last bucket


def flat_layout(params: Sequence[torch.Tensor], bucket_numel: int | None = None, pad_to: int = 1,
                alone: Callable[[torch.Tensor], bool] = lambda p: False,
                apart: Callable[[torch.Tensor], object] = is_expert) -> FlatLayout:
    """Parameters in reverse order, so buckets fill up in the order backward produces the
    gradients; a bucket closes once it holds `bucket_numel` (None: one bucket), a parameter
    `alone` says so gets a bucket of its own, and one whose `apart` differs from the previous
    one's starts a new bucket (experts' gradients are summed over another group; Megatron-FSDP
    gathers each unit's bucket alone). Each bucket
    is padded with zeros to a multiple of `pad_to` (the distributed optimizer's instance size:
    its shards then split every bucket evenly)."""
    offsets: dict[torch.Tensor, int] = {}
    buckets: list[tuple[int, int]] = []
    start = offset = 0

    def close() -> int:
        end = start + -(-(offset - start) // pad_to) * pad_to
        buckets.append((start, end))
        return end
    kind = None
    for p in reversed(params):
        if (alone(p) or apart(p) != kind) and offset > start:
            start = offset = close()
        kind = apart(p)
        offsets[p] = offset
        offset += p.numel()
        if alone(p) or (bucket_numel is not None and offset - start >= bucket_numel):
            start = offset = close()
    if offset > start or not buckets:
        close()
    return FlatLayout(offsets, buckets, buckets[-1][1])


class GradBuffer:
    def __init__(self, params: Sequence[torch.Tensor], *, replicas: int, dp_group,
                 device: torch.device | str = "cpu", bucket_numel: int | None = None,
                 overlap: bool = False, layout: FlatLayout | None = None, expert_dp_group=None,
                 measure_slots: int = 0, scales: FixedPointScales | None = None):
        """`measure_slots`: the length of `Totals.measures` (summed in the tail, after the
        alarms; 0: none); `scales`: sum fixed-point integers (--recover-exact-reduction)."""
        self.params = list(params)
        self.dp_group = dp_group
        self.replicas = replicas
        self.overlap = overlap
        self.device = torch.device(device)
        self.layout = layout or flat_layout(self.params, bucket_numel)
        self.numel = self.layout.numel
        self.scales = scales
        self.tail = TailLayout(replicas, measure_slots, 0 if scales is None else scales.slots)
        self.meta_numel = self.tail.size
        self.local = torch.zeros(self.numel + self.meta_numel, device=self.device,
                                 dtype=torch.float32 if scales is None else torch.float64)
        self.reduced = torch.zeros_like(self.local)
        # exact: the fp32 gradients converted from `reduced`, and per parameter the largest
        # |g| x 2^e of this rank's microbatches since the last zero()
        self._converted = torch.zeros(0 if scales is None else self.numel, dtype=torch.float32,
                                      device=self.device)
        self._index = {p: i for i, p in enumerate(self.params)}  # (the exponents' order)
        self._peaks = torch.zeros(len(self.params), dtype=torch.float64,
                                  device=self.device)
        self._offsets = self.layout.offsets
        self._bucket_of: dict[torch.Tensor, int] = {}
        for p in self.params:
            offset = self._offsets[p]
            setattr(p, "main_grad", self.local[offset:offset + p.numel()].view_as(p))
            self._bucket_of[p] = next(b for b, (s, e) in enumerate(self.layout.buckets)
                                      if s <= offset < e)
        # [start, end) in the buffers, reduced as one operation over its group; the last one
        # holds the tail, on the DP group: alone if the last gradients are experts'
        experts = {b for p, b in self._bucket_of.items() if is_expert(p)}
        self._expert_buckets = experts
        self.groups = [expert_dp_group if b in experts else dp_group
                       for b in range(len(self.layout.buckets))]
        last = len(self.layout.buckets) - 1
        self.buckets = list(self.layout.buckets[:last]) + (
            [self.layout.buckets[last], (self.numel, self.numel + self.meta_numel)]
            if last in experts else [(self.layout.buckets[last][0], self.numel + self.meta_numel)])
        self.groups += [dp_group] * (len(self.buckets) - len(self.groups))
        self._bucket_params = [0] * len(self.buckets)  # params per bucket
        for b in self._bucket_of.values():
            self._bucket_params[b] += 1
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulate) for p in self.params]
        self.scatter: Scatter | None = None  # set while every replica is live
        self._works: dict[int, dist.Work | None] = {}
        self._scattered: dict[int, torch.Tensor] = {}  # per bucket: the range's reduced values
        self._pending: list[int] = []  # per bucket: params whose last gradient is still to come
        self._failure: PeerFailure | None = None

    # -- accumulation and the overlapped start of bucket reductions ---------------------------
    def _accumulate(self, param: torch.Tensor) -> None:
        if self.scales is None:
            param.main_grad.add_(param.grad)  # type: ignore[attr-defined]  # set in __init__
        else:
            self._add_fixed_point(param)
        param.grad = None
        if self._pending:
            self._pending[self._bucket_of[param]] -= 1
            # Collectives must be issued in the same order on every DP rank, and a replica with
            # no microbatches this round launches everything from reduce(), in bucket order. So
            # start only the ready prefix of buckets, never one out of order; the last bucket
            # waits for the totals, in reduce().
            while len(self._works) < len(self.buckets) - 1 and self._pending[len(self._works)] == 0:
                self._launch(len(self._works))

    def _add_fixed_point(self, param: torch.Tensor) -> None:
        """One microbatch's gradient of `param` as integers at its exponent."""
        i = self._index[param]
        assert param.grad is not None and self.scales is not None
        scaled = param.grad.double() * self.scales.multiplier(i)
        self._peaks[i] = torch.maximum(self._peaks[i], scaled.abs().max())
        param.main_grad.add_(scaled.round_())  # type: ignore[attr-defined]

    def arm(self, backwards: int = 1) -> None:
        """Every parameter has `backwards` backwards left this round on this rank (1F1B arms
        before its last; the interleaved schedule before its first, with one per microbatch)
        (--overlap-grad-reduce): start each bucket's reduction as soon as all its gradients are
        final."""
        if self.overlap:
            self._pending = [count * backwards for count in self._bucket_params]

    def _launch(self, b: int) -> None:
        if b in self._works:
            return
        if self._failure is not None:  # keep the prefix count moving; reduce() raises
            self._works[b] = None
            return
        start, end = self.buckets[b]
        grads_end = min(end, self.numel)
        self.reduced[start:grads_end].copy_(self.local[start:grads_end])
        try:  # called from an autograd hook: keep the failure for reduce() to raise
            if self.scatter is not None:  # (the tail alone: reduced in reduce())
                self._works[b] = self._scatter_bucket(b, start, grads_end, self._scatter_of(b)) \
                    if grads_end > start else None
            else:
                group = self.groups[b]
                self._works[b] = (dist.all_reduce(self.reduced[start:end], group=group,
                                                  async_op=True)
                                  if group is not None and group.size() > 1 else None)
        except PeerFailure as err:
            self._works[b], self._failure = None, err

    def _scatter_of(self, b: int) -> Scatter:
        """Bucket b's reduce-scatter: the experts' buckets go over their own holders."""
        assert self.scatter is not None
        if b not in self._expert_buckets:
            return self.scatter
        assert self.scatter.experts is not None, "expert buckets are sharded apart (EP > 1)"
        return self.scatter.experts

    def _scatter_bucket(self, b: int, start: int, end: int, scatter: Scatter) -> dist.Work | None:
        """Start the reduce-scatter of bucket b's gradients into this rank's range."""
        out = torch.empty((end - start) // scatter.shards, dtype=self.reduced.dtype,
                          device=self.device)
        self._scattered[b] = out
        if scatter.shards == 1:
            out.copy_(self.reduced[start:end])
            return None
        return dist.reduce_scatter_single(out, self.reduced[start:end], group=scatter.instance,
                                          async_op=True)

    # -- the reduction ------------------------------------------------------------------------
    def reduce(self, totals: Totals, replica: int, time_wire: float,
               weight_hash: int = 0, alarm: float | torch.Tensor = 0.0) -> ReducedGradients:
        """Out-of-place sum over the DP group of the gradients and the commit bookkeeping;
        `weight_hash` (64 bits, 0: none) and `alarm` (may be a device tensor) travel in this
        replica's slots."""
        scatter = self.scatter
        try:
            self.tail.write(self.reduced[self.numel:], totals, replica, time_wire, weight_hash,
                            alarm, None if self.scales is None
                            else self.scales.encode(self._peaks))
            for b in range(len(self.buckets)):
                self._launch(b)
            if self._failure is not None:
                raise self._failure
            tail = None
            if scatter is not None and self.dp_group is not None and self.dp_group.size() > 1:
                tail = dist.all_reduce(self.reduced[self.numel:], group=self.dp_group,
                                       async_op=True)
            for work in self._works.values():
                if work is not None:
                    work.wait()
            if scatter is not None:
                self._reduce_across()
            if tail is not None:
                tail.wait()
        except PeerFailure:
            # An aborted operation may still write its buffer: the next round gets a fresh one.
            self.reduced = torch.zeros_like(self.local)
            raise
        finally:
            self._works, self._pending, self._failure, self._scattered = {}, [], None, {}
        reduced = self.tail.read(self.reduced[self.numel:], self.scales)
        reduced.scattered = scatter is not None
        if self.scales is not None:
            self._from_fixed_point()
        return reduced

    def _from_fixed_point(self) -> None:
        """The reduced integers as fp32 gradients: x 2^-e is exact, the cast rounds once."""
        assert self.scales is not None
        for i, (start, end) in enumerate(self._spans()):
            self._converted[start:end].copy_(self.reduced[start:end] / self.scales.multiplier(i))

    def _spans(self) -> list[tuple[int, int]]:
        """Each parameter's [start, end) in the flat buffers, in the exponents' order."""
        return [(self._offsets[p], self._offsets[p] + p.numel()) for p in self.params]

    def _reduce_across(self) -> None:
        """Sum each bucket's range over the instances, then put it in place in `reduced`."""
        works = [dist.all_reduce(out, group=across, async_op=True)
                 for b, out in self._scattered.items()
                 for across in [self._scatter_of(b).across]
                 if across is not None and across.size() > 1]
        for work in works:
            work.wait()
        for b, out in self._scattered.items():
            at = self.buckets[b][0] + self._scatter_of(b).shard * out.numel()
            self.reduced[at:at + out.numel()].copy_(out)

    # -- views for the step, and recovery's undo ----------------------------------------------
    @property
    def reduced_grads(self) -> torch.Tensor:
        """All reduced gradients as one flat fp32 tensor (scale or clip them with one
        operation)."""
        return (self.reduced if self.scales is None else self._converted)[:self.numel]

    def reduced_grad(self, param: torch.Tensor) -> torch.Tensor:
        offset = self._offsets[param]
        return self.reduced_grads[offset:offset + param.numel()].view_as(param)

    def scale_gradients(self, factor: float) -> None:
        """Multiply every reduced gradient by `factor` (the clip) in one operation."""
        self.reduced_grads.mul_(factor)

    def divide_gradients(self, divisor: float) -> None:
        """Divide every reduced gradient by `divisor` (the global token count, the loss scale):
        a division, not a multiplication by its inverse, which rounds differently."""
        self.reduced_grads.div_(divisor)

    def scatter_into(self, scatter: Scatter | None) -> None:
        """From the next reduction on: reduce-scatter into `scatter`'s ranges (None: all-reduce
        every gradient whole; with expert parallelism `scatter.experts` holds the experts')."""
        self.scatter = scatter

    def zero(self) -> None:
        self.local.zero_()
        self._peaks.zero_()

    def take_peaks(self) -> torch.Tensor:
        """Exact: each parameter's largest |g| x 2^e since the last zero() (then forgotten)."""
        peaks = self._peaks.clone()
        self._peaks.zero_()
        return peaks

    def snapshot(self) -> torch.Tensor:
        return self.local.clone()

    def restore(self, saved: torch.Tensor) -> None:
        self.local.copy_(saved)

    def local_norm(self, since: torch.Tensor | None = None) -> torch.Tensor:
        """The L2 norm of this rank's accumulated (not yet reduced) gradients, or of what was
        accumulated after `since` (a snapshot); on the device."""
        grads = self.local[:self.numel]
        if since is not None:
            grads = grads - since[:self.numel]
        if self.scales is not None:  # integers at each parameter's exponent
            scales = self.scales
            grads = torch.cat([grads[s:e] / scales.multiplier(i)
                               for i, (s, e) in enumerate(self._spans())])
        return torch.linalg.vector_norm(grads)

    def amplify_local(self, factor: float) -> None:
        """Fault injection (an injected error under --check-for-large-grads): this rank's
        accumulated gradients times `factor`."""
        self.local[:self.numel].mul_(factor)

    def poison(self) -> None:
        """Fault injection: this rank's gradient overflowed (an inf in the accumulated grads)."""
        self.local[0] = float("inf")

    def extra_bytes_per_param(self) -> int:
        """Memory beyond the model's own: fp32 `local` + fp32 `reduced` (Megatron's DDP: one);
        exact: float64 `local` and `reduced`, and the fp32 gradients converted once."""
        return 8 if self.scales is None else 20
