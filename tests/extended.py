"""The extended set: multi-process tests CI leaves out to keep the suite under 30 minutes on a
2-core machine. Each feature keeps at least one launch in CI; what is here repeats a launch CI
already makes at another layout, phase or dtype, or is a whole-system scenario long by nature.

    bash scripts/test.sh                    # CI: everything not marked `extended`
    RECOVER_TESTS=all bash scripts/test.sh  # everything
    bash scripts/test.sh -m extended        # the extended set alone

`tests/test_extended_set.py` keeps this list true: every name in it must name collected tests.
"""
from __future__ import annotations

# parametrized tests whose first variant CI runs; the rest are extended
FIRST_VARIANT_ONLY = (
    "tests/test_cli_errors.py::test_user_error_is_one_line_exit_2_nothing_written",
    "tests/test_context_parallel.py::test_cp_layouts_follow_the_single_process_trajectory",
    "tests/test_distributed_optimizer.py::test_lost_replicas_are_survived_on_the_trajectory_with_two_instances",
    "tests/test_distributed_optimizer.py::test_resharding_after_a_loss_and_a_rejoin_keeps_the_unsharded_trajectory",
    "tests/test_distributed_optimizer.py::test_three_shards_over_gloo_match_the_unsharded_optimizer_bitwise",
    "tests/test_exact_reduction.py::test_a_kill_in_any_phase_leaves_no_trace_in_the_bits",
    "tests/test_expert_parallel.py::test_expert_parallel_layouts_follow_one_process",
    "tests/test_interleaved_equivalence.py::test_vp2_layout_matches_one_process_for_every_quota",
    "tests/test_interleaved_equivalence.py::test_a_killed_rank_keeps_the_vp2_trajectory",
    "tests/test_live_faults.py::test_a_live_hang_is_fenced_and_survived",
    "tests/test_live_faults.py::test_a_spike_another_replica_does_not_repeat_is_fenced",
    "tests/test_moe.py::test_moe_layouts_follow_one_process",
    "tests/test_parallel_equivalence.py::test_layout_matches_single_process",
    "tests/test_parallel_equivalence.py::test_distributed_optimizer_matches_single_process",
    "tests/test_parallel_equivalence.py::test_sequence_parallel_matches_single_process",
    "tests/test_recovery.py::test_killed_ranks_keep_the_trajectory",
    "tests/test_recovery.py::test_overlapped_bucket_reduction_keeps_the_trajectory",
    "tests/test_trainer_faults.py::test_kill_is_reported_everywhere_and_survived",
    "tests/test_trainer_faults.py::test_hang_is_reported_everywhere_and_survived",
)

