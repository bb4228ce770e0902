"""What the coordinator believes about every slot: pure bookkeeping, no I/O (design.md §6, §11).

A rank number is a *slot* (its place in the TP x PP x DP layout); the process holding it is an
*incarnation* (0 = the one started with the job). A slot's process comes back in one of two ways:
  * its launcher starts a replacement (incarnation k + 1, `launch --max-replacements`);
  * a *standby* process (a standby node's launcher, `launch --standby`) is given the slot. The
    coordinator gives a dead slot to a standby only when no local replacement is coming: the
    launcher reported the exit without one, or no exit was reported within `standby_grace` of the
    death being published (the node is gone with its launcher). The standby then has
    `register_timeout` to register with the incarnation it was given; otherwise the slot goes to
    the next standby (a standby node may die too).
Either way the new process registers, reports as a spare, and a *grow epoch* makes the slots of a
replica members again once every one of them has a waiting process.

Who holds the training state: a *unit* (a replica, or with expert parallelism the replicas that
share their experts) whose slots are all members, none of them brought back by a grow that has
not yet handed it the state (`stateless`, until the slot reports `joined`). Each rank names its
unit's slots when it registers. A grow needs such a unit to give the state, and so does a
standby's slot; with none left the job is stopped (`stopped_reason`), after `stop_grace`, so a
`joined` report posted just before a donor's death still counts.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from recover_patches.collectives.protocol import SLOT_TAKEN


@dataclass(frozen=True)
class Reservation:
    """A dead slot given to a standby process, which must register as `incarnation` by `deadline`."""
    standby: str
    incarnation: int
    deadline: float


@dataclass
class MembershipState:
    """The coordinator's view of every slot (see the module docstring)."""

    world_size: int
    standby_grace: float = 2.0
    register_timeout: float = 20.0
    clock: Callable[[], float] = time.monotonic
    epoch: int = 0
    dead: set[int] = field(default_factory=set)        # slots without a member, published
    pending_dead: dict[int, str] = field(default_factory=dict)  # rank -> reason, not yet published
    gone: set[int] = field(default_factory=set)        # left cleanly / exited after completion
    exited: set[int] = field(default_factory=set)      # the slot's current incarnation exited
    completed_at: int | None = None
    incarnation: dict[int, int] = field(default_factory=dict)  # slot -> registered incarnation
    dead_incarnation: dict[int, int] = field(default_factory=dict)  # dead slot -> who died
    spares: dict[int, tuple[int, ...]] = field(default_factory=dict)  # waiting -> its replica
    joining: tuple[int, ...] = ()  # slots the last published epoch brought back
    standbys: list[str] = field(default_factory=list)  # standby processes waiting, oldest first
    reserved: dict[int, Reservation] = field(default_factory=dict)  # dead slot -> its standby
    dead_at: dict[int, float] = field(default_factory=dict)  # dead slot -> when it may be given away
    # (slot, dead incarnation) -> whether its launcher said it starts a replacement
    exit_replacing: dict[tuple[int, int], bool] = field(default_factory=dict)
    issued: dict[int, int] = field(default_factory=dict)  # slot -> highest incarnation handed out
    given_to_standby: set[int] = field(default_factory=set)  # slots a standby was ever given
    grants: dict[int, tuple[str, int]] = field(default_factory=dict)  # slot -> latest standby's
    units: dict[int, tuple[int, ...]] = field(default_factory=dict)  # slot -> its unit's slots
    stateless: set[int] = field(default_factory=set)  # grown back, the state not yet received
    stop_grace: float = 1.0  # seconds without a unit holding the state before the job stops
    released: dict[str, float] = field(default_factory=dict)  # standbys sent home -> when
    had_standbys: bool = False  # standby nodes took part: they read the end after the ranks
    _no_holder_since: float | None = None
    _unit_set: set[tuple[int, ...]] = field(default_factory=set)  # the units ranks named
    _units_of_slot: dict[int, set[tuple[int, ...]]] = field(default_factory=dict)

    def refuse_reason(self, rank: int, incarnation: int = 0,
                      standby: str | None = None) -> str | None:
        """Why a process may not register for `rank` (None: it may). `standby` names a standby
        process that was given the slot; a launcher's replacement has none."""
        if not 0 <= rank < self.world_size:
            return f"rank {rank} is outside the job's world size {self.world_size}"
        current = self.incarnation.get(rank, 0)
        reservation = self.reserved.get(rank)
        if reservation is not None and (standby, incarnation) != (reservation.standby,
                                                                   reservation.incarnation):
            return (f"{SLOT_TAKEN} rank {rank} was given to standby process {reservation.standby} "
                    f"(incarnation {reservation.incarnation})")
        if incarnation > current:
            return None  # a replacement for a process its launcher saw end
        if rank in self.given_to_standby:  # a local replacement numbered before the standby's
            return f"{SLOT_TAKEN} rank {rank} was given to a standby process"
        if rank in self.dead or rank in self.pending_dead:
            return f"rank {rank} was declared dead in this job and cannot rejoin"
        if incarnation < current:
            return f"rank {rank} incarnation {incarnation} was replaced by incarnation {current}"
        return None

    def note_unit(self, rank: int, unit: Iterable[int]) -> None:
        """The slots whose death breaks `rank`'s replica (its own included), as it registered."""
        if unit:
            self.units[rank] = tuple(sorted(unit))
            for slot in unit:
                self._units_of_slot.setdefault(slot, set()).add(self.units[rank])
            self._unit_set.add(self.units[rank])

    def on_register(self, rank: int, incarnation: int) -> None:
        current = self.incarnation.get(rank, 0)
        if incarnation > current:
            if rank not in self.dead:  # its launcher replaced it: the old one is gone for sure
                self.mark_dead(rank, f"replaced by incarnation {incarnation}")
            self.incarnation[rank] = incarnation
            self.issued[rank] = max(self.issued.get(rank, 0), incarnation)
            self.reserved.pop(rank, None)
            self.exited.discard(rank)
            self.gone.discard(rank)

    def is_member(self, rank: int) -> bool:
        """The slot's current process trains now: not dead, gone, exited, nor waiting as a spare."""
        return not (rank in self.dead or rank in self.pending_dead or rank in self.gone
                    or rank in self.exited or rank in self.spares)

    def _is_member_slot(self, rank: int) -> bool:
        """The slot's current incarnation is (or was) a member, not a waiting replacement."""
        return rank not in self.dead and rank not in self.pending_dead

    def mark_dead(self, rank: int, reason: str) -> None:
        self.spares.pop(rank, None)
        if rank in self.dead:
            self._reopen(rank)
        elif rank not in self.gone and rank not in self.pending_dead:
            self.pending_dead[rank] = reason

    def _reopen(self, rank: int) -> None:
        """A dead slot's registered replacement died while waiting: the slot is open again."""
        current = self.incarnation.get(rank, 0)
        if current > self.dead_incarnation.get(rank, 0):
            self.dead_incarnation[rank] = current
            self.dead_at[rank] = self.clock()

    def on_exit(self, rank: int, code: int, incarnation: int = 0, replacing: bool = False) -> None:
        current = self.incarnation.get(rank, 0)
        if incarnation > current:  # a replacement that died before registering
            self.exit_replacing[(rank, current)] = replacing
            return
        if incarnation != current:
            return  # a replaced incarnation's late report
        self.exit_replacing[(rank, current)] = replacing
        self.exited.add(rank)
        self.spares.pop(rank, None)
        if rank in self.dead:
            self._reopen(rank)
        if rank in self.gone or not self._is_member_slot(rank):
            return
        if self.completed_at is not None:
            self.gone.add(rank)
        else:
            self.mark_dead(rank, f"process exited ({'signal ' + str(-code) if code < 0 else 'code ' + str(code)})")

    def on_leave(self, rank: int) -> None:
        self.spares.pop(rank, None)
        if rank not in self.dead:
            self.gone.add(rank)

    def on_spare(self, rank: int, incarnation: int, replica_slots: tuple[int, ...]) -> None:
        if incarnation == self.incarnation.get(rank, 0) and rank not in self.exited:
            self.spares[rank] = tuple(sorted(replica_slots))

    def on_joined(self, rank: int, incarnation: int) -> None:
        """A slot a grow brought back received the state: its unit can hold the job again."""
        if incarnation == self.incarnation.get(rank, 0):
            self.stateless.discard(rank)

    def holders(self) -> list[tuple[int, ...]]:
        """The units holding the training state: every slot a member, none waiting for the
        state a grow brings. A slot registered without its unit counts as a unit alone."""
        members = set(self.members_alive())
        units = {self.units.get(r, (r,)) for r in members}
        return sorted(u for u in units if all(s in members and s not in self.stateless for s in u))

    def next_epoch(self) -> tuple[int, str] | None:
        """Publishable epoch if deaths are pending: (epoch number, reason)."""
        if not self.pending_dead:
            return None
        reason = "; ".join(f"rank {r}: {why}" for r, why in sorted(self.pending_dead.items()))
        for r in self.pending_dead:
            self.dead_incarnation[r] = self.incarnation.get(r, 0)
            self.dead_at[r] = self.clock()
        self.dead |= set(self.pending_dead)
        self.pending_dead.clear()
        self.joining = ()
        self.epoch += 1
        return self.epoch, reason

    def _not_members(self) -> set[int]:
        """The slots that are not members now: few, next to the world (the failed ones)."""
        return self.dead | set(self.pending_dead) | self.gone | self.exited | set(self.spares)

    def holds_state(self) -> bool:
        """Whether some unit holds the state (`holders`), from the few slots that are not
        members or not holding yet: the coordinator asks every tick, at 100,000 ranks too."""
        bad = self._not_members() | self.stateless
        alone = self.world_size - len(self.units)  # slots that named no unit: one each
        if alone - sum(1 for s in bad if s not in self.units) > 0:
            return True
        broken = set().union(*(self._units_of_slot.get(s, ()) for s in bad))
        return len(self._unit_set - broken) > 0

    def members_alive(self) -> list[int]:
        """Ranks that may still be training (not dead, gone, exited, nor waiting as spares)."""
        out = self.dead | set(self.pending_dead) | self.gone | self.exited | set(self.spares)
        return [r for r in range(self.world_size) if r not in out]

    def stopped_reason(self) -> str | None:
        """Why the job can no longer go on before completing: every rank and standby ends then.
        No member is left, or no unit has held the state for `stop_grace` (deaths pending are
        published first)."""
        if self.completed_at is not None or self.pending_dead:
            return None
        if len(self._not_members()) >= self.world_size:
            return "no live replica is left to re-form replicas with"
        if self.holds_state():
            self._no_holder_since = None
            return None
        now = self.clock()
        if self._no_holder_since is None:
            self._no_holder_since = now
        if now - self._no_holder_since < self.stop_grace:
            return None
        return ("no complete replica holds the training state (ranks "
                f"{self.members_alive()} are left of broken replicas or still joining)")

    def next_grow(self) -> tuple[int, str] | None:
        """A grow epoch once every slot of some replica has a waiting process: those slots are
        members again. Never while deaths are pending (they go first), nor without a live
        unit holding the state to hand it over."""
        if self.pending_dead or self.completed_at is not None or not self.holds_state():
            return None
        ready = sorted({slots for slots in self.spares.values()
                        if all(self.spares.get(s) == slots for s in slots)})
        if not ready:
            return None
        joining = tuple(sorted(s for slots in ready for s in slots))
        for s in joining:
            self.spares.pop(s)
            self.dead.discard(s)
            self.dead_incarnation.pop(s, None)
            self.dead_at.pop(s, None)
        self.joining = joining
        self.stateless |= set(joining)
        self.epoch += 1
        return self.epoch, "grow: " + "; ".join(f"ranks {list(slots)} re-form a replica"
                                                for slots in ready)

    def finished(self) -> bool:
        """Every slot's latest incarnation exited, or died with no newer one registered, and
        every standby sent home has exited (its launcher said so; a standby node that never
        says, gone with its launcher, is done after `register_timeout`)."""
        if len(self.exited) + len(self.dead) < self.world_size:
            return False  # (the common answer, without a pass over the world)
        now = self.clock()
        return all(r in self.exited or (r in self.dead and r not in self.reserved
                                        and self.dead_incarnation.get(r, 0)
                                        >= self.incarnation.get(r, 0))
                   for r in range(self.world_size)) and \
            all(now - at > self.register_timeout for at in self.released.values())

    # --- standby processes --------------------------------------------------------------------
    def on_standby(self, standby: str) -> tuple[int, int] | None:
        """A standby waits. Returns (slot, incarnation) when a slot is already reserved for it:
        the answer was lost with an earlier coordinator and must be sent again."""
        for slot, reservation in self.reserved.items():
            if reservation.standby == standby:
                return slot, reservation.incarnation
        self.had_standbys = True
        if standby not in self.standbys:
            self.standbys.append(standby)
        return None

    def grant_record(self) -> list[list]:
        """Every slot's latest grant to a standby, [slot, standby, incarnation]: what an elected
        coordinator journals before the standby hears of it."""
        return [[slot, standby, k] for slot, (standby, k) in sorted(self.grants.items())]

    def restore_grants(self, record: list[list]) -> None:
        """A successor adopts its predecessor's grants (after the journal's epoch): it never
        gives a slot twice, and a standby that did not register yet still finds its slot."""
        now = self.clock()
        for slot, standby, incarnation in record:
            self.grants[slot] = (standby, incarnation)
            self.given_to_standby.add(slot)
            self.issued[slot] = max(self.issued.get(slot, 0), incarnation)
            if slot in self.dead and incarnation > self.dead_incarnation.get(slot, 0):
                self.reserved[slot] = Reservation(standby, incarnation, now + self.register_timeout)

    def on_standby_exit(self, standby: str) -> None:
        if standby in self.standbys:
            self.standbys.remove(standby)
        self.released.pop(standby, None)

    def _orphaned(self, slot: int, now: float) -> bool:
        """A dead slot no process is coming back to unless a standby takes it."""
        dead_incarnation = self.dead_incarnation.get(slot, 0)
        if slot in self.reserved or self.incarnation.get(slot, 0) > dead_incarnation:
            return False  # given to a standby already, or a replacement registered
        replacing = self.exit_replacing.get((slot, dead_incarnation))
        if replacing is None:  # no word from its launcher: gone with its node, or about to report
            return now >= self.dead_at.get(slot, now) + self.standby_grace
        return not replacing

    def assign_standbys(self, silent: frozenset[str] = frozenset()
                        ) -> list[tuple[str, int, int]]:
        """Give orphaned dead slots to waiting standbys: [(standby, slot, incarnation)]. Slots
        whose replica already has waiting spares go first (they re-form a replica soonest).
        `silent`: standbys whose node fell silent (lost with its launcher): none is given a
        slot, and a slot given to one that has not registered goes to the next standby now,
        not `register_timeout` later (they stay listed, to be sent home if they were not lost)."""
        now = self.clock()
        for slot, reservation in list(self.reserved.items()):
            if now > reservation.deadline or reservation.standby in silent:
                del self.reserved[slot]  # never registered: its node may be gone too
                self.dead_at[slot] = now - self.standby_grace
        ready = [s for s in self.standbys if s not in silent]
        if self.pending_dead or self.completed_at is not None or not ready \
                or not self.holds_state():  # nobody could hand a joining replica the state
            return []
        waiting_replicas = {s for slots in self.spares.values() for s in slots}
        orphans = sorted((s for s in self.dead if self._orphaned(s, now)),
                         key=lambda s: (s not in waiting_replicas, s))
        given = []
        for slot, standby in zip(orphans, ready):
            self.standbys.remove(standby)
            incarnation = max(self.issued.get(slot, 0), self.dead_incarnation.get(slot, 0)) + 1
            self.issued[slot] = incarnation
            self.reserved[slot] = Reservation(standby, incarnation, now + self.register_timeout)
            self.given_to_standby.add(slot)
            self.grants[slot] = (standby, incarnation)
            given.append((standby, slot, incarnation))
        return given

    def release_standbys(self) -> list[str]:
        """Standbys to send home: the job completed or stopped, so none will ever get a slot."""
        if self.completed_at is None and self.stopped_reason() is None:
            return []
        released, self.standbys = self.standbys, []
        self.released.update((standby, self.clock()) for standby in released)
        return released

    def record(self, epoch: int, reason: str) -> dict:
        return {"epoch": epoch, "dead": sorted(self.dead), "reason": reason,
                "dead_incarnations": {str(r): k for r, k in sorted(self.dead_incarnation.items()) if k},
                "joining": list(self.joining),
                "joining_incarnations": {str(r): self.incarnation.get(r, 0) for r in self.joining}}
