"""--check-for-spiky-loss, the ReCoVer way: the detector (Megatron's rule: 10 x the largest of
the first 100 values), and the verdict after another replica re-ran the suspects' microbatches
(a fake host stands for the ranks' shared vector). The launch: tests/test_live_faults.py."""
from __future__ import annotations

import logging

import pytest
import torch

from megatron.training.rerun import (Position, RerunConfig, ResultRejected, ResultReproduced,
                                     SpikeDetector, injected, resolve_spike)
from recover_patches.collectives import PeerFailure


def test_the_first_hundred_values_set_the_bar_and_a_tenfold_loss_is_spiky():
    detector = SpikeDetector()
    values = [2.0, float("nan"), 3.0] + [1.0] * 97
    assert not any(bool(detector.spiky(torch.tensor(v))) for v in values)
    assert float(detector.largest) == 3.0  # the NaN is the other check's, never the largest
    assert bool(detector.spiky(torch.tensor(30.0)))
    assert bool(detector.spiky(torch.tensor(-31.0)))  # Megatron compares magnitudes
    assert not bool(detector.spiky(torch.tensor(29.9)))
    assert not bool(detector.spiky(torch.tensor(float("inf"))))


class FakeHost:
    """One rank of replica `replica`; `shared` is what the ranks' share() would sum to."""

    def __init__(self, shared: list[float]):
        self.shared, self.reran = shared, None

    def rerun(self, ids):
        self.reran = ids
        return torch.tensor(self.shared[0])

    def rerun_gradient_norm(self, ids):
        self.reran = ids
        return 0.0

    def share(self, values):
        return self.shared

    def ranks_of(self, replica):
        return [2 * replica, 2 * replica + 1]


CONFIG = RerunConfig("validate_results", 0, "transient_error", None, spiky_loss=True)


def at(replica: int, live=(0, 1)) -> Position:
    return Position(iteration=7, replica=replica, live_replicas=tuple(live), replicas=2, epoch=0,
                    is_last_stage=True)


def test_a_spike_that_repeats_elsewhere_is_the_data_and_training_goes_on(caplog):
    host = FakeHost([500.0, 500.0 * (1 + 1e-9)])
    with caplog.at_level(logging.WARNING):
        resolve_spike(host, CONFIG, at(0), [1], {0: [0, 1], 1: [2, 3]}, 0.0)
    assert host.reran == [2, 3]  # replica 0 re-ran replica 1's microbatches
    assert "the data spikes, not a rank; training goes on" in caplog.text


def test_a_spike_that_does_not_repeat_fences_the_suspects(tmp_path):
    tracker = tmp_path / "rejected.txt"
    config = RerunConfig("validate_results", 0, "transient_error", str(tracker), True)
    shared = [5.0, 5000.0]  # the re-run's loss sum, the suspect's own
    with pytest.raises(PeerFailure) as failure:  # the validator recovers as from a failure
        resolve_spike(FakeHost(shared), config, at(0), [1], {1: [2, 3]}, 0.0)
    assert failure.value.suspects == {2, 3}
    assert tracker.read_text().startswith("iteration 7 replicas [1] ranks [2, 3] microbatches "
                                          "[2, 3]: spiky loss, not repeated on replica 0")
    with pytest.raises(ResultRejected, match="this replica's result is rejected"):
        resolve_spike(FakeHost(shared), config, at(1), [1], {1: [2, 3]}, 5000.0)
    with pytest.raises(ResultReproduced, match="no other replica can take over"):
        resolve_spike(FakeHost(shared), config, at(0, live=(0,)), [0], {0: [0, 1]}, 5000.0)


def test_with_the_check_an_injected_error_is_a_spike_not_a_nan():
    loss = torch.tensor(2.0, dtype=torch.float64)
    spiking = RerunConfig("validate_results", 3, "transient_error", None, spiky_loss=True)
    assert float(injected(loss, spiking, 3, 1, 2)) == 2000.0  # iteration 3: replica 1's turn
    assert float(injected(loss, spiking, 3, 0, 2)) == 2.0
    nan = injected(loss, RerunConfig("validate_results", 3, "transient_error", None), 3, 1, 2)
    assert torch.isnan(torch.as_tensor(nan))


def test_megatrons_comparison_and_its_summary_line():
    from megatron.training.rerun.stats import DeterminismStats, relative_difference
    assert relative_difference(2.0, 2.0) == 0.0
    assert relative_difference(float("nan"), float("nan")) == 0.0
    assert relative_difference(float("nan"), 1.0) == float("inf")
    assert relative_difference(3.0, 1.0) == pytest.approx(1.0)  # |3 - 1| / 2
    stats = DeterminismStats()
    for _ in range(3):
        stats.record(0.0)
    assert stats.summary() == "3 samples, all identical"
    stats.record(1e-3)
    assert stats.summary() == ("4/3 total/identical samples, rel. variability: avg= 2.500E-04, "
                               "p50= 0.0, p90= 1.000E-03, p99= 1.000E-03, p99.9= 1.000E-03, "
                               "max: 1.000E-03")


def test_report_stats_re_runs_one_replica_per_iteration_turn_by_turn():
    from megatron.training.rerun.stats import compare_once
    assignment = {0: [0, 1], 1: [2, 3], 2: [4, 5]}
    for iteration, (compared, validator) in [(6, (0, 1)), (7, (1, 2)), (8, (2, 0))]:
        host = FakeHost([4.0, 4.0])
        where = Position(iteration, validator, (0, 1, 2), 3, 0, True)
        assert compare_once(host, where, assignment, 0.0) == 0.0
        assert host.reran == assignment[compared]
    bystander = FakeHost([4.0, 5.0])
    assert compare_once(bystander, Position(6, 2, (0, 1, 2), 3, 0, True), assignment, 0.0) == \
        pytest.approx(0.2222222)
    assert bystander.reran is None  # replica 2 only shares this time


def test_large_gradients_compare_each_positions_norm():
    """(TP 2): the validator re-computes the suspect's gradients; each position compares its own
    shard's two norms. One position off by more than Megatron's 1e-3 fences the suspect; all
    within it is the data."""
    from megatron.training.rerun import resolve_large_grads
    config = RerunConfig("validate_results", 0, "transient_error", None, large_grads=True)
    where = Position(9, 0, (0, 1), 2, 0, True, slot=0, slots=2)
    same = FakeHost([3.0, 3.0 * (1 + 5e-4), 4.0, 4.0])  # [re-run, own] per position
    resolve_large_grads(same, config, where, [1], {1: [2, 3]}, 0.0)
    assert same.reran == [2, 3]
    with pytest.raises(PeerFailure) as failure:
        resolve_large_grads(FakeHost([3.0, 3.0, 4.0, 4000.0]), config, where, [1], {1: [2, 3]},
                            0.0)
    assert failure.value.suspects == {2, 3}
