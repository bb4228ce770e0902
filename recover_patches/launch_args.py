"""The launcher's command line: torchrun's flags where they exist (same names and meaning),
ReCoVer's own beside them, and the checks that refuse a bad one in one message (exit 2)."""
from __future__ import annotations

import argparse
import os
import sys

DEFAULT_PRELOAD = "torch,megatron.core"


class LaunchUsageError(Exception):
    """A bad command line: reported in one message, exit status 2, nothing started."""


def build_parser() -> argparse.ArgumentParser:
    # Named as the user called it: the `recover-launch` entry point or the module.
    invoked = os.path.basename(sys.argv[0])
    prog = invoked if invoked == "recover-launch" else "python -m recover_patches.launch"
    p = argparse.ArgumentParser(prog=prog, allow_abbrev=False)
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, required=True)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", "--node_rank", type=int, default=0)
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1")
    p.add_argument("--master-port", "--master_port", type=int, default=29500,
                   help="0 picks a free port (single node only)")
    p.add_argument("--preload", default=DEFAULT_PRELOAD,
                   help="comma-separated modules imported once before forking ranks; 'none' for none")
    p.add_argument("--term-grace", type=float, default=10.0,
                   help="seconds between forwarding SIGTERM and SIGKILL")
    p.add_argument("--no-coordinator", action="store_true",
                   help="torchrun-like mode: no membership coordinator, no RECOVER_* env")
    p.add_argument("--coordinator-port", type=int, default=0,
                   help="port of the coordinator on the master address; 0 = free port (single node)")
    p.add_argument("--job-token", default=None,
                   help="shared secret of this job (default: env RECOVER_JOB_TOKEN or generated)")
    p.add_argument("--heartbeat-interval", "--heartbeat-timeout", dest="removed_heartbeat_flag",
                   help=argparse.SUPPRESS)  # refused in validate(): both derive from the ranks'
    p.add_argument("--max-replacements", type=int, default=0,
                   help="start a replacement process when a rank of this node dies, at most this "
                        "many times (needs the coordinator); it rejoins as a spare")
    p.add_argument("--standby", action="store_true",
                   help="a standby node: start only processes that wait to take over the slots of "
                        "dead ranks (needs a running coordinator)")
    p.add_argument("--health-check", default="builtin", metavar="CMD",
                   help="run before a replacement process gets a dead rank's slot, and on a "
                        "standby node before its processes are offered: a shell command (exit 0: "
                        "healthy; LOCAL_RANK is set), 'builtin' (the device computes and "
                        "communicates: recover_patches/health.py) or 'off'")
    p.add_argument("--failure-window", type=float, default=600.0, metavar="SECONDS",
                   help="a node whose ranks failed twice within this many seconds starts no "
                        "replacement again (its slots go to standby nodes); 0: no such limit")
    # torchrun's rendezvous flags: with etcd, every node's launcher can run the coordinator and
    # one is elected (collectives/failover.py); "static" is node 0's coordinator, as before
    p.add_argument("--rdzv-backend", "--rdzv_backend", choices=("static", "etcd"), default="static")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default="",
                   help="etcd members' client addresses, h1:2379,h2:2379,h3:2379")
    p.add_argument("--rdzv-id", "--rdzv_id", default="none", help="the job's name in etcd")
    p.add_argument("--rdzv-conf", "--rdzv_conf", default="",
                   help="key=value,...: lease_ttl (s, default 5: a dead leader is replaced "
                        "within about 1.4x this)")
    p.add_argument("--local-addr", "--local_addr", default=None,
                   help="the address other nodes reach this node at (etcd: its coordinator's)")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def validate(args: argparse.Namespace) -> None:
    if args.nproc_per_node < 1:
        raise LaunchUsageError("--nproc-per-node must be >= 1")
    if args.nnodes < 1 or args.node_rank < 0 or (args.node_rank >= args.nnodes and not args.standby):
        raise LaunchUsageError("--node-rank must be in [0, --nnodes) (>= 0 with --standby); got "
                               f"--node-rank {args.node_rank} --nnodes {args.nnodes}")
    if args.nnodes > 1 and args.master_port == 0:
        raise LaunchUsageError("--master-port 0 works on one node only: give every node the same port")
    if not os.path.isfile(args.script):
        raise LaunchUsageError(f"script {args.script!r} not found: pass the path of the training script")
    if args.term_grace < 0:
        raise LaunchUsageError("--term-grace must be >= 0")
    if args.removed_heartbeat_flag is not None:
        raise LaunchUsageError("--heartbeat-interval / --heartbeat-timeout are gone: both derive "
                               "from the training script's --recover-timeout (pass that instead)")
    if args.failure_window < 0 or not args.health_check.strip():
        raise LaunchUsageError("--failure-window needs seconds >= 0 (0: no limit) and "
                               "--health-check a command, 'builtin' or 'off'")
    if args.max_replacements < 0 or (args.max_replacements and args.no_coordinator):
        raise LaunchUsageError("--max-replacements needs a value >= 0 and the coordinator "
                               "(drop --no-coordinator)")
    if args.rdzv_backend == "etcd":
        validate_etcd(args)
    elected = args.rdzv_backend == "etcd"  # the standby finds the coordinator through etcd
    if args.standby and (args.no_coordinator or not (elected or args.coordinator_port or os.environ.get(
            "RECOVER_COORDINATOR")) or not (args.job_token or os.environ.get("RECOVER_JOB_TOKEN"))):
        raise LaunchUsageError("--standby joins a running job: give it the job's --coordinator-port "
                               "(with --master-addr), RECOVER_COORDINATOR=host:port or its "
                               "--rdzv-backend etcd flags, and its --job-token (or "
                               "RECOVER_JOB_TOKEN); drop --no-coordinator")
    if not args.no_coordinator:  # in-job recovery: torch's own NCCL handling must stay out
        from recover_patches.collectives import nccl_env
        refused = nccl_env.conflicts(os.environ)
        if refused:
            raise LaunchUsageError(refused[0])
    if not args.no_coordinator and args.nnodes > 1:
        if args.coordinator_port == 0 and not os.environ.get("RECOVER_COORDINATOR") and \
                args.rdzv_backend == "static":
            raise LaunchUsageError("with --nnodes > 1 give every node the same --coordinator-port "
                                   "(or set RECOVER_COORDINATOR=host:port)")
        if not (args.job_token or os.environ.get("RECOVER_JOB_TOKEN")):
            raise LaunchUsageError("with --nnodes > 1 give every node the same --job-token "
                                   "(or set RECOVER_JOB_TOKEN)")


