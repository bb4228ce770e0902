"""Fault-injection specs and firing rules (actions replaced by recorders: nothing is killed)."""
import signal

import pytest

from recover_patches.faults import ENV_VAR, FaultInjector, FaultSpecError, parse_spec


class Recorder:
    def __init__(self):
        self.calls = []

    def actions(self):
        return dict(kill=lambda pid, sig: self.calls.append(("kill", sig) if pid > 0
                                                            else ("killpg", -pid, sig)),
                    exit=lambda code: self.calls.append(("exit", code)),
                    sleep=lambda s: self.calls.append(("sleep", s)))


def injector(specs, rank, rec, monkeypatch, env=None):
    if env is None:
        monkeypatch.delenv(ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ENV_VAR, env)
    return FaultInjector.from_specs(specs, rank, **rec.actions())


def test_parse_full_spec():
    f = parse_spec("kill:rank=3,iter=5,phase=backward,microbatch=2")
    assert (f.kind, f.rank, f.iteration, f.phase, f.microbatch) == ("kill", 3, 5, "backward", 2)
    s = parse_spec("slow:rank=1,seconds=0.25")
    assert (s.kind, s.iteration, s.phase, s.seconds) == ("slow", 0, "forward", 0.25)
    assert parse_spec("exit:rank=0,iter=1,phase=optimizer,code=7").code == 7


@pytest.mark.parametrize("spec, needle", [
    ("explode:rank=1,iter=1,phase=forward", "unknown kind"),
    ("kill rank=1", "missing 'kind:'"),
    ("kill:rank=1,iter=1", "missing ['phase']"),
    ("kill:rank=1,iter=1,phase=sideways", "unknown phase"),
    ("kill:rank=x,iter=1,phase=forward", "integers"),
    ("kill:rank=1,iter=1,phase=forward,seconds=2", "unknown field"),
    ("kill:rank=1,rank=2,iter=1,phase=forward", "repeated"),
    ("slow:rank=1", "missing ['seconds']"),
])
def test_bad_specs_name_the_flag(spec, needle):
    with pytest.raises(FaultSpecError) as e:
        parse_spec(spec)
    assert "--inject-fault" in str(e.value) and repr(spec) in str(e.value) and needle in str(e.value)


def test_one_shot_faults_fire_once_at_their_point_only(monkeypatch):
    rec = Recorder()
    inj = injector(["kill:rank=1,iter=2,phase=backward,microbatch=3",
                    "hang:rank=1,iter=4,phase=p2p", "exit:rank=1,iter=5,phase=optimizer,code=9"],
                   1, rec, monkeypatch)
    inj.at("backward", 2, 2)          # wrong microbatch
    inj.at("forward", 2, 3)           # wrong phase
    inj.at("backward", 1, 3)          # wrong iteration
    assert rec.calls == []
    inj.at("backward", 2, 3)
    inj.at("backward", 2, 3)          # already fired
    inj.at("p2p", 4, 0)               # no microbatch in spec: any microbatch matches
    inj.at("p2p", 4, 1)
    inj.at("optimizer", 5)
    assert rec.calls == [("kill", signal.SIGKILL), ("kill", signal.SIGSTOP), ("exit", 9)]


def test_a_node_fault_kills_the_whole_process_group(monkeypatch):
    import os
    rec = Recorder()
    inj = injector(["node:rank=2,iter=3,phase=forward"], 2, rec, monkeypatch)
    inj.at("forward", 3, 0)
    assert rec.calls == [("killpg", os.getpgrp(), signal.SIGKILL)]


def test_a_cut_names_itself_once_and_pauses_at_its_phase_for_the_harness(monkeypatch, caplog):
    """The harness that started the node in a namespace cuts its link on reading the line; the
    rank waits at the phase meanwhile, and kills nothing itself."""
    from recover_patches.faults import HARNESS_PAUSE
    rec = Recorder()
    inj = injector(["cut:rank=5,iter=7+,phase=confirmed"], 5, rec, monkeypatch)
    with caplog.at_level("INFO", logger="recover_patches.faults"):
        inj.at("confirmed", 6)
        inj.at("confirmed", 8)
        inj.at("confirmed", 9)
    assert rec.calls == [("sleep", HARNESS_PAUSE)]
    assert [r.getMessage() for r in caplog.records] == ["injecting cut at iter 8 phase confirmed"]


def test_slow_applies_at_every_call_from_its_iteration(monkeypatch):
    rec = Recorder()
    inj = injector(["slow:rank=0,iter=3,seconds=0.5"], 0, rec, monkeypatch)
    for it in range(6):
        for mb in range(2):
            inj.at("forward", it, mb)
        inj.at("backward", it, 0)
    assert rec.calls == [("sleep", 0.5)] * 6  # iterations 3, 4, 5 x 2 microbatches, forward only


def test_other_ranks_faults_and_env_specs(monkeypatch):
    rec = Recorder()
    inj = injector(["kill:rank=2,iter=0,phase=forward"], 0, rec, monkeypatch,
                   env="exit:rank=0,iter=1,phase=dp_reduce; kill:rank=3,iter=0,phase=forward")
    assert len(inj.faults) == 1  # only rank 0's fault, from the env
    inj.at("forward", 0)
    inj.at("dp_reduce", 1)
    assert rec.calls == [("exit", 1)]


def test_off_by_default(monkeypatch):
    rec = Recorder()
    inj = injector([], 0, rec, monkeypatch)
    assert not inj
    inj.at("forward", 0, 0)
    assert rec.calls == []


def test_env_spec_errors_are_reported_too(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "kill:rank=0")
    with pytest.raises(FaultSpecError, match="--inject-fault"):
        FaultInjector.from_specs([], 0)


