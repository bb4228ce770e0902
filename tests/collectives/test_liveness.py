"""The coordinator's verdicts from heartbeats and progress, on a fake clock (no processes)."""
from __future__ import annotations

from recover_patches.collectives.liveness import Liveness
from recover_patches.collectives.node_beats import NodeBeatLine, RankAges, format_line, parse_lines
from recover_patches.collectives.timeouts import Timeouts


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def watched(*ranks: int, stall: float = 5.0, expiry: float = 7.0) -> tuple[Liveness, Clock]:
    clock = Clock()
    live = Liveness(stall, expiry, clock)
    for r in ranks:
        live.watch(r)
    return live, clock


def beat(live: Liveness, clock: Clock, seconds: float, moving: set[int], beating: set[int]) -> None:
    """Advance `seconds` in steps of 0.5 s: `beating` ranks beat, `moving` ranks also mark (the
    others repeat the progress they last sent)."""
    for _ in range(int(seconds / 0.5)):
        clock.now += 0.5
        for r in beating:
            progress = f"{clock.now} forward" if r in moving else live.seen[r].progress
            live.observe(r, f"{clock.now} {progress}")


def test_a_rank_nobody_waits_for_is_never_stuck():
    live, clock = watched(0, 1)
    beat(live, clock, 20, moving={0}, beating={0, 1})
    assert live.stuck({0, 1}) == [] and live.silent() == []


def test_the_rank_the_waiters_wait_for_is_stuck_once_it_stalled():
    live, clock = watched(0, 1, 2)
    beat(live, clock, 2, moving={0, 1, 2}, beating={0, 1, 2})
    live.waiting(0, [1, 2], epoch=0, where="dp.allreduce")  # rank 0 timed out waiting
    beat(live, clock, 4.5, moving={2}, beating={0, 1, 2})  # rank 1 stopped moving 4.5 s ago
    assert live.stuck({0, 1, 2}) == []  # not yet: within its stall time
    beat(live, clock, 1, moving={2}, beating={0, 1, 2})
    stuck = live.stuck({0, 1, 2})
    assert [r for r, _ in stuck] == [1] and "while rank(s) [0] waited" in stuck[0][1]
    assert live.silent() == []  # its heartbeat thread is fine: only progress tells


def test_waiters_never_look_stuck_and_only_suspects_are_blamed():
    live, clock = watched(0, 1, 2, 3)
    live.waiting(0, [1], epoch=0, where="pp.recv")
    live.waiting(1, [2], epoch=0, where="dp.allreduce")  # 1 itself waits (on 2): not stuck
    beat(live, clock, 6, moving=set(), beating={0, 1, 2, 3})
    assert [r for r, _ in live.stuck({0, 1, 2, 3})] == [2]  # 3 is stalled too, but nobody waits


def test_a_report_from_an_older_epoch_or_an_expired_one_is_ignored():
    live, clock = watched(0, 1)
    live.new_epoch(2)
    live.waiting(0, [1], epoch=1, where="late news of epoch 1")
    beat(live, clock, 6, moving=set(), beating={0, 1})
    assert live.stuck({0, 1}) == []
    live.waiting(0, [1], epoch=2, where="dp.allreduce")
    clock.now += 7.5  # past the expiry: that waiter has given up
    assert live.stuck({0, 1}) == []


def test_silence_and_what_an_unresolved_wait_says():
    live, clock = watched(0, 1, 2)
    live.waiting(0, [1], epoch=0, where="dp.allreduce")
    beat(live, clock, 6, moving={1}, beating={0, 1})  # 1 keeps moving; 2 is silent
    assert [r for r, _ in live.silent()] == [2]
    assert live.stuck({0, 1}) == []
    assert "rank(s) [1] they wait for still make progress" in live.unresolved({0, 1})
    live.waiting(1, [0], epoch=0, where="dp.allreduce")  # both wait on each other
    assert "a network partition" in live.unresolved({0, 1})


