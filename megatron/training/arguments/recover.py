"""ReCoVer's own flags: in-job recovery, its membership coordinator, and fault injection."""

from __future__ import annotations

import argparse
import os

COORDINATOR_ENV = "RECOVER_COORDINATOR"
JOB_TOKEN_ENV = "RECOVER_JOB_TOKEN"


def add_recover_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("ReCoVer")
    g.add_argument("--recover", default="on", choices=["on", "off"],
                   help="on: survive rank loss inside the job. off: stock behaviour, a rank death ends "
                        "the job (restart from --load). Stored as a bool in args.recover.")
    g.add_argument("--recover-policy", default="redistribute", choices=["redistribute", "drop"],
                   help="redistribute: re-run a failed replica's microbatches on survivors (same global "
                        "batch). drop: skip them (the replica-dropping baseline).")
    g.add_argument("--recover-balance", default="throughput", choices=["throughput", "even"],
                   help="throughput: give slower replicas fewer microbatches when the measured "
                        "imbalance makes that >= 10%% faster. even: always split evenly (bitwise "
                        "reproducible reduction order, e.g. for exact resume comparisons).")
    g.add_argument("--recover-exact-reduction", action="store_true",
                   help="Sum each microbatch's gradient as fixed-point integers (float64, an "
                        "exponent per bucket agreed from the last iteration), and the loss on a "
                        "fixed grid: the reduction then depends on neither the order nor the "
                        "grouping of microbatches, so a run is bitwise the same at any DP size "
                        "and --recover-balance, and through any failure. Costs twice the "
                        "gradient bytes on the wire and 12 more bytes per parameter; an overflow "
                        "skips the step and lowers the exponent, as fp16's loss scale does.")
    g.add_argument("--recover-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="How long a rank may keep the others waiting: an operation that makes no "
                        "progress for this long fails, and the rank it waits for is declared dead "
                        "(fenced) once it made no progress for this long + 0.5 s. The heartbeat "
                        "interval and every wait of recovery derive from it. >= 1.")
    g.add_argument("--recover-min-replicas", type=int, default=1,
                   help="Stop cleanly (for checkpoint-restart) when fewer replicas than this survive.")
    g.add_argument("--recover-placement", default="recover", choices=["recover", "megatron"],
                   help="recover: order the ranks so that replicas (and EP or FSDP units) sit on "
                        "disjoint nodes wherever that makes one node loss take fewer of them "
                        "(tp-cp-ep-pp-dp instead of Megatron's tp-cp-ep-dp-pp; the math is the "
                        "same). megatron: keep Megatron's order, as --use-tp-pp-dp-mapping keeps "
                        "its own.")
    g.add_argument("--recover-spares", default="on", choices=["on", "off"],
                   help="on: the live ranks of a broken replica wait as spares (no collectives) and "
                        "re-form it with replacement processes (launch --max-replacements); off: "
                        "they leave with status 0.")
    g.add_argument("--inject-fault", action="append", default=[], metavar="SPEC",
                   help="Inject a deterministic fault (repeatable): kind:rank=R,iter=I,phase=P[,microbatch=K] "
                        "with kind kill|hang|exit|slow; iterations are numbered from 1 as in the log "
                        "(see recover_patches/faults.py).")
    g.add_argument("--coordinator-addr", default=None, metavar="HOST:PORT",
                   help=f"Membership coordinator address. Default: env {COORDINATOR_ENV}.")
    g.add_argument("--job-token", default=None,
                   help=f"Shared secret of this job's ranks. Default: env {JOB_TOKEN_ENV}.")


def add_ft_package_args(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's fault-tolerance flags, mapped onto ReCoVer's timeout (`ft_timeouts`)."""
    g = parser.add_argument_group("ft_package")
    g.add_argument("--enable-ft-package", action="store_true",
                   help="Take --recover-timeout from SAVE/recover_timeout.json when a run with "
                        "--calc-ft-timeouts wrote one (ReCoVer's own detection of dead and hung "
                        "ranks does NVIDIA Resiliency Extension's job). Needs --save.")
    g.add_argument("--calc-ft-timeouts", action="store_true",
                   help="With --enable-ft-package: after each save and at the end, write 5 x the "
                        "longest iteration seen (a save included) as the next run's "
                        "--recover-timeout.")
    g.add_argument("--ft-num-warmup-iters", type=int, default=5,
                   help="Iterations not timed by --calc-ft-timeouts (the first are slower).")


def apply_recover_env_defaults(args: argparse.Namespace) -> None:
    """Fill env-provided defaults after parsing (read late, so the token never shows up in --help)."""
    if args.coordinator_addr is None:
        args.coordinator_addr = os.environ.get(COORDINATOR_ENV) or None
    if args.job_token is None:
        args.job_token = os.environ.get(JOB_TOKEN_ENV) or None
    # "on"/"off" strings are a trap in Python code (`if "off":` is true): callers get a bool.
    if isinstance(args.recover, str):
        args.recover = args.recover == "on"
    if isinstance(args.recover_spares, str):
        args.recover_spares = args.recover_spares == "on"
