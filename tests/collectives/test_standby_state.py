"""Which dead slot goes to which standby process, and when (pure rules, a fake clock)."""
from __future__ import annotations

from recover_patches.collectives.membership_state import MembershipState
from recover_patches.collectives.protocol import SLOT_TAKEN


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def state(world_size: int = 4) -> tuple[MembershipState, Clock]:
    clock = Clock()
    return MembershipState(world_size, standby_grace=2.0, register_timeout=20.0, clock=clock), clock


def test_a_slot_goes_to_a_standby_only_when_no_local_replacement_comes():
    s, _ = state()
    s.on_standby("9.0.0")
    s.on_exit(1, -9, incarnation=0, replacing=True)   # its launcher starts a replacement
    s.on_exit(2, -9, incarnation=0, replacing=False)  # its launcher has none left
    s.next_epoch()
    assert s.assign_standbys() == [("9.0.0", 2, 1)]
    assert s.standbys == [] and set(s.reserved) == {2}
    s.on_standby("9.1.0")
    assert s.assign_standbys() == []  # rank 1's replacement is on its way: not given away


def test_a_lost_nodes_slots_are_given_away_after_the_grace_and_waiting_replicas_go_first():
    s, clock = state(world_size=6)  # ranks 4 and 5 live on: they hand over the state
    for standby in ("9.0.0", "9.1.0"):
        s.on_standby(standby)
    for rank in (1, 2, 3):  # no exit reports: the node went with its launcher
        s.mark_dead(rank, "no heartbeat")
    s.next_epoch()
    s.on_spare(0, 0, (0, 3))  # rank 0 survived; its replica lacks rank 3
    clock.now += 1.0
    assert s.assign_standbys() == []  # the launcher may still report a replacement
    clock.now += 1.5
    assert s.assign_standbys() == [("9.0.0", 3, 1), ("9.1.0", 1, 1)]
    assert s.refuse_reason(3, 1, standby="9.0.0") is None      # the standby registers
    assert s.refuse_reason(1, 1, standby="9.0.0").startswith(SLOT_TAKEN)  # not given this one
    assert s.refuse_reason(1, 1, standby="9.1.0") is None
    assert s.refuse_reason(2, incarnation=1) is None  # nobody holds rank 2: anyone may
    s.on_register(3, 1)
    s.on_spare(3, 1, (0, 3))
    assert s.next_grow() == (2, "grow: ranks [0, 3] re-form a replica")
    assert s.record(2, "")["joining_incarnations"] == {"0": 0, "3": 1}


def test_a_late_local_replacement_finds_the_slot_taken():
    s, clock = state()
    s.on_standby("9.0.0")
    s.mark_dead(2, "no heartbeat")
    s.next_epoch()
    clock.now += 3.0
    assert s.assign_standbys() == [("9.0.0", 2, 1)]
    # the node's launcher, alive after all, starts its replacement: the same number, no name
    assert s.refuse_reason(2, incarnation=1).startswith(SLOT_TAKEN)
    assert s.refuse_reason(2, 1, standby="9.0.0") is None  # the standby's own registration
    s.on_register(2, 1)
    assert s.refuse_reason(2, incarnation=1).startswith(SLOT_TAKEN)  # also once it registered


def test_a_standby_that_never_registers_loses_the_slot_to_the_next_one():
    s, clock = state()
    for standby in ("9.0.0", "9.1.0"):
        s.on_standby(standby)
    s.on_exit(2, -9, replacing=False)
    s.next_epoch()
    assert s.assign_standbys() == [("9.0.0", 2, 1)]
    assert not s.finished()  # a standby is on its way to the slot
    clock.now += 21.0
    assert s.assign_standbys() == [("9.1.0", 2, 2)]  # a new incarnation: the first is refused
    assert s.refuse_reason(2, 1, standby="9.0.0").startswith(SLOT_TAKEN)
    s.on_register(2, 2)
    assert s.reserved == {}


def test_a_standby_whose_node_fell_silent_gets_no_slot_and_loses_the_one_it_was_given():
    """Found by scripts/chaos.py: a node fault killed a standby node whose first process had
    just taken a slot; the coordinator gave the next dead slots to that node's other, dead,
    standby processes, and the replicas waited register_timeout (20 s) for them. A standby
    whose node's line stopped (`silent`) is passed over, and a slot given to one that has not
    registered goes to the next standby at once. Control: without `silent`, the dead one is
    given the slot."""
    s, clock = state()
    for standby in ("3.1", "3.2", "4.0"):
        s.on_standby(standby)
    s.on_exit(2, -9, replacing=False)
    s.next_epoch()
    assert s.assign_standbys() == [("3.1", 2, 1)]
    clock.now += 1.0
    assert s.assign_standbys(frozenset({"3.1", "3.2"})) == [("4.0", 2, 2)]  # at once
    assert s.standbys == ["3.2"]  # still listed: sent home at the end if it was not lost
    control, _ = state()
    for standby in ("3.2", "4.0"):
        control.on_standby(standby)
    control.on_exit(2, -9, replacing=False)
    control.next_epoch()
    assert control.assign_standbys() == [("3.2", 2, 1)]
    from recover_patches.collectives.node_beats import node_name, standby_node
    assert standby_node("3.1") == node_name(3, standby=True) == "standby-3"


def test_a_replacement_that_dies_while_waiting_opens_its_slot_again():
    s, _ = state()
    s.on_exit(2, -9, replacing=True)
    s.next_epoch()
    s.on_register(2, 1)  # the local replacement
    s.on_spare(2, 1, (2,))
    s.on_standby("9.0.0")
    assert s.assign_standbys() == []
    s.on_exit(2, -9, incarnation=1, replacing=False)  # it dies before its replica is re-formed
    assert s.assign_standbys() == [("9.0.0", 2, 2)] and 2 not in s.spares


def test_waiting_standbys_are_sent_home_when_the_job_completes_or_stops():
    s, _ = state(world_size=2)
    s.on_standby("9.0.0")
    assert s.release_standbys() == []
    s.completed_at = s.epoch
    assert s.release_standbys() == ["9.0.0"] and s.standbys == []
    stopped, _ = state(world_size=2)
    stopped.on_standby("9.0.0")
    stopped.on_standby("9.1.0")
    stopped.on_standby_exit("9.1.0")  # ended before it got a slot
    for rank in (0, 1):
        stopped.on_exit(rank, 3)
    stopped.next_epoch()
    assert stopped.assign_standbys() == []  # no live member could hand over the state
    assert stopped.release_standbys() == ["9.0.0"]
