"""Local launcher: ``python -m recover_patches.launch --nproc-per-node N script.py [args...]``.

Starts this node's ranks with the usual torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, OMP_NUM_THREADS=1 unless set).

Why fork: importing torch + megatron.core costs seconds of CPU per process. The launcher imports
them once (``--preload``, with OMP_NUM_THREADS already set and no thread started) and forks every
rank from that warm parent; a child resets its signal handlers, sets its env and runs the script
with ``runpy.run_path`` as ``__main__`` (exit code = the script's; an exception prints its
traceback and exits 1).

Unlike torchrun, the death of one rank does not kill the others: surviving ranks are expected to
carry on (ReCoVer's whole point). The launcher waits for every rank, prints one line per failed
rank and a final summary. SIGINT/SIGTERM to the launcher is forwarded to the ranks as SIGTERM,
followed by SIGKILL after ``--term-grace`` seconds (or at once on a second signal).

Coordinator (default on; ``--no-coordinator`` gives a plain torchrun-like launcher). Node 0 forks
the membership coordinator (design.md §6) before the ranks, unless RECOVER_COORDINATOR is already set
(a coordinator started by hand, e.g. under SLURM). Ranks get RECOVER_COORDINATOR and
RECOVER_JOB_TOKEN. The launcher reports every child's exit to the coordinator the moment it sees
it, and SIGKILLs any of its children the coordinator has declared dead (a hung rank is fenced, so
it can never wake up and rejoin a job that moved on).

With ``--rdzv-backend etcd`` a launcher that has heard neither etcd's majority nor another node's
coordinator for the script's --recover-timeout fences its node: SIGKILL to every rank, none
replaced (a cut link: `collectives/self_fence.py`).

Replacements (``--max-replacements K``, needs the coordinator): when a rank of this node dies
(a signal, or an exit status other than 0, 2 and 3) before the job declared completion, the
launcher forks a new process for the same rank and GPU (RECOVER_INCARNATION = previous + 1), at
most K times in the job's life. It registers as a spare and joins when its replica can be
re-formed (design.md §11).

Standby nodes (``--standby``, needs a running coordinator): the launcher starts
``--nproc-per-node`` processes without a rank (RECOVER_STANDBY names each). Each waits until the
coordinator gives it the slot of a dead rank that no local replacement is coming for (a lost
node's), then runs as that rank's replacement on this node's GPU; it exits 0 if the job completes
without needing it. ``--nnodes`` is the number of training nodes (the world size is unchanged),
``--node-rank`` this standby node's index (it only names the processes). With
``--max-replacements K`` a standby process that dies is followed by a new standby process.

Exit status rule:
  * 0 if every rank of this node exited 0;
  * otherwise still 0 if the job declared itself complete through the coordinator
    (``MembershipClient.declare_complete()``, called after the final commit) and every rank of
    this node that failed was already dead in the membership epoch at which completion was
    declared, i.e. the job survived exactly those failures. A failure the job did not account for
    (a rank dying after the declaration, or one the coordinator never saw) still fails the launch;
  * otherwise 2 if every failed rank exited 2 (a user error the ranks found: data, checkpoint,
    coordinator address), 3 if every failed rank exited 2 or 3 (the job stopped itself for a
    checkpoint-restart), else 1; 128+signal when the launcher itself was stopped by SIGINT/SIGTERM
    and its ranks did not all exit 0 (with --exit-signal-handler they save and exit 0: so does it).
The launcher's own usage errors (bad flags) exit 2 before anything is started.
"""
from __future__ import annotations

import argparse
import atexit
import importlib
import logging
import os
import runpy
import secrets
import signal
import socket
import sys
import threading
import time
import traceback
from typing import NoReturn

from recover_patches import health
from recover_patches.log import configure, hide_library_notes
from recover_patches.launch_args import LaunchUsageError, build_parser, lease_ttl, \
    script_recover_timeout, validate
from recover_patches.supervisor import Rank, Supervisor, summarize

# by name, not __name__: also when run as __main__ (python -m)
logger = logging.getLogger("recover_patches.launch")


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def preload(modules: str) -> bool:
    """Import the heavy modules once so every forked rank starts warm. False when the imports
    left the parent unfit to fork ranks from: then each rank execs a fresh interpreter."""
    if modules.strip().lower() in ("", "none"):
        return True
    hide_library_notes()
    for name in modules.split(","):
        importlib.import_module(name.strip())
    if threading.active_count() > 1:
        # fork() copies only the calling thread; a lock held by another thread stays held forever.
        logger.warning(f"{threading.active_count() - 1} thread(s) running before fork")
    if not children_can_use_cuda():
        logger.warning("--preload touched CUDA; ranks start as fresh interpreters instead")
        return False
    return True