def test_timeouts_derive_from_the_one_knob():
    for t in (1.0, 3.0, 10.0, 600.0):
        timeouts = Timeouts(t)
        # a hang is seen within T + 1 s of the rank's last beat or mark
        assert timeouts.stall + timeouts.heartbeat_interval <= t + 1.0
        # a waiter waits long enough for a rank that stalled up to its own timeout
        assert timeouts.verdict_wait > timeouts.stall + timeouts.heartbeat_interval
    try:
        Timeouts(0.5)
    except ValueError as e:
        assert "--recover-timeout" in str(e)
    else:
        raise AssertionError("a timeout below 1 s was accepted")


def test_start_up_is_allowed_its_own_bound_of_silence_until_an_iteration_committed():
    """Eight ranks importing on two cores held a launcher's node beats back 5 s at start-up and
    the coordinator declared every rank dead (T = 3 s). While a rank's progress says it is
    starting, a silence up to its start-up bound (--distributed-timeout-minutes) is allowed;
    once a rank committed an iteration (the marker gone), every rank watched until then is
    judged by T + GRACE again: the first commit was every member's. Control: a replacement
    watched after that commit has a start-up bound of its own."""
    from recover_patches.collectives.progress_marks import ProgressMarks
    clock = Clock()
    live = Liveness(5.0, 7.0, clock)
    marks = {0: ProgressMarks(), 1: ProgressMarks()}
    for r in marks:
        live.watch(r, startup=60.0)
        marks[r].mark(0, "connect", 1, None)
        live.observe(r, f"1 {marks[r].line()}")
    assert marks[0].line().endswith("starting")
    clock.now = 6.0  # both silent since 0, both starting
    assert live.silent() == [] and not live.settled
    marks[1].settle()
    live.observe(1, f"2 {marks[1].line()}")  # rank 1 committed; rank 0 never beat again
    assert live.settled and not marks[1].line().endswith("starting")
    assert [r for r, _ in live.silent()] == [0]
    live.watch(2, startup=60.0)  # a replacement, starting
    live.observe(2, f"1 {ProgressMarks().line()}")
    clock.now = 12.5
    assert [r for r, _ in live.silent()] == [0, 1]
    clock.now = 67.0
    assert [r for r, _ in live.silent()] == [0, 1, 2]


def test_a_node_lost_just_after_the_first_commit_is_declared_after_t_not_start_ups_bound():
    """Node b's last line was forwarded before its rank settled, so it says `starting` for
    good. One node line per sweep is parsed until one says a rank committed; then b's rank is
    silent after T + GRACE (a two-node TP2 x PP2 job waited 10 minutes for such a rank before
    ending). Control: while no line says so, the start-up bound holds."""
    clock = Clock()
    live = Liveness(5.0, 7.0, clock)
    for rank, node in ((0, "a"), (1, "b")):
        live.watch(rank, startup=60.0, via=node)
    clock.now = 1.0
    live.observe_node(node_line("b", {1: (0.0, 0.0, "9 e0 it1 forward starting")}))
    for clock.now in (1.0, 7.0):
        live.observe_node(node_line("a", {0: (0.0, 0.0, "9 e0 it1 forward starting")}))
        live.probe_settled()
    assert live.silent() == [] and not live.settled
    live.observe_node(node_line("a", {0: (0.0, 0.0, "30 e0 it2 forward")}))
    live.probe_settled()
    live.probe_settled()  # (one line per sweep, in turn)
    assert live.settled
    assert [r for r, _ in live.silent()] == [1]


# --- ranks whose launcher forwards their node's beats: one line per node ---------------------
def node_line(node: str, ages: dict[int, tuple[float, float, str]]) -> NodeBeatLine:
    return parse_lines(format_line(node, {r: RankAges(*a) for r, a in ages.items()}))[node]


def on_nodes(carriers: dict[int, str]) -> tuple[Liveness, Clock]:
    clock = Clock()
    live = Liveness(5.0, 7.0, clock)
    for rank, node in carriers.items():
        live.watch(rank, via=node)
    return live, clock