def test_unknown_phase_at_call_site_is_a_bug(monkeypatch):
    inj = injector(["kill:rank=0,iter=0,phase=forward"], 0, Recorder(), monkeypatch)
    with pytest.raises(ValueError, match="phase"):
        inj.at("fwd", 0)


def test_the_training_probe_numbers_points_by_the_iteration_under_way(monkeypatch):
    """Training points carry the iteration after those completed (as the logs number it); the
    evaluation after an iteration carries that iteration's number. Each point marks progress
    for the coordinator and is an injection point."""
    from megatron.training.checkpointing.state import Progress
    from megatron.training.step.probe import TrainingProbe

    rec, marks, progress = Recorder(), [], Progress(iteration=4)
    faults = injector(["kill:rank=0,iter=5,phase=forward,microbatch=2",
                       "exit:rank=0,iter=4,phase=eval,code=9"], 0, rec, monkeypatch)
    probe = TrainingProbe(progress, faults, lambda *where: marks.append(where))
    probe.at("forward", 1)
    probe.of_evaluation().at("forward", 2)  # iteration 4's evaluation: not the kill's point
    assert rec.calls == []
    probe.at("forward", 2)
    probe.of_evaluation().at("eval", 0)
    assert rec.calls == [("kill", signal.SIGKILL), ("exit", 9)]
    assert marks == [("forward", 5, 1), ("forward", 4, 2), ("forward", 5, 2), ("eval", 4, 0)]
    progress.iteration = 5  # the probe reads the trainer's counters at each point
    probe.at("dp_reduce")
    assert marks[-1] == ("dp_reduce", 6, None)


def test_model_parallel_operations_reach_the_probe_under_their_phases():
    """Each model-parallel group's operations are injection points named for the group: a kill
    at `ep_alltoall` fires in the token dispatcher's exchange, not in a tensor-parallel sum."""
    from megatron.training.initialize import ParallelGroups

    class Group:
        def __init__(self):
            self.before = None

        def set_before_op(self, before):
            self.before = before

    class Seen:
        def __init__(self):
            self.phases = []

        def at(self, phase, microbatch=None):
            self.phases.append(phase)

    from recover_patches.topology import Topology
    tp, context, tp_expert, other = Group(), Group(), Group(), Group()
    topology = Topology(tp=1, pp=1, dp=1)
    groups = ParallelGroups(topology, 0, topology.coord(0), tp, other, other, None, other, other,
                            resilient=True, context=context, tp_expert=tp_expert)
    seen = Seen()
    groups.before_parallel_ops(seen)
    tp.before("allreduce")
    context.before("send")
    tp_expert.before("alltoall")
    tp_expert.before("allgather")
    assert seen.phases == ["tp_allreduce", "cp_exchange", "ep_alltoall", "ep_dispatch"]


def test_a_stall_sleeps_once_and_an_incarnation_picks_the_process(monkeypatch):
    """stall: one sleep at its point (a rank slow for a moment), unlike slow's every call.
    incarnation=N: only that process of the slot; control: a replacement (RECOVER_INCARNATION
    1) takes the fault meant for it and not the one meant for the process it replaced."""
    rec = Recorder()
    specs = ["stall:rank=0,iter=2,phase=forward,seconds=4.5",
             "kill:rank=0,iter=any,phase=recovery,incarnation=0",
             "hang:rank=0,iter=any,phase=join,incarnation=1"]
    inj = injector(specs, 0, rec, monkeypatch)
    for it in range(4):
        inj.at("forward", it, 0)
    inj.at("join", 5)
    inj.at("recovery", 6)
    assert rec.calls == [("sleep", 4.5), ("kill", signal.SIGKILL)]
    monkeypatch.setenv("RECOVER_INCARNATION", "1")
    replacement = Recorder()
    inj = injector(specs, 0, replacement, monkeypatch)
    inj.at("recovery", 6)
    inj.at("join", 7)
    assert replacement.calls == [("kill", signal.SIGSTOP)]  # the hang, only
    with pytest.raises(FaultSpecError, match="missing \\['seconds'\\]"):
        parse_spec("stall:rank=0,iter=1,phase=forward")


def test_a_ledger_fires_each_fault_once_in_the_job_and_iter_plus_takes_the_first_chance(
        monkeypatch, tmp_path):
    """RECOVER_FAULT_LEDGER: two processes of slot 0 (the first, then its replacement, or the
    job restarted) given the same specs: each fault fires in one of them only. `iter=3+`
    fires at iteration 3 or, when the slot did not reach 3 (it waited as a spare), at the first
    call after. Control: without the ledger the replacement takes the fault again."""
    specs = ["kill:rank=0,iter=3+,phase=forward", "hang:rank=0,iter=any,phase=recovery"]
    monkeypatch.setenv("RECOVER_FAULT_LEDGER", str(tmp_path))
    first, second = Recorder(), Recorder()
    inj = injector(specs, 0, first, monkeypatch)
    inj.at("forward", 1)
    inj.at("forward", 5)  # (iterations 2-4 were missed: a spare)
    inj.at("forward", 6)
    assert first.calls == [("kill", signal.SIGKILL)]
    again = injector(specs, 0, second, monkeypatch)
    again.at("forward", 7)
    again.at("recovery", 8)
    assert second.calls == [("kill", signal.SIGSTOP)]  # the hang; the kill was the first's
    monkeypatch.delenv("RECOVER_FAULT_LEDGER")
    unshared = Recorder()
    injector(specs, 0, unshared, monkeypatch).at("forward", 7)
    assert unshared.calls == [("kill", signal.SIGKILL)]
    assert parse_spec("kill:rank=0,iter=3+,phase=forward").or_later