def children_can_use_cuda() -> bool:
    """A child forked after the parent touched CUDA (even `torch.cuda.is_available()` without
    PYTORCH_NVML_BASED_CUDA_CHECK) cannot use CUDA at all. torch's own fork hook knows: ask a
    probe child."""
    torch = sys.modules.get("torch")
    if torch is None or torch.version.cuda is None:
        return True
    pid = os.fork()
    if pid == 0:
        os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def exit_code_of(code: object) -> int:
    """Map a SystemExit payload to a process status the way the interpreter does."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def print_script_traceback(error: BaseException) -> None:
    """The traceback as `python script.py` would print it: without the launcher's frames."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != sys.argv[0]:
        tb = tb.tb_next
    traceback.print_exception(type(error), error, tb or error.__traceback__)


def run_rank(script: str, script_args: list[str], env: dict[str, str]) -> NoReturn:
    """Body of a forked child: become a fresh `python script.py args` process, never return."""
    code = 1
    try:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # what the interpreter sets at start-up
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        os.environ.update(env)
        sys.argv = [script, *script_args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = exit_code_of(e.code)
        except KeyboardInterrupt as e:
            print_script_traceback(e)
            code = 128 + signal.SIGINT
        except BaseException as e:
            print_script_traceback(e)
            code = 1
        atexit._run_exitfuncs()  # the script's (and preloaded modules') exit hooks, as at exit
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def rank_env(args: argparse.Namespace, local_rank: int, extra: dict[str, str]) -> dict[str, str]:
    """The child's environment. A standby process gets no RANK: the coordinator gives it one."""
    world = args.nnodes * args.nproc_per_node
    env = {
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(args.nproc_per_node),
        "GROUP_RANK": str(args.node_rank),
        "MASTER_ADDR": args.master_addr,
        "MASTER_PORT": str(args.master_port),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    if not args.standby:
        env["RANK"] = str(args.node_rank * args.nproc_per_node + local_rank)
    env.update(extra)
    return env


def exec_rank(script: str, script_args: list[str], env: dict[str, str]) -> NoReturn:
    """Body of a forked child that must not reuse the parent's interpreter: exec a fresh one."""
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        os.execve(sys.executable, [sys.executable, script, *script_args], {**os.environ, **env})
    finally:
        os._exit(127)  # only reached when exec itself failed


def fork_rank(script: str, script_args: list[str], env: dict[str, str], warm: bool = True) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        if warm:
            run_rank(script, script_args, env)
        exec_rank(script, script_args, env)
    return pid


def coordinator_for(args: argparse.Namespace):
    """Start or join the membership coordinator (none with --no-coordinator); it and what every
    rank's environment gets from it: its address and token, and torch's NCCL settings for
    in-job recovery (set before any group exists). Raises CoordinatorError."""
    if args.no_coordinator:
        return None, {}
    from recover_patches.collectives import nccl_env
    from recover_patches.collectives.launcher_link import (CoordinatorHandle,
                                                           start_or_join_coordinator)
    token = args.job_token or os.environ.get("RECOVER_JOB_TOKEN") or secrets.token_hex(16)
    if args.rdzv_backend == "etcd":  # whichever node etcd elects runs it
        from recover_patches.collectives.failover import ElectedCoordinator
        coordinator: CoordinatorHandle = ElectedCoordinator(args, token, lease_ttl(args))
    else:
        coordinator = start_or_join_coordinator(args, token)
    extra_env = {**coordinator.env(), **nccl_env.required()}
    if coordinator.pid is not None:
        logger.info(f"coordinator pid {coordinator.pid} at {extra_env['RECOVER_COORDINATOR']}")
        extra_env["RECOVER_COORDINATOR_PID"] = str(coordinator.pid)  # the `coordinator` fault
    return coordinator, extra_env


def main(argv: list[str] | None = None) -> int:
    configure(stream="stderr")
    args = build_parser().parse_args(argv)
    try:
        validate(args)
    except LaunchUsageError as e:
        logger.error(str(e))
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported: threads are sized at init
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # is_available() leaves forks usable
    warm = preload(args.preload)
    if args.standby and (unhealthy := unhealthy_standby(args, warm)) is not None:
        logger.error(f"this standby node is not offered to the job: {unhealthy}")
        return 1

    from recover_patches.collectives.errors import CoordinatorError  # (cheap: no torch)
    try:
        coordinator, extra_env = coordinator_for(args)
    except CoordinatorError as e:
        logger.error(str(e))
        return 2
    beats = None
    if coordinator is not None:  # one heartbeat per node: the ranks beat into a local directory
        from recover_patches.collectives.node_beats import NodeBeatRelay, node_name
        beats = NodeBeatRelay(node_name(args.node_rank, args.standby))
        extra_env.update(beats.env())
    if args.master_port == 0:  # after the coordinator bound its own port 0: never the same one
        args.master_port = free_port(args.master_addr)
    # Block termination signals while forking: a child must not run the launcher's handler in
    # the instant before it installs its own, and the launcher must not die between two forks.
    stop_signals = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    started = 0  # standby processes started: each gets a new name

    def start(local: int, rank: int, incarnation: int) -> Rank:
        nonlocal started
        env = rank_env(args, local, extra_env)
        standby = None
        if args.standby:  # the coordinator gives it a slot (and an incarnation) later
            standby = f"{args.node_rank}.{started}"
            env["RECOVER_STANDBY"] = standby
            started += 1
            rank, incarnation = -1, 0
        elif incarnation:
            env["RECOVER_INCARNATION"] = str(incarnation)
        pid = fork_rank(args.script, args.script_args, env, warm)
        return Rank(rank=rank, pid=pid, incarnation=incarnation, local=local, standby=standby)

    ranks = [start(i, args.node_rank * args.nproc_per_node + i, 0)
             for i in range(args.nproc_per_node)]

    def respawn(dead: Rank) -> Rank:
        signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
        try:
            return start(dead.local, dead.rank, dead.incarnation + 1)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals)

    return supervise(args, ranks, respawn, coordinator, stop_signals, beats, warm)


def unhealthy_standby(args: argparse.Namespace, warm: bool) -> str | None:
    """A standby node is offered only if each of its devices passes the health check."""
    return next((why for local in range(args.nproc_per_node)
                 if (why := health.check(args.health_check, local, fork=warm)) is not None), None)


def supervise(args: argparse.Namespace, ranks: list[Rank], respawn, coordinator,
              stop_signals: set, beats=None, warm: bool = False) -> int:
    """Watch the ranks until they end (forwarding SIGTERM/SIGINT, replacing dead ones), tell the
    coordinator, and turn their exits into the launcher's status."""
    link = None
    if coordinator is not None:
        try:
            link = coordinator.connect(beats)
        except RuntimeError as e:  # includes CoordinatorError: supervise without it
            logger.warning(f"cannot reach the coordinator ({e}); supervising without it (this "
                           "node's heartbeats are not forwarded: its ranks will be found silent)")
    sup = Supervisor(ranks, args.term_grace, link, respawn, args.max_replacements, coordinator,
                     beats, stop_grace=max(2.0, script_recover_timeout(args)),
                     admit=lambda r: health.check(args.health_check, r.local, fork=warm),
                     failures=health.FailureWindow(window=args.failure_window))
    signal.signal(signal.SIGTERM, sup.on_signal)
    signal.signal(signal.SIGINT, sup.on_signal)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals)
    fence = None if coordinator is None else \
        coordinator.self_fence(link, script_recover_timeout(args), sup.fence_node)
    completion, stopped = None, None
    try:
        sup.run()
    finally:
        if fence is not None:
            fence.close()
        if link is not None:
            stopped = stop_verdict(link, list(sup.ranks.values()))
        if coordinator is not None:
            completion = coordinator.finish(link, should_stop=lambda: sup.stop_signal is not None)
        if link is not None and stopped is None:  # (the coordinator's owner waited for it)
            stopped = link.stopped
        if beats is not None:  # not at exit: a forked rank runs the launcher's exit hooks
            beats.close()
    status = summarize(list(sup.ranks.values()), completion, stopped)
    record_completion(completion)
    record_stop(None if completion is not None else stopped)
    if sup.stop_signal is not None and status != 0:  # ranks that saved and left cleanly (e.g.
        return 128 + sup.stop_signal                   # --exit-signal-handler) make it a 0
    return status


