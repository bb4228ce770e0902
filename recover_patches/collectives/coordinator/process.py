"""The coordinator as a process: its store server, its signals, its command line."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from datetime import timedelta

import torch.distributed as dist

from recover_patches.collectives.coordinator.core import Coordinator, CoordinatorConfig
from recover_patches.collectives.journal import Fenced
from recover_patches.log import configure

logger = logging.getLogger("recover_patches.collectives.coordinator")


def start_server(host: str, port: int) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30))


OWNER_STOP = signal.SIGUSR1  # how a launcher stops the coordinator it started


def run(server: dist.TCPStore, config: CoordinatorConfig, linger: float | None,
        owned: bool = False) -> None:
    """Serve until SIGTERM or SIGINT, or `linger` s after all is done. `owned` (a launcher
    started it): only the launcher's OWNER_STOP stops it. A Ctrl-C, or the SIGTERM a scheduler
    sends every process of a job at its time limit, must not take the coordinator away from ranks
    that are still saving their checkpoint and shutting down."""
    coordinator = Coordinator(server, config)

    def stop(_signum, _frame):
        coordinator.stopping = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN if owned else stop)
    if owned:
        signal.signal(OWNER_STOP, stop)
    try:
        coordinator.serve(linger)
    except Fenced as e:  # its node lost the lease: the ranks find the leader's coordinator
        logger.error(f"coordinator stops: {e}")


def main(argv: list[str] | None = None) -> int:
    invoked = os.path.basename(sys.argv[0])  # the `recover-coordinator` entry point or a module
    prog = invoked if invoked == "recover-coordinator" else "python -m recover_patches.collectives.coordinator"
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--job-token", default=os.environ.get("RECOVER_JOB_TOKEN"))
    p.add_argument("--recover-timeout", type=float, default=None,
                   help="the ranks' --recover-timeout (default: the first rank's; others must match)")
    p.add_argument("--stay", action="store_true", help="keep serving after every rank is done")
    args = p.parse_args(argv)
    if not args.job_token:
        print("error: no job token: pass --job-token or set RECOVER_JOB_TOKEN", file=sys.stderr)
        return 2
    if args.world_size < 1 or (args.recover_timeout is not None and args.recover_timeout < 1):
        print("error: need --world-size >= 1 and --recover-timeout >= 1", file=sys.stderr)
        return 2
    configure(stream="stderr")
    server = start_server(args.host, args.port)
    logger.info(f"serving on port {server.port} for {args.world_size} rank(s)")
    run(server, CoordinatorConfig(args.world_size, args.job_token, args.recover_timeout),
        linger=None if args.stay else 10.0)
    return 0

