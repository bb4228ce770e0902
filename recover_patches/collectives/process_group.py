"""ResilientProcessGroup: a torch ProcessGroup whose every operation completes or raises
PeerFailure within its bound, and whose inner backend can be replaced in place (DESIGN §5).

Rules, and why:
  * A newer membership epoch that declares one of this group's *members* dead discards the inner
    backend at once (peers blocked on it then fail in milliseconds) and every pending or later
    operation raises PeerFailure until `rebuild()`. Every member learns of the epoch within
    milliseconds, so all of them stop using the old backend together. A group none of whose
    members died simply adopts the new epoch and carries on: the TP/PP groups of a healthy replica
    never see another replica's failure (DESIGN §3), so its in-flight microbatches are not torn.
  * `rebuild(e, members, key)` is strict: if any epoch after e has started, it raises PeerFailure,
    so all survivors abandon a recovery attempt together and retry with the newer epoch. `key`
    names the agreed step that rebuilds (a recovery attempt, a join): the rendezvous lives under
    (epoch, key), so processes with different histories -- a replacement that never saw the
    earlier rebuilds of this epoch -- meet in the same place.
  * An operation that errors (a peer's socket closed) or times out is reported to the coordinator;
    the group waits up to `verdict_timeout` for the coordinator's verdict (a new epoch naming the
    dead) so that PeerFailure names the right rank even when gloo cannot.
  * Collectives are watched through their future. gloo p2p works (and reduce_scatter) have none,
    and a timed wait on them closes the connection (measured), so each such pending operation gets
    a small waiter thread that ends with it (at the latest at the group timeout).
  * Buffers of an aborted operation may still be written by the old backend until it times out:
    after a PeerFailure, do not reuse them.
  * Works returned for async ops only implement wait() (is_completed() stays False).

The group registers itself in torch.distributed's group tables, so `dist.get_rank(group)`,
`get_process_group_ranks`, `broadcast(src=<global rank>)` and torch's error logging work.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch.distributed as dist
from torch._C._distributed_c10d import PythonCallbackWork

from recover_patches.collectives import backends
from recover_patches.collectives.errors import MembershipTimeout, PeerFailure

GRACE = 0.5  # our own deadline trails the backend's timeout, which normally fires first


class _Pending:
    """One issued operation; `work` is dropped when the group breaks so nothing pins the backend."""

    def __init__(self, op: str, work, peer: int | None):
        self.op, self.work, self.peer = op, work, peer
        self.started = time.monotonic()
        self.done = False
        self.error: str | None = None
        self.outcome: PeerFailure | bool | None = None


class ResilientProcessGroup(dist.ProcessGroup):
    def __init__(self, name: str, members: Sequence[int], *, membership, timeout: float,
                 backend: str = "gloo", build_timeout: float = 60.0,
                 verdict_timeout: float | None = None, connect: bool = True):
        members = tuple(int(m) for m in members)
        if membership.rank not in members or len(set(members)) != len(members):
            raise ValueError(f"group {name!r}: members {members} must be distinct and include this "
                             f"rank {membership.rank}")
        super().__init__(members.index(membership.rank), len(members))
        self.name = name
        self.members = members
        self.membership = membership
        self.timeout = timeout
        self.build_timeout = build_timeout
        self.verdict_timeout = (verdict_timeout if verdict_timeout is not None else
                                membership.heartbeat_timeout + 2 * membership.heartbeat_interval)
        self.backend_kind = backend
        self.before_op: Callable[[str], None] | None = None  # fault-injection hook
        self._cond = threading.Condition()
        self._inner = None
        self._epoch = -1
        self._dead_at_build: frozenset[int] = frozenset()
        self._failure: PeerFailure | None = None
        self._pending: set[_Pending] = set()
        self._attempts: dict[tuple[int, str], int] = {}
        membership.add_listener(self._on_epoch)
        if connect:
            self._build(membership.epoch(), members)
        else:  # a spare's group: no backend until the join rebuilds it with the others
            self._failure = PeerFailure(-1, (), f"{name}.join", "not joined yet", confirmed=False)
            self._register()

    # --- what torch and megatron ask of a group --------------------------------------------
    def rank(self) -> int:
        return self.members.index(self.membership.rank)

    def size(self) -> int:
        return len(self.members)

    def getBackendName(self) -> str:
        return self.backend_kind

    @property
    def group_name(self) -> str:
        return self.name

    @property
    def epoch(self) -> int:
        return self._epoch

    def __repr__(self) -> str:
        return f"ResilientProcessGroup({self.name!r}, members={self.members}, epoch={self._epoch})"

    # --- collectives and p2p ----------------------------------------------------------------
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

    # --- lifecycle --------------------------------------------------------------------------
    def rebuild(self, epoch: int, members: Sequence[int], key: str = "") -> None:
        """Replace the inner backend by one for `members` in membership `epoch` (all the members
        call this with the same arguments). Raises PeerFailure if the rebuild is interrupted by a
        newer epoch or a member never shows up."""
        members = tuple(int(m) for m in members)
        if self.membership.rank not in members:
            raise ValueError(f"group {self.name!r}: rank {self.membership.rank} rebuilt without itself")
        self._discard()
        self._build(epoch, members, key)

    def shutdown(self) -> None:
        """Stop using this group: discard the backend, forget the listener and the registration."""
        self.membership.remove_listener(self._on_epoch)
        self._discard(PeerFailure(self._epoch, (), f"{self.name}.shutdown", "group was shut down",
                                  confirmed=False))
        world = dist.distributed_c10d._world
        world.pg_map.pop(self, None)
        world.pg_group_ranks.pop(self, None)

    abort = shutdown

    # --- internals --------------------------------------------------------------------------
    def _build(self, epoch: int, members: tuple[int, ...], key: str = "") -> None:
        current, dead = self.membership.view()
        if current < epoch:
            self.membership.wait_for_epoch_after(epoch - 1, self.verdict_timeout)
            current, dead = self.membership.view()
        if current > epoch:  # strict: every survivor restarts recovery with the newer epoch
            raise PeerFailure(epoch, dead - self._dead_at_build, f"{self.name}.rebuild",
                              f"epoch {current} already started")
        attempt = self._attempts.get((epoch, key), 0)
        self._attempts[(epoch, key)] = attempt + 1
        prefix = f"pg/{self.name}/e{epoch}/{key}.{attempt}/"
        with self._cond:
            self._epoch, self._dead_at_build, self.members = epoch, dead, members
        self._rendezvous(prefix, epoch, members)
        try:
            inner = backends.build(self.backend_kind, dist.PrefixStore(prefix + "backend/",
                                   self.membership.store), members.index(self.membership.rank),
                                   len(members), self.build_timeout, self.timeout)
        except RuntimeError as e:  # a member vanished between the rendezvous and the connect
            raise PeerFailure(epoch, (), f"{self.name}.rebuild", f"backend set-up failed: {e}",
                              confirmed=False) from e
        with self._cond:
            self._inner, self._failure = inner, None
        self._register()
        if self.membership.epoch() > epoch:  # an epoch arrived while we were building
            self._discard()
            raise self._fail("rebuild", "a newer epoch started during the rebuild")

    def _rendezvous(self, prefix: str, epoch: int, members: tuple[int, ...]) -> None:
        """Meet the other members on the store, watching for a newer epoch while waiting."""
        store, me = self.membership.store, self.membership.rank
        store.set(f"{prefix}arrived/{me}", "1")
        if store.add(f"{prefix}count", 1) == len(members):
            store.set(f"{prefix}ready", "1")
        deadline = time.monotonic() + self.build_timeout
        pause = 0.001
        while not store.check([f"{prefix}ready"]):
            if self.membership.epoch() > epoch:
                raise self._fail("rebuild", "a newer epoch started during the rendezvous")
            if time.monotonic() > deadline:
                missing = [m for m in members if not store.check([f"{prefix}arrived/{m}"])]
                raise PeerFailure(epoch, missing, f"{self.name}.rebuild",
                                  f"members {missing} did not arrive in {self.build_timeout:g}s",
                                  confirmed=False)
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def _register(self) -> None:
        world = dist.distributed_c10d._world
        world.pg_map[self] = (self.backend_kind, self.membership.store)
        world.pg_group_ranks[self] = {g: i for i, g in enumerate(self.members)}

    def _issue(self, op: str, start, peer: int | None = None):
        if self.before_op is not None:
            self.before_op(op)
        with self._cond:
            inner, failure = self._inner, self._failure
        stale = self._stale()
        if failure is not None:
            raise PeerFailure(failure.epoch, failure.suspects, f"{self.name}.{op}",
                              f"group broken by an earlier failure ({failure.op}); rebuild() it",
                              failure.confirmed)
        if inner is None or stale:
            raise self._fail(op, "the group's epoch is over", peer)
        try:
            work = start(inner)
        except RuntimeError as e:
            raise self._fail(op, str(e), peer) from e
        pending = _Pending(op, work, peer)
        with self._cond:
            if self._inner is inner:
                self._pending.add(pending)
            else:  # broken between start and here: the work is orphaned
                pending.work, pending.done, pending.error = None, True, "group broken"
        if pending.work is not None:
            self._watch(pending, work)
        del work
        return PythonCallbackWork(lambda _timeout: self._await(pending))

    def _watch(self, pending: _Pending, work) -> None:
        future = None
        if pending.peer is None:
            try:
                future = work.get_future()
            except RuntimeError:  # e.g. gloo's reduce_scatter: no future, use a waiter thread
                pass
        if future is not None:
            future.add_done_callback(lambda fut: self._finished(pending, fut))
            return

        def wait_p2p(work=work):
            error = None
            try:
                work.wait()  # untimed: a timed wait on a gloo p2p work closes the connection
            except RuntimeError as e:
                error = str(e)
            del work
            self._finished(pending, None, error)
        threading.Thread(target=wait_p2p, name=f"recover-p2p-{self.name}", daemon=True).start()

    def _finished(self, pending: _Pending, future=None, error: str | None = None) -> None:
        """Runs on a backend or waiter thread: record the outcome, wake the waiter."""
        if future is not None:
            try:
                future.value()
            except Exception as e:  # the backend's error, e.g. "Connection closed by peer"
                error = str(e)
        with self._cond:
            if pending.work is not None and not pending.done:
                pending.done, pending.error = True, error
            self._cond.notify_all()

    def _await(self, pending: _Pending) -> bool:
        """Body of Work.wait(): True when done, else PeerFailure — never longer than the bound."""
        if pending.outcome is not None:
            if isinstance(pending.outcome, PeerFailure):
                raise pending.outcome
            return True
        deadline = pending.started + self.timeout + GRACE
        with self._cond:
            while not pending.done and self._inner is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            done, error, broken_by = pending.done, pending.error, self._failure
            self._pending.discard(pending)
            pending.work = None
        if done and error is None:
            pending.outcome = True
            return True
        if done:
            detail = error
        elif broken_by is not None:
            detail = f"aborted: {broken_by.op} failed first"
        elif self._stale():
            detail = "aborted: a newer membership epoch declared a member dead"
        else:
            detail = f"no completion within {self.timeout:g}s"
        if broken_by is not None and not done:
            pending.outcome = PeerFailure(broken_by.epoch, broken_by.suspects,
                                          f"{self.name}.{pending.op}", detail, broken_by.confirmed)
        else:
            pending.outcome = self._fail(pending.op, detail, pending.peer)
        raise pending.outcome

    def _fail(self, op: str, detail: str, peer: int | None = None) -> PeerFailure:
        """Break the group at once (peers blocked on it then fail in milliseconds), then name the
        culprit, waiting up to `verdict_timeout` for the coordinator's verdict."""
        epoch = self._epoch
        self._discard()
        others = {m for m in self.members if m != self.membership.rank}
        guess = {peer} if peer is not None else others
        if self.membership.epoch() <= epoch:
            self.membership.report_failure(guess, f"{self.name}.{op}: {detail}")
            try:
                self.membership.wait_for_epoch_after(epoch, self.verdict_timeout)
            except MembershipTimeout:
                pass
        newly_dead = self.membership.dead_ranks() - self._dead_at_build
        if newly_dead:
            failure = PeerFailure(epoch, (newly_dead & set(self.members)) or newly_dead,
                                  f"{self.name}.{op}", detail)
        else:
            failure = PeerFailure(epoch, guess, f"{self.name}.{op}", detail, confirmed=False)
        with self._cond:
            if self._failure is None and self._inner is None:
                self._failure = failure
        return failure

    def abandon(self, reason: str) -> None:
        """Layer 2 stops using this backend (recovery starts): peers blocked on it fail fast and
        any later operation raises PeerFailure until `rebuild()`."""
        self._discard(PeerFailure(self._epoch, (), f"{self.name}.abandon", reason, confirmed=False))

    def _discard(self, failure: PeerFailure | None = None) -> None:
        with self._cond:
            inner, self._inner = self._inner, None
            works = [p.work for p in self._pending if p.work is not None]
            for p in self._pending:
                p.work = None
            self._pending.clear()
            if failure is not None and self._failure is None:
                self._failure = failure
            self._cond.notify_all()
        if inner is not None:
            backends.discard(inner, works)

    def _stale(self) -> bool:
        """A newer epoch declared a member dead (adopting harmless epochs on the way)."""
        epoch, dead = self.membership.view()
        if epoch <= self._epoch:
            return False
        if dead & set(self.members):
            return True
        self._adopt(epoch, dead)
        return False

    def _adopt(self, epoch: int, dead: frozenset[int]) -> None:
        with self._cond:
            if self._inner is not None and epoch > self._epoch:
                self._epoch, self._dead_at_build = epoch, dead

    def _on_epoch(self, epoch: int, dead: frozenset[int]) -> None:
        """Membership listener (watcher thread): an epoch that kills a member ends the backend
        now; any other epoch is adopted and the group carries on."""
        if epoch <= self._epoch:
            return
        if dead & set(self.members):
            self._discard()
        else:
            self._adopt(epoch, dead)