STOP_VERDICT_WAIT = 3.0  # seconds: the coordinator's stop may follow this node's exit reports


def stop_verdict(link, ranks: list[Rank]) -> str | None:
    """Why the coordinator stopped the job, if it did. When every process of this node failed,
    the verdict may be a moment behind their exit reports (a second without a replica holding
    the state): wait for it, bounded, unless the job declared completion."""
    failed = all(r.exit_code != 0 for r in ranks if not r.replaced)
    deadline = time.monotonic() + (STOP_VERDICT_WAIT if failed else 0.0)
    while (reason := link.stop_reason()) is None and time.monotonic() < deadline \
            and link.completion() is None:
        time.sleep(0.1)
    return reason


def record_completion(completion: tuple[int, frozenset[int]] | None) -> None:
    """RECOVER_COMPLETION_FILE (the sbatch script sets it): that the job declared itself complete,
    which srun cannot tell -- a lost node's task fails the step even when the survivors finished."""
    path = os.environ.get("RECOVER_COMPLETION_FILE")
    if path and completion is not None:
        epoch, dead = completion
        with open(path, "w") as f:
            f.write(f"declared complete at epoch {epoch} with rank(s) {sorted(dead)} dead\n")


def record_stop(stopped: str | None) -> None:
    """RECOVER_STOPPED_FILE (the sbatch script sets it): that the coordinator stopped the job (no
    replica holds the training state), so the batch job ends with the restart status 3."""
    path = os.environ.get("RECOVER_STOPPED_FILE")
    if path and stopped is not None:
        with open(path, "w") as f:
            f.write(f"stopped: {stopped}\n")


if __name__ == "__main__":
    status = main()
    # Not sys.exit: a thread abandoned on a cut link (`collectives/bounded_call.py`) or a watch
    # still retrying a dead address sits inside torch's C++, and the interpreter's finalization
    # around it ends in std::terminate (SIGABRT) instead of this status.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