def test_a_node_line_keeps_its_ranks_alive_and_names_the_one_gone_quiet():
    """Ranks 0, 1 on node "a", rank 2 on "b". Rank 1's beat stops while a's lines go on (a
    stopped process): it alone is silent, T + GRACE after the beat the line says it last made.
    Then b's lines stop (its launcher, or the node, is gone): rank 2 is silent too."""
    live, clock = on_nodes({0: "a", 1: "a", 2: "b"})
    for step in range(1, 21):  # 10 s of lines every 0.5 s; rank 1 quiet from t = 4
        clock.now = step * 0.5
        quiet = max(0.0, clock.now - 4.0)
        live.observe_node(node_line("a", {0: (0.0, 0.0, "it1"), 1: (quiet, quiet, "it1")}))
        if clock.now <= 6.0:
            live.observe_node(node_line("b", {2: (0.0, 0.0, "it1")}))
        silent = [r for r, _ in live.silent()]
        assert silent == ([] if clock.now <= 9.0 else [1] if clock.now <= 11.0 else [1, 2]), \
            (clock.now, silent)
    clock.now = 11.5
    assert [r for r, _ in live.silent()] == [1, 2]


def test_a_fresh_node_line_is_never_parsed_and_a_quiet_one_is():
    """The per-rank part of a line is parsed only when the line says a rank is near a verdict
    (or a waiter asks): the sweep of a healthy job reads three fields per node. Control: the
    node with a quiet rank is parsed."""
    live, clock = on_nodes({r: str(r // 8) for r in range(80)})
    for clock.now in (5.6, 6.0):  # two lines per node: a new record, then one updated
        for n in range(10):
            quiet = clock.now if n == 3 else 0.1
            live.observe_node(node_line(str(n), {r: (quiet if r == 25 else 0.1, 0.2, "it3")
                                                 for r in range(n * 8, n * 8 + 8)}))
    assert [r for r, _ in live.silent()] == [25]
    parsed = sorted(name for name, node in live.nodes.items() if node._ages is not None)
    assert parsed == ["3"]


def test_a_rank_its_node_stops_carrying_or_another_node_lists_is_judged_on_its_own():
    """Rank 1 leaves node a's line (its process ended): silent T + GRACE after the last line
    that carried it. Rank 3 was given to node c (a standby took its slot); node a's line still
    lists it (a dead launcher's last words): that line does not keep it alive."""
    live, clock = on_nodes({0: "a", 1: "a", 3: "c"})
    clock.now = 1.0
    live.observe_node(node_line("a", {0: (0.0, 0.0, "it1"), 1: (0.0, 0.0, "it1"),
                                      3: (0.0, 0.0, "it1")}))
    for step in range(3, 15):
        clock.now = step * 0.5
        live.observe_node(node_line("a", {0: (0.0, 0.0, "it2"), 3: (0.0, 0.0, "it2")}))
    assert [r for r, _ in live.silent()] == [1]  # 1: quiet since t = 1; 3: c never spoke yet
    for step in range(15, 34):  # (c gets RELAY_GRACE x stall to send its first line)
        clock.now = step * 0.5
        live.observe_node(node_line("a", {0: (0.0, 0.0, "it2"), 3: (0.0, 0.0, "it2")}))
    assert [r for r, _ in live.silent()] == [1, 3]  # 3: silent since watched, a's line or not
    assert live.loose == {1, 3}
    live.observe_node(node_line("c", {3: (0.0, 0.0, "it2")}))  # the standby's launcher speaks
    live.observe_node(node_line("a", {0: (0.0, 0.0, "it2")}))  # a drops 3: not news of 3
    assert live.loose == {1} and [r for r, _ in live.silent()] == [1]


def test_a_waited_for_rank_on_a_node_is_stuck_by_the_progress_age_its_line_says():
    live, clock = on_nodes({0: "a", 1: "a"})
    live.waiting(0, [1], epoch=0, where="dp.allreduce")
    clock.now = 5.0
    live.observe_node(node_line("a", {0: (0.0, 0.0, "it9"), 1: (0.0, 4.0, "it3 forward")}))
    assert live.stuck({0, 1}) == []  # its progress stopped 4 s ago: within its stall time
    clock.now = 7.0
    live.observe_node(node_line("a", {0: (0.0, 0.0, "it9"), 1: (0.0, 6.0, "it3 forward")}))
    stuck = live.stuck({0, 1})
    assert [r for r, _ in stuck] == [1] and "(at it3 forward)" in stuck[0][1]
    assert live.silent() == []  # it beats on: only its progress tells


def test_ranks_whose_launcher_has_not_reached_a_restarted_coordinator_get_its_reconnection():
    """Found by scripts/chaos.py (seed 11): the coordinator was killed and restarted; the ranks
    registered again at once, but their beats come through their launchers, which reconnect
    at most once a second, and on a loaded host every rank was declared dead 5 s later. A rank
    whose node has sent this coordinator no line yet is silent only after RELAY_GRACE x the
    stall time. Control: a rank beating on its own key is judged as before."""
    from recover_patches.collectives.liveness import RELAY_GRACE
    clock = Clock()
    live = Liveness(5.0, 7.0, clock)
    live.watch(0, via="a")  # a rejoin: not starting, its node's launcher still reconnecting
    live.watch(1)
    for r in (0, 1):
        live.seen[r].progress = "9 e2 it40 forward"
    clock.now = 6.0
    assert [r for r, _ in live.silent()] == [1]
    clock.now = RELAY_GRACE * 5.0 + 0.5
    assert [r for r, _ in live.silent()] == [0, 1]
    live.observe_node(node_line("a", {0: (0.0, 0.0, "9 e2 it41 forward")}))  # it reconnected
    clock.now += 6.0
    assert [r for r, _ in live.silent()] == [0, 1]  # once its node speaks: T + GRACE again


def test_a_starting_replacement_on_a_node_that_fell_silent_is_lost_with_it():
    """Found by scripts/chaos.py (seed 12): a replacement registered, then its node was killed
    whole. Its last beat said it was starting, so its silence was allowed start-up's bound and
    the job's end waited for it. Past start-up, a node whose lines stopped is lost, and so is
    every rank it carried. Control: while the node's lines go on, the starting replacement's
    own quiet beat is allowed its bound (its import may hold it back)."""
    clock = Clock()
    live = Liveness(5.0, 7.0, clock)
    live.settle()  # the job committed an iteration long ago
    live.watch(5, startup=60.0, via="b")
    live.watch(6, startup=60.0, via="c")
    for clock.now in (1.0, 2.0):
        live.observe_node(node_line("b", {5: (0.0, 0.0, "1 e3 it0 start starting")}))
    for t in range(1, 20):
        clock.now = float(t)
        live.observe_node(node_line("c", {6: (t - 1.0, t - 1.0, "1 e3 it0 start starting")}))
    assert [r for r, _ in live.silent()] == [5]  # b stopped at 2 s; c speaks, 6 starts slowly


def test_a_node_lost_in_the_first_iteration_is_declared_within_the_relay_grace():
    """Found by the chaos soak (seed 311): a job restarted from a checkpoint lost a node (cut
    off) in its first iteration; every rank still said `starting`, so their silence was allowed
    start-up's bound (ten minutes) and the launch hung. A node whose lines stopped is lost
    during start-up too, after RELAY_GRACE x T + GRACE (a launcher starved by its ranks'
    imports is slow, not gone). Control: a starting rank whose node's lines go on keeps its
    bound."""
    from recover_patches.collectives.liveness import RELAY_GRACE
    clock = Clock()
    live = Liveness(5.0, 7.0, clock)
    live.watch(1, startup=600.0, via="b")  # on the node that is lost
    live.watch(2, startup=600.0, via="c")  # on a node that goes on, its rank quiet
    for t in range(1, 40):
        clock.now = float(t)
        if t <= 2:
            live.observe_node(node_line("b", {1: (0.0, 0.0, "9 e0 it91 forward starting")}))
        live.observe_node(node_line("c", {2: (t - 1.0, t - 1.0, "9 e0 it91 forward starting")}))
        lost = [r for r, _ in live.silent()]
        if lost:
            break
    assert not live.settled and lost == [1]
    assert RELAY_GRACE * 5.0 < clock.now - 2.0 <= RELAY_GRACE * 5.0 + 1.0, clock.now
