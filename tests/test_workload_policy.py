"""Layer 3: the microbatch placement policy and the per-replica timer (pure, fast)."""

import itertools
import random

import pytest

from recover_patches.workload import (
    UNKNOWN_WIRE,
    MicrobatchTimer,
    PlanInputError,
    even_plan,
    plan,
    predicted_time,
    quotas_of,
    timings_from_wire,
)


def compositions(total, parts):
    """Every vector of `parts` non-negative ints summing to `total`."""
    if parts == 1:
        yield (total,)
        return
    for first in range(total + 1):
        for rest in compositions(total - first, parts - 1):
            yield (first,) + rest


def brute_force_best(count, times, depth):
    replicas = sorted(times)
    return min(predicted_time(dict(zip(replicas, q)), times, depth)
               for q in compositions(count, len(replicas)))


def assert_valid_plan(result, ids, replicas):
    assert sorted(result) == sorted(replicas)
    flat = [i for replica in sorted(result) for i in result[replica]]
    assert flat == list(ids), "blocks must be contiguous, in replica order, ids in given order"


def test_plan_is_optimal_against_brute_force():
    rng = random.Random(1234)
    for _ in range(300):
        replicas = rng.sample(range(10), rng.randint(1, 4))
        count = rng.randint(0, 12)
        depth = rng.randint(1, 5)
        times = {r: rng.choice([rng.uniform(0.1, 3.0), rng.uniform(5.0, 50.0), 1.0]) for r in replicas}
        ids = rng.sample(range(100), count)
        result = plan(ids, replicas, times, depth)
        assert_valid_plan(result, ids, replicas)
        assert predicted_time(quotas_of(result), times, depth) == brute_force_best(count, times, depth)


def test_slow_replica_gets_fewer_ids_on_recorded_timings():
    # Replica 2 runs on a degraded node: each of its microbatches takes twice as long.
    depth, ids, replicas = 2, list(range(64, 96)), [0, 1, 2, 3]
    seconds_per_microbatch = {0: 0.50, 1: 0.52, 2: 1.00, 3: 0.49}
    timers = {r: MicrobatchTimer(alpha=0.5, pipeline_depth=depth) for r in replicas}
    for _ in range(5):  # five committed iterations of an even split, timed
        for r, block in even_plan(ids, replicas).items():
            timers[r].update((len(block) + depth - 1) * seconds_per_microbatch[r], len(block))
    times = timings_from_wire({r: timers[r].to_wire() for r in replicas})

    result = plan(ids, replicas, times, depth)
    quotas = quotas_of(result)
    assert quotas[2] < min(quotas[r] for r in (0, 1, 3))
    assert sum(quotas.values()) == len(ids)
    even_time = predicted_time(quotas_of(even_plan(ids, replicas)), times, depth)
    assert predicted_time(quotas, times, depth) < 0.8 * even_time


def test_very_slow_replica_gets_nothing():
    result = plan(list(range(4)), [0, 1, 2], {0: 1.0, 1: 1.0, 2: 100.0}, pipeline_depth=1)
    assert quotas_of(result) == {0: 2, 1: 2, 2: 0}
    assert result[2] == []


def test_deeper_pipelines_use_fewer_larger_quotas():
    times = {0: 1.0, 1: 1.2}
    used = []
    for depth in (1, 4, 16):
        quotas = quotas_of(plan(list(range(4)), [0, 1], times, depth))
        used.append(sum(1 for q in quotas.values() if q > 0))
        if depth == 1:
            assert quotas == {0: 2, 1: 2}
        if depth == 16:  # fill/drain of a 16-stage pipeline outweighs splitting 4 microbatches
            assert quotas == {0: 4, 1: 0}
    assert used == sorted(used, reverse=True) and used[0] > used[-1]


def test_equal_or_unknown_timings_give_the_even_split():
    ids = list(range(10))
    assert plan(ids, [5, 2, 9], {2: 0.3, 5: 0.3, 9: 0.3}, 3) == even_plan(ids, [5, 2, 9])
    unknown = plan(ids, [5, 2, 9], {2: 0.1, 5: None}, 3)  # 5 unknown, 9 missing
    assert quotas_of(unknown) == {2: 4, 5: 3, 9: 3}, "remainder goes to the lowest replica ids"
    assert_valid_plan(unknown, ids, [2, 5, 9])


def test_plan_is_deterministic_whatever_the_input_order():
    rng = random.Random(7)
    ids = rng.sample(range(1000), 37)
    times = {r: rng.uniform(0.2, 2.0) for r in range(6)}
    reference = plan(ids, list(range(6)), times, 4)
    for perm in itertools.islice(itertools.permutations(range(6)), 50):
        shuffled_times = {r: times[r] for r in reversed(perm)}
        assert plan(ids, list(perm), shuffled_times, 4) == reference
    tied = plan(list(range(7)), [3, 1], {1: 0.25, 3: 0.25}, 2)
    assert quotas_of(tied) == {1: 4, 3: 3}, "float ties go to the lowest replica id"


def test_ids_out_of_order_keep_their_given_order():
    ids = [41, 7, 19, 3, 88, 52, 60]
    result = plan(ids, [1, 0], {0: 1.0, 1: 2.0}, 1)
    assert_valid_plan(result, ids, [0, 1])
    assert result[0] == ids[:len(result[0])]


