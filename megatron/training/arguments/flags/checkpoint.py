"""The checkpoint flags of Megatron-LM's `pretrain_gpt.py` that ReCoVer accepts: same names,
dests and defaults (where a default differs, the flag's help and docs/megatron_flags.md say so)."""

from __future__ import annotations

import argparse

# megatron-core's dist_checkpointing StrictHandling values (not imported: parsing stays light)
STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
              "return_unexpected", "return_all", "ignore_all")


def add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="Directory to save checkpoints to.")
    g.add_argument("--load", default=None, help="Directory to load a checkpoint from.")
    g.add_argument("--save-interval", type=int, default=None, help="Iterations between saves.")
    g.add_argument("--save-retain-interval", type=int, default=None,
                   help="Keep the checkpoints of iterations that are multiples of N (and the "
                        "latest); each other one is deleted once a newer one is saved.")
    g.add_argument("--no-save-optim", action="store_true", default=None,
                   help="Do not save optimizer state.")
    g.add_argument("--no-save-rng", action="store_true", default=None, help="Do not save RNG state.")
    g.add_argument("--no-load-optim", action="store_true", default=None,
                   help="Do not load optimizer state.")
    g.add_argument("--no-load-rng", action="store_true", default=None, help="Do not load RNG state.")
    g.add_argument("--finetune", action="store_true",
                   help="Load weights only and start from iteration 0.")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   action="store_true",
                   help="On --load, take the LR and weight-decay schedule (lr, min lr, warmup, "
                        "decay length and style) from the checkpoint. Without it or "
                        "--override-opt_param-scheduler, a schedule that differs from the "
                        "checkpoint's is an error.")
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   action="store_true",
                   help="On --load, keep this run's LR and weight-decay schedule flags, whatever "
                        "the checkpoint's; the step count still comes from the checkpoint.")
    g.add_argument("--ckpt-format", default="torch_dist",
                   choices=["torch", "torch_dist", "fsdp_dtensor"],
                   help="Checkpoint format to save: torch_dist (megatron-core's distributed "
                        "checkpoint; loads at any TP/PP/DP layout) or torch (one file per TP x PP "
                        "rank). --load reads either, whatever this says, as Megatron does. "
                        "fsdp_dtensor (which Megatron-LM requires of Megatron-FSDP) is taken with "
                        "--use-megatron-fsdp and writes torch_dist, saying so at start-up.")
    g.add_argument("--async-save", action="store_true",
                   help="torch_dist: training blocks only for a host copy of the state; the "
                        "writing replica writes in the background and the next save, the last "
                        "iteration or an exit lands it (latest moves then).")
    g.add_argument("--use-persistent-ckpt-worker", action="store_true",
                   help="With --async-save: one long-lived writer thread for every save instead "
                        "of a thread started per save (Megatron: a persistent worker process "
                        "instead of one forked per save).")
    g.add_argument("--dist-ckpt-strictness", default="assume_ok_unexpected",
                   choices=STRICTNESS,
                   help="torch_dist loading: what to do with keys in the checkpoint that this "
                        "model lacks or the reverse (megatron-core's StrictHandling).")
    g.add_argument("--ckpt-fully-parallel-save", action="store_true",
                   dest="ckpt_fully_parallel_save_deprecated",
                   help="Deprecated in Megatron-LM: sharing the writing is the default (see "
                        "--no-ckpt-fully-parallel-save).")
    g.add_argument("--no-ckpt-fully-parallel-save", action="store_false",
                   dest="ckpt_fully_parallel_save",
                   help="torch_dist: the lowest live replica writes the whole checkpoint. By "
                        "default every live replica writes a share of it (a writer that dies "
                        "mid-save abandons that save; the last complete one stays latest).")
    _add_exit_args(g)
    _add_megatron_core_checkpoint_args(g)
    _add_non_persistent_args(g)