# whole tests (every variant): long scenarios, or a second launch of what CI covers
WHOLE = (
    # benchmarks' smoke runs: CI keeps one (test_benchmark_prints_a_ratio_from_identical_arms)
    "tests/test_effective_throughput.py::test_short_benchmark_accounts_consistently",
    "tests/test_bench_smoke.py::test_exact_reduction_benchmark_times_both_modes_and_counts_the_wire",
    "tests/test_bench_smoke.py::test_cp_attention_benchmark_measures_every_size_and_plots",
    "tests/test_bench_smoke.py::test_bubble_benchmark_compares_the_same_training_in_both_schedules",
    "tests/test_bench_smoke.py::test_coordinator_load_benchmark_names_the_storm_and_the_stuck_rank",
    # network namespaces, etcd and SLURM: CI keeps the partition, one fail-over, one SLURM job
    "tests/test_netns_failover.py::test_a_lost_leading_node_is_re_formed_by_a_standby_node_on_the_failure_free_losses",
    "tests/test_netns_lossy_link.py::test_a_slow_lossy_link_brings_no_false_verdict",
    "tests/test_slurm_real.py::test_a_standby_node_takes_over_a_lost_node_and_the_job_completes",
    "tests/test_slurm_real.py::test_a_job_whose_last_replica_dies_ends_failed_with_the_restart_status",
    "tests/test_slurm_real.py::test_scancel_term_with_exit_signal_handler_saves_and_exits_0",
    # second launches of a feature CI covers elsewhere
    "tests/test_mixed_precision.py::test_replicas_hold_bitwise_equal_weights_and_a_corrupted_one_is_caught",
    "tests/test_moe.py::test_the_routers_expert_bias_moves_as_in_one_process_through_tp_and_a_kill",
    "tests/test_grow_back.py::test_a_standby_node_takes_over_a_lost_nodes_ranks",
    "tests/test_grow_back.py::test_a_join_that_loses_its_donor_is_retried_and_the_donor_comes_back",
    "tests/test_checkpoint_reshard.py::test_tp2_pp2_resumes_bitwise_from_sync_and_async_saves_and_loads_at_tp1",
    "tests/test_context_parallel_checkpoint.py::test_cp2_saves_cp1_resumes_and_saves_cp2_resumes_with_the_same_losses",
    "tests/test_checkpoint_non_persistent.py::test_a_nodes_ranks_restore_from_their_peers_copies_after_its_loss",
    "tests/test_distributed_optimizer.py::test_a_sharded_checkpoint_resumes_without_sharding_on_the_trajectory",
    "tests/test_exact_reduction.py::test_a_resume_at_another_dp_size_continues_bitwise",
    "tests/test_exact_reduction.py::test_a_replica_that_grows_back_takes_the_exponents_and_the_run_stays_bitwise",
    "tests/test_exact_reduction.py::test_a_mixture_of_experts_at_ep_1_is_bitwise_too",
    "tests/test_exit_flags.py::test_exit_duration_exits_once_the_time_is_up",
    "tests/test_exit_flags.py::test_a_job_that_stops_early_releases_its_waiting_spares",
    "tests/test_preprocess.py::test_a_bad_line_in_a_later_partition_leaves_nothing",
    "tests/test_preprocess.py::test_several_json_keys_and_workers_match_single_process",
    "tests/test_recovery.py::test_drop_policy_leaves_the_trajectory",
    "tests/test_expert_parallel.py::test_a_unit_grows_back_each_replica_from_a_holder_of_its_experts",
    "tests/test_expert_parallel.py::test_an_expert_parallel_checkpoint_resumes_at_ep_2_and_at_ep_1",
    "tests/test_interleaved_equivalence.py::test_a_replacement_rejoins_a_vp2_replica_and_the_trajectory_holds",
    "tests/test_checkpointing.py::test_tp1_pp2_dp2_crash_of_a_writer_outside_the_leaders_replica_and_resume_is_exact",
    "tests/test_metrics.py::test_wandb_offline_run_holds_the_same_scalar_keys",
    "tests/test_failover.py::test_the_job_survives_an_etcd_member_and_the_node_that_runs_its_coordinator",
    "tests/test_grow_back.py::test_a_pipeline_replica_is_re_formed_from_its_waiting_survivor",
    "tests/test_grow_back.py::test_a_replacement_takes_its_optimizer_shard_back_from_the_instances",
    "tests/test_context_parallel.py::test_grow_back_re_forms_a_cp_replica",
    "tests/test_parallel_equivalence.py::test_model_flags_keep_layouts_equivalent",
    "tests/test_expert_parallel.py::test_sharded_experts_survive_their_unit_and_come_back_to_it",
    # the emulated NCCL: CI keeps the H200's kill (fixed, and its control), its hang, the first
    # lease's two bugs put back, the watchdog's backstop and start-up's bound
    "tests/test_emulated_nccl_faults.py::test_the_replica_fate_alone_ends_the_h200_survivors_reduction",
    "tests/test_emulated_nccl_faults.py::test_a_busy_communicator_set_aside_hangs_the_survivor_in_a_host_read",
)


def base_of(nodeid: str) -> str:
    return nodeid.split("[", 1)[0]


def extended(nodeids: list[str]) -> set[str]:
    """The collected tests (in collection order) that are extended."""
    chosen, first_seen = set(), set()
    for nodeid in nodeids:
        base = base_of(nodeid)
        if base in WHOLE:
            chosen.add(nodeid)
        elif base in FIRST_VARIANT_ONLY:
            if base in first_seen:
                chosen.add(nodeid)
            first_seen.add(base)
    return chosen