def validate_etcd(args: argparse.Namespace) -> None:
    """--rdzv-backend etcd: the endpoints parse, the job has a name, lease_ttl is the only conf."""
    from recover_patches.collectives.etcd_cluster import EndpointError, parse_endpoints
    if args.no_coordinator:
        raise LaunchUsageError("--rdzv-backend etcd elects the coordinator: drop --no-coordinator")
    try:
        parse_endpoints(args.rdzv_endpoint)
    except EndpointError as e:
        raise LaunchUsageError(str(e)) from None
    if args.rdzv_id in ("", "none"):
        raise LaunchUsageError("--rdzv-backend etcd needs --rdzv-id: the job's name in etcd, the "
                               "same on every node and unique among the cluster's jobs")
    lease_ttl(args)


def lease_ttl(args: argparse.Namespace) -> int:
    """--rdzv-conf lease_ttl=N (seconds, default 5), or LaunchUsageError naming the flag."""
    conf = dict(item.partition("=")[::2] for item in args.rdzv_conf.split(",") if item)
    unknown = sorted(set(conf) - {"lease_ttl"})
    if unknown:
        raise LaunchUsageError(f"--rdzv-conf {unknown[0]}: not used by ReCoVer's etcd "
                               "rendezvous (it takes lease_ttl=SECONDS)")
    value = conf.get("lease_ttl", "5")
    if not value.isdigit() or int(value) < 1:
        raise LaunchUsageError(f"--rdzv-conf lease_ttl={value}: give a whole number of seconds "
                               ">= 1")
    return int(value)


def script_recover_timeout(args: argparse.Namespace) -> float:
    """The training script's --recover-timeout (T; 10 s by default, as the script's): how long
    a node cut off from the job's majority goes on before it fences its ranks."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # (`--recover off`)
    parser.add_argument("--recover-timeout", "--recover_timeout", type=float, default=10.0)
    try:
        known, _ = parser.parse_known_args(args.script_args)
    except SystemExit:  # a malformed value: the script itself refuses it, by name
        return 10.0
    return known.recover_timeout