def _add_exit_args(g) -> None:
    """Stopping the run, with a checkpoint first when --save is set."""
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="On SIGTERM: save a checkpoint and exit.")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="Exit (status 0) after every iteration that is a multiple of this, saving a "
                        "checkpoint first when --save is set.")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="Exit (status 0, after a checkpoint when --save is set) once training has run "
                        "this long; the live ranks agree on it after every iteration (one store "
                        "barrier per iteration while the flag is set).")


def _add_megatron_core_checkpoint_args(g) -> None:
    """The flags that choose megatron-core's layout and writers."""
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="With --use-distributed-optimizer, torch_dist: write the optimizer in "
                        "Megatron's fully_reshardable layout (every main param and Adam moment "
                        "under its weight's key and shape; loads at any TP/PP/DP). Without it "
                        "ReCoVer writes megatron-core's model-space layout of a regular optimizer "
                        "(also fully reshardable), not Megatron's DP-only dp_reshardable.")
    g.add_argument("--distrib-optim-fully-reshardable-mem-efficient", action="store_true",
                   help="How Megatron gathers the fully_reshardable state (gloo, to DP rank 0); "
                        "the files are the same. No effect here: the writing replica holds it.")
    g.add_argument("--ckpt-fully-parallel-load", action="store_true",
                   help="Megatron splits the reading over DP ranks and exchanges. No effect here: "
                        "every rank already reads only the slices its layout needs.")
    g.add_argument("--async-strategy", default="nvrx", choices=["nvrx", "mcore"],
                   help="Megatron's asynchronous writer. No effect here: --async-save writes on "
                        "ReCoVer's own background writer.")
    g.add_argument("--ckpt-assume-constant-structure", action="store_true",
                   help="torch_dist: plan a save once and reuse the plan while the same ranks "
                        "write (a new writing replica after a failure plans again).")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="Load this iteration from --load instead of the latest.")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="With --load: no checkpoint there is an error (exit 2), not a fresh "
                        "start.")
    g.add_argument("--verify-integrity", action="store_true",
                   help="torch_dist: write a SHA-256 manifest (integrity.json) with every save; "
                        "on load, check the files against it (the ranks split the hashing) and "
                        "stop with one line if one differs.")
    g.add_argument("--auto-detect-ckpt-format", action="store_true",
                   help="Detect the checkpoint's format on --load: what --load always does here.")


def _add_non_persistent_args(g) -> None:
    """Megatron's non-persistent checkpoints (`checkpoint_local`)."""
    g.add_argument("--non-persistent-save-interval", type=int, default=None,
                   help="Iterations between non-persistent saves (with --save, as in Megatron).")
    g.add_argument("--non-persistent-ckpt-type", default=None,
                   choices=["global", "local", "in_memory"],
                   help="local: each rank writes its state to --non-persistent-local-ckpt-dir "
                        "(a node's own disk); any replica's file of the same (tp, pp) restores "
                        "it. global: a regular checkpoint in --non-persistent-global-ckpt-dir, "
                        "only the newest kept. Restored with --load when newer than its latest.")
    g.add_argument("--non-persistent-global-ckpt-dir", default=None,
                   help="Where global non-persistent checkpoints go (default: SAVE/non_persistent).")
    g.add_argument("--non-persistent-local-ckpt-dir", default=None,
                   help="Where local non-persistent checkpoints go: a directory on each node.")
    g.add_argument("--non-persistent-local-ckpt-algo", default="fully_parallel",
                   choices=["fully_parallel", "atomic"],
                   help="NVIDIA Resiliency Extension's exchange algorithm. No effect here: "
                        "every rank writes its own file and sends nothing.")
    g.add_argument("--replication", action="store_true",
                   help="Local checkpoints: copies on --replication-factor ranks "
                        "--replication-jump apart; in ReCoVer those ranks must be the same "
                        "(tp, pp) in other replicas, whose own files are the copies.")
    g.add_argument("--replication-jump", type=int, default=None,
                   help="With --replication: the rank distance between copies.")
    g.add_argument("--replication-factor", type=int, default=2,
                   help="With --replication: how many ranks hold a rank's state.")
