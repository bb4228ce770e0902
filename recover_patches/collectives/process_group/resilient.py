"""`ResilientProcessGroup`, the class; its rules are the package's docstring."""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch._C._distributed_c10d import PythonCallbackWork
from torch.distributed.distributed_c10d import GroupName

from recover_patches.collectives import backends, device_events, rendezvous
from recover_patches.collectives.rendezvous import Regroup, Retired
from recover_patches.collectives.errors import MembershipTimeout, PeerFailure, short_cause
from recover_patches.collectives.process_group import departures, registry
from recover_patches.collectives.process_group.operations import Operations
from recover_patches.collectives.watchdog import WATCHDOG, Watchdog


@dataclass(slots=True, eq=False)  # identity: held in a set while in flight
class _Op:
    """An issued operation not yet waited for, the group's only reference to its work: `_discard`
    drops it (a work pins its backend, whose sockets would keep blocked peers waiting)."""
    work: dist.Work | None


class ResilientProcessGroup(Operations):
    def __init__(self, name: str, members: Sequence[int], *, membership, timeout: float,
                 backend: str = "gloo", build_timeout: float = 60.0,
                 verdict_timeout: float | None = None, connect: bool = True,
                 watchdog: Watchdog = WATCHDOG,
                 fate: Callable[[Sequence[int]], frozenset[int]] | None = None,
                 startup: float = 0.0):
        members = tuple(int(m) for m in members)
        if membership.rank not in members or len(set(members)) != len(members):
            raise ValueError(f"group {name!r}: members {members} must be distinct and include this "
                             f"rank {membership.rank}")
        # torch's binding takes (rank, size) too; its stub names only the form with a store
        super().__init__(members.index(membership.rank), len(members))  # type: ignore[call-arg]
        self.label = name  # not `name`: torch's ProcessGroup.name() is a method
        self.members, self.membership = members, membership
        # start-up (the first connects, the first iteration) may take `startup` where that is
        # longer; `settle()` brings every bound down to T (timeout) once it is over
        self._settled = (timeout, build_timeout)
        self._bound(max(timeout, startup), max(build_timeout, startup))
        self.verdict_timeout = (verdict_timeout if verdict_timeout is not None else
                                membership.heartbeat_timeout + 2 * membership.heartbeat_interval)
        self.backend_kind, self._kind = backend, backends.kind_of(backend)
        # host_waits: gloo blocks in wait(); else (NCCL) a stream wait that `watchdog` bounds
        self.watchdog, self.host_waits = watchdog, self._kind.host_waits
        self.before_op: Callable[[str], None] | None = None  # fault-injection hook
        self._cond, self._inner, self._epoch = threading.Condition(), None, -1
        self._dead_at_build: frozenset[int] = frozenset()
        # Whose death ends the backend: its members, or (ReCoVer's groups) their replicas, whose
        # survivors leave every group when their replica breaks. gloo tells the other members
        # in milliseconds that they left; NCCL never does, so the epoch must.
        self._fate = fate if fate is not None and not self.host_waits else frozenset
        self._failure: PeerFailure | None = None
        self._latched: PeerFailure | None = None  # the watchdog's, for raise_latched()
        self._ops: set[_Op] = set()  # issued, not yet waited
        # the last operations issued, and those a break of the backend cut short (NCCL: their
        # waits had returned, and what ran after them read what the abort left): `broke`
        self._recent: deque[str] = deque(maxlen=64)
        self._cut_short: set[str] = set()
        self._sequence = 0  # operations issued on the backend (NCCL's SeqNum), named on a failure
        self._attempts: dict[tuple[int, str], int] = {}
        self._prefix = ""  # the rendezvous that built the backend: names it to every member
        self._left = departures.probe(membership.store, "")  # its departures (one per backend)
        self._parent: Retired | None = None  # a backend kept aside to shrink (NCCL)
        membership.add_listener(self._on_epoch)
        if connect:
            self.rebuild(membership.epoch(), members)
        else:  # a spare's group: no backend until the join rebuilds it with the others
            self._failure = PeerFailure(-1, (), f"{name}.join", "not joined yet", confirmed=False)
            self._register()

    def set_before_op(self, hook: Callable[[str], None]) -> None:
        """Fault injection: `hook(op)` runs before each of this group's operations."""
        self.before_op = hook

    # --- what torch and megatron ask of a group --------------------------------------------
    def rank(self) -> int:
        return self.members.index(self.membership.rank)

    def size(self) -> int:
        return len(self.members)

    def getBackendName(self) -> str:
        return self.backend_kind

    @property
    def group_name(self) -> GroupName:
        return GroupName(self.label)

    @property
    def epoch(self) -> int:
        return self._epoch

    def __repr__(self) -> str:
        return f"ResilientProcessGroup({self.label!r}, members={self.members}, epoch={self._epoch})"

    # --- lifecycle --------------------------------------------------------------------------
    def settle(self) -> None:
        """Start-up is over: operations, rebuilds and the coordinator's store answers are
        bounded by T from now on."""
        self.membership.settle()
        self._bound(*self._settled)
        inner = self._inner
        if inner is not None and self.host_waits:
            inner.set_timeout(self._p2p_timeout)  # gloo's own cancellation

    def _bound(self, timeout: float, build_timeout: float) -> None:
        self.timeout, self.build_timeout = timeout, build_timeout
        self._p2p_timeout = timedelta(seconds=timeout)

    def rebuild(self, epoch: int, members: Sequence[int], key: str = "") -> None:
        """A new backend for `members` in `epoch` (every member calls this alike); PeerFailure if
        an epoch declares a member dead meanwhile or a member never shows up."""
        self.apply(self.meet(epoch, members, key, force=True))

    def regroup(self, epoch: int, members: Sequence[int], key: str = "") -> str:
        """`rebuild` unless the members keep the backend: 'kept', 'shrunk' or 'rebuilt' (alike)."""
        return self.apply(self.meet(epoch, members, key))

    @property
    def dirty(self) -> bool:
        """This member cannot vouch for the backend's sequence: gone, broken, or an op unwaited."""
        with self._cond:
            return (self._inner is None or self._failure is not None
                    or self._latched is not None or bool(self._ops))

    def meet(self, epoch: int, members: Sequence[int], key: str = "", force: bool = False,
             fate: Sequence[int] = ()) -> Regroup:
        """Step 1 of a regroup: meet the other members and decide with them (store only). An
        epoch after `epoch` that declares a member dead ends it, or a rank of `fate` (the ranks
        whose death makes the meeting pointless: a broken replica's members leave)."""
        members = tuple(int(m) for m in members)
        watched = (*members, *fate)
        if self.membership.rank not in members:
            raise ValueError(f"group {self.label!r}: rank {self.membership.rank} rebuilt without itself")
        current, dead = self.membership.view()
        if current < epoch:
            self.membership.wait_for_epoch_after(epoch - 1, self.verdict_timeout)
            current, dead = self.membership.view()
        if self._kills_a_member(epoch, watched):  # every survivor retries with that epoch
            raise PeerFailure(epoch, dead - self._dead_at_build, f"{self.label}.rebuild",
                              f"epoch {current} already started and declared a member dead")
        dirty = force or self.dirty or members != self.members or bool(dead & set(self.members))
        parent = self._parent.prefix if self._parent is not None and \
            self._parent.shrinks_to(members) else None
        attempt = self._attempts.get((epoch, key), 0)
        self._attempts[(epoch, key)] = attempt + 1
        prefix = f"pg/{self.label}/e{epoch}/{key}.{attempt}/"
        with self._cond:
            self._epoch, self._dead_at_build = epoch, dead
        try:
            meeting = rendezvous.meet(
                self.membership.store, prefix, self.membership.rank, members, self.build_timeout,
                dirty=dirty, parent=parent, issued=self._sequence,
                newer_epoch=lambda: self._kills_a_member(epoch, watched))
        except rendezvous.NewerEpoch:  # nothing is decided: a clean backend stays clean
            raise PeerFailure(epoch, self.membership.dead_ranks() - dead, f"{self.label}.rebuild",
                              "an epoch declared a member dead during the rendezvous") from None
        except rendezvous.MembersMissing as e:
            raise PeerFailure(epoch, e.missing, f"{self.label}.rebuild", str(e),
                              confirmed=False) from None
        return Regroup(epoch, members, prefix, meeting)

    def apply(self, plan: Regroup) -> str:
        """Step 2: keep, shrink or re-create the backend as the meeting decided."""
        if not plan.meeting.rebuild:
            return "kept"
        retired, self._parent = self._parent, None
        self._discard()
        try:
            if plan.meeting.shrink and retired is not None:
                excluded = [i for i, m in enumerate(retired.members) if m not in plan.members]
                inner = backends.shrink(self.backend_kind, retired.backend, excluded,
                                        self.timeout)
            else:
                inner = backends.build(self.backend_kind, self.membership.backend_store,
                                       plan.prefix + "backend/",
                                       plan.members.index(self.membership.rank),
                                       len(plan.members), self.build_timeout, self.timeout)
        except RuntimeError as e:  # a member vanished between the rendezvous and the connect
            raise PeerFailure(plan.epoch, (), f"{self.label}.rebuild",
                              f"backend set-up failed: {e}", confirmed=False) from e
        finally:
            if retired is not None:
                backends.discard(retired.backend, [])
        with self._cond:
            self._inner, self._failure, self._latched = inner, None, None
            self.members, self._prefix = plan.members, plan.prefix
            self._cut_short, self._sequence = set(), 0
            self._left = departures.probe(self.membership.store, plan.prefix)
        self._register()
        if self._kills_a_member(plan.epoch, plan.members):  # while we were connecting
            raise self._fail("rebuild", "a newer epoch declared a member dead during the rebuild")
        return "shrunk" if plan.meeting.shrink and retired is not None else "rebuilt"

    def shutdown(self) -> None:
        """Stop using this group: discard the backend, forget the listener and the registration."""
        self.membership.remove_listener(self._on_epoch)
        retired, self._parent = self._parent, None
        if retired is not None:
            backends.discard(retired.backend, [])
        self._discard(PeerFailure(self._epoch, (), f"{self.label}.shutdown", "group was shut down",
                                  confirmed=False))
        registry.unregister(self)

    abort = shutdown
    # --- internals --------------------------------------------------------------------------
    def _register(self) -> None:
        registry.register(self, self.backend_kind, self.membership.backend_store, self.members)

    def _issue(self, op: str, start, peer: int | None = None):
        if self.before_op is not None:
            self.before_op(op)
        self.membership.mark(self.label)  # the coordinator must not take a waiter for stuck
        inner, failure = self._inner, self._failure
        if failure is not None:
            raise PeerFailure(failure.epoch, failure.suspects, f"{self.label}.{op}",
                              f"group broken by an earlier failure ({failure.op}); rebuild() it",
                              failure.confirmed)
        if inner is None or (self.membership.epoch() > self._epoch and self._stale()):
            raise self._fail(op, "the group's epoch is over", peer)
        ready = None if self.host_waits else self._kind.ready_probe()
        self._recent.append(op)
        self._sequence += 1
        try:  # no work: it ran in stream order (NCCL, async_op=False); watch the stream instead
            work = start(inner) or self._kind.stream_work()
        except RuntimeError as e:
            raise self._fail(op, short_cause(e), peer) from e
        if not self.host_waits:  # one lane per stream: collectives, and p2p per peer; the work
            work = None if work is None else device_events.owned(work)  # dies on this thread
            self.watchdog.track(inner, work, self.timeout, lambda reason, n=self._sequence:
                                self._expire(inner, op, peer, f"{reason} (operation {n})"),
                                lane=peer, ready=ready, left=self._left)
        issued = _Op(work)
        del work
        with self._cond:
            self._ops.add(issued)
        outcome: list[PeerFailure] = []

        def wait(_timeout) -> bool:
            if outcome:  # waited before and failed: the same failure again
                raise outcome[0]
            self.membership.mark(self.label)
            work = issued.work
            if work is None:  # the group broke before anyone waited: the backend is gone
                outcome.append(self._fail(op, "aborted: the group broke first", peer))
                raise outcome[0]
            try:
                if peer is not None and self.host_waits:
                    work.wait(self._p2p_timeout)  # an untimed one lasts the connect timeout
                else:
                    work.wait()
            except RuntimeError as e:
                outcome.append(self._fail(op, short_cause(e), peer))
                raise outcome[0] from e
            finally:
                issued.work = None
                del work
                with self._cond:
                    self._ops.discard(issued)
            return True
        return PythonCallbackWork(wait)

    def broke(self, op: str) -> bool:
        """A break of the current backend cut an `op` operation short (NCCL: what ran after it
        may have read what the abort left; gloo raises where the operation is waited)."""
        return op in self._cut_short

    def stream_event(self) -> Callable[[], bool] | None:
        """An event recorded now on the current stream (its query), or None where wait() blocks
        the host (gloo): nothing is left to wait for."""
        return None if self.host_waits else self._kind.ready_probe()

    def raise_latched(self) -> None:
        """Raise the failure the watchdog latched for an operation whose wait() had returned
        (NCCL): called before the commit, so no rank votes for a reduction that never ended."""
        if self._latched is not None:
            raise self._latched

    def _expire(self, inner, op: str, peer: int | None, reason: str) -> None:
        """Watchdog thread: `inner`'s operation failed or is overdue. Abort that backend (its
        stuck kernels end) and latch the failure; the coordinator's verdict will name the dead."""
        with self._cond:  # issued on a backend as it was set aside, and stuck: no shrink then
            current, parent = self._inner is inner, self._parent
            self._parent = None if parent is not None and parent.backend is inner else parent
        if parent is not None and parent.backend is inner:
            backends.discard(inner, [])
        if not current:
            return  # an old backend's late news: the group has moved on
        self._cut_short.add(op)
        guess = {peer} if peer is not None else set(self.members) - {self.membership.rank}
        failure = PeerFailure(self._epoch, guess, f"{self.label}.{op}", reason, confirmed=False)
        # latched before the abort: an aborted operation ends its stream's wait, and a commit
        # reading after that must find the failure, never vote for what the abort cut short
        self._latched = failure
        try:
            self.membership.report_failure(guess, f"{self.label}.{op}: {reason}")
        except RuntimeError:
            pass  # coordinator gone: the failure is latched all the same
        self._discard(failure)

    def _fail(self, op: str, detail: str, peer: int | None = None) -> PeerFailure:
        """Break the group at once (peers blocked on it then fail in milliseconds), then name the
        culprit, waiting up to `verdict_timeout` for the coordinator's verdict."""
        epoch = self._epoch
        self._discard()
        guess = {peer} if peer is not None else set(self.members) - {self.membership.rank}
        if self.membership.epoch() <= epoch:
            self.membership.report_failure(guess, f"{self.label}.{op}: {detail}")
            try:
                self.membership.wait_for_epoch_after(epoch, self.verdict_timeout)
            except MembershipTimeout:
                pass
        newly_dead = self.membership.dead_ranks() - self._dead_at_build
        if newly_dead:
            failure = PeerFailure(epoch, (newly_dead & set(self.members)) or newly_dead,
                                  f"{self.label}.{op}", detail)
        else:
            failure = PeerFailure(epoch, guess, f"{self.label}.{op}", detail, confirmed=False)
        with self._cond:
            if self._failure is None and self._inner is None:
                self._failure = failure
        return failure

    def abandon(self, reason: str) -> None:
        """Layer 2 stops using this backend (recovery starts): peers blocked on it fail fast and
        any later operation raises PeerFailure until `rebuild()`."""
        self._discard(PeerFailure(self._epoch, (), f"{self.label}.abandon", reason, confirmed=False))

    def _discard(self, failure: PeerFailure | None = None, retire: bool = False) -> None:
        """Stop using the backend. `retire` (an epoch declared a member dead): where it can
        shrink, set it aside for the survivors' regroup instead of aborting it."""
        with self._cond:
            inner, self._inner = self._inner, None
            if failure is not None and self._failure is None:
                self._failure = failure
            for issued in self._ops:
                issued.work = None
            self._ops.clear()
        if inner is None:
            return
        if not self.host_waits:  # NCCL tells no member that this one stopped: the store does
            departures.announce(self.membership.store, self._prefix)
        # Set aside only an idle backend: a work in flight with a dead member never ends, and
        # the compute stream waits for it, so every host read would hang until the shrink (H200)
        unfinished = self.watchdog.forget(inner)  # the last ones issued that had not succeeded
        self._cut_short.update(list(self._recent)[-unfinished:] if unfinished else ())
        if unfinished == 0 and retire and backends.can_shrink(inner):
            self._parent = Retired(inner, self.members, self._prefix)
        else:
            backends.discard(inner, [])

    def _kills_a_member(self, epoch: int, members: Sequence[int]) -> bool:
        """Only an epoch after `epoch` that declares one of `members` dead ends a rebuild; any
        other (a replica growing back) ended on just the members that saw it first would leave
        the rest waiting for them at their next group."""
        current, dead = self.membership.view()
        return current > epoch and bool(dead & set(members))

    def _ends_backend(self, dead: frozenset[int]) -> frozenset[int]:
        """The newly dead whose death ends the current backend (see `fate`)."""
        return (dead - self._dead_at_build) & self._fate(self.members)

    def _stale(self) -> bool:
        """A newer epoch ended the backend (adopting harmless epochs on the way)."""
        current, dead = self.membership.view()
        if current > self._epoch and self._ends_backend(dead):
            return True
        self._adopt(*self.membership.view())
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
        if lost := self._ends_backend(dead):
            if not self.host_waits:  # a work whose wait() returned may be cut short: say so
                self._latched = PeerFailure(epoch, lost, f"{self.label}.epoch",
                                            f"epoch {epoch} declared {sorted(lost)} dead")
            self._discard(retire=True)
        else:
            self._adopt(epoch, dead)