def test_even_plan_is_contiguous_and_balanced():
    ids = list(range(100, 111))
    result = even_plan(ids, [3, 0, 7, 1])
    assert_valid_plan(result, ids, [0, 1, 3, 7])
    assert quotas_of(result) == {0: 3, 1: 3, 3: 3, 7: 2}


@pytest.mark.parametrize("call", [
    lambda: plan([1, 2], [], {}, 1),
    lambda: even_plan([1], []),
    lambda: plan([1, 1], [0], {0: 1.0}, 1),
    lambda: plan([1], [0, 0], {0: 1.0}, 1),
    lambda: plan([1], [0], {0: 1.0}, 0),
    lambda: plan([1], [0], {0: -1.0}, 1),
    lambda: plan([1], [0], {0: float("nan")}, 1),
    lambda: predicted_time({0: 2}, {}, 1),
])
def test_bad_inputs_raise_value_errors(call):
    with pytest.raises(PlanInputError):
        call()
    assert issubclass(PlanInputError, ValueError)


def test_nothing_to_place():
    assert plan([], [], {}, 1) == {}
    assert plan([], [2, 0], {0: 1.0, 2: 1.0}, 3) == {0: [], 2: []}
    assert predicted_time({0: 0, 2: 0}, {}, 3) == 0.0


def test_timer_ewma_and_wire_format():
    timer = MicrobatchTimer(alpha=0.25, pipeline_depth=3)
    assert timer.value is None and timer.to_wire() == UNKNOWN_WIRE
    timer.update(seconds=12.0, microbatches=4)   # (4 + 3 - 1) slots -> 2.0 s each
    assert timer.value == pytest.approx(2.0)
    timer.update(seconds=24.0, microbatches=4)   # sample 4.0
    assert timer.value == pytest.approx(0.25 * 4.0 + 0.75 * 2.0)
    timer.update(seconds=5.0, microbatches=0)    # nothing computed, nothing learned
    assert timer.value == pytest.approx(2.5)
    assert timings_from_wire({0: timer.to_wire(), 1: UNKNOWN_WIRE}) == {0: pytest.approx(2.5), 1: None}
    with pytest.raises(ValueError):
        timer.update(seconds=0.0, microbatches=1)
    with pytest.raises(ValueError):
        MicrobatchTimer(alpha=0.0)


# -- the interleaved schedule's finish-time model (VP > 1) -----------------------------------------
def test_finish_factor_is_1f1b_for_one_chunk_and_the_simulated_schedule_for_more():
    from recover_patches.pipeline.interleaved import makespan
    from recover_patches.workload.policy import finish_factor
    assert [finish_factor(q, 4) for q in range(6)] == [0.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    factors = [finish_factor(q, 4, chunks=2) for q in range(14)]
    # from PP microbatches on: Megatron's bubble divided by VP, for every length (not only the
    # multiples of PP Megatron accepts): the schedule's group choice, not a formula
    assert factors[4:] == [q + (4 - 1) / 2 for q in range(4, 14)]
    assert factors[9] < makespan(9, 4, 2, 4) / 6  # groups of 4 would leave a short last group
    assert all(a <= b for a, b in zip(factors, factors[1:]))  # non-decreasing (greedy needs it)
    assert factors[1] == 4.0 and all(f < q + 3 for q, f in enumerate(factors) if q > 1)


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
@pytest.mark.parametrize("chunks", [2, 3])
def test_the_closed_form_from_pp_on_is_what_the_schedule_simulation_gives(stages, chunks):
    """finish_factor stops simulating at q = P: the schedule the executor runs must finish then."""
    from recover_patches.pipeline.interleaved import best_group, makespan
    from recover_patches.workload.policy import finish_factor
    for group in (stages, stages + 1, 2 * stages):
        for q in range(1, 4 * stages + 3):
            simulated = makespan(q, stages, chunks, best_group(q, stages, chunks, group))
            if q >= stages:
                assert simulated / (3 * chunks) == q + (stages - 1) / chunks, (group, q)
            else:
                assert finish_factor(q, stages, chunks, group) >= simulated / (3 * chunks)


def test_a_large_quota_takes_the_closed_form():
    """GPT-3 175B's batch on one replica (simulating every length up to it took minutes)."""
    from recover_patches.workload.policy import finish_factor
    assert finish_factor(1536, 16, chunks=2) == 1536 + 7.5
    timer = MicrobatchTimer(alpha=1.0, pipeline_depth=16, chunks=2)
    timer.update(1543.5, 1536)
    assert timer.value == 1.0


@pytest.mark.parametrize("stages", [2, 4])
def test_interleaved_plan_is_optimal_by_brute_force(stages):
    import itertools
    from recover_patches.workload.policy import finish_factor
    times = {0: 1.0, 1: 1.7, 2: 2.3}
    for count in range(10):
        got = predicted_time(quotas_of(plan(list(range(count)), [0, 1, 2], times, stages,
                                           chunks=2)), times, stages, chunks=2)
        best = min(max(finish_factor(q, stages, 2) * times[r] for r, q in enumerate(split))
                   for split in itertools.product(range(count + 1), repeat=3)
                   if sum(split) == count)
        assert got == best, (count, got, best)


def test_timer_divides_by_the_interleaved_finish_factor():
    timer = MicrobatchTimer(alpha=1.0, pipeline_depth=4, chunks=2)
    timer.update(19.0, 8)  # 8 microbatches, PP 4, VP 2: 9.5 microbatch times
    assert timer.value == 2.0
