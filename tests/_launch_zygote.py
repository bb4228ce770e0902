"""A warm interpreter that forks the tests' launcher processes, so that each launch does not pay
for importing torch and megatron-core again (about 8 s of the 2-core CI machine's time per launch,
the largest share of most multi-process tests).

It does what the launcher does for its ranks (`recover_patches.launch.preload`, then fork), one
level up: `python -m recover_patches.launch ARGS` becomes a child of this process that starts a
session of its own, takes the request's environment, working directory and output files, and runs
the launcher's module as `__main__`. Nothing else differs from a fresh interpreter started with
the same environment: the launcher imports the same modules in the same order, except that they
are already imported.

Protocol (one JSON object per line on stdin; one line back on stdout per request):
    {"args": [...], "env": {...}, "cwd": "...", "out": PATH, "err": PATH, "status": PATH}
    -> "<pid>\n"; when the launcher process ends, its exit code (Popen's convention: -N for a
       signal) is written to "status" (atomically). End of stdin ends the server.
"""
from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import sys
import traceback

_status_paths: dict[int, str] = {}


def _reap(_signum=None, _frame=None) -> None:
    """Record the exit code of every child that ended (SIGCHLD)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = _status_paths.pop(pid, None)
        if path is None:
            continue
        try:
            with open(path + ".tmp", "w") as f:
                f.write(str(os.waitstatus_to_exitcode(status)))
            os.replace(path + ".tmp", path)
        except OSError:  # its test's directory is gone: nobody is waiting for it any more
            pass


def _run_launcher(request: dict) -> None:
    """Body of the forked child: become `python -m recover_patches.launch ARGS`; never return."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the launcher reaps its own ranks
        os.setsid()  # the test kills the whole session, as with Popen(start_new_session=True)
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                                (1, request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            target = os.open(path, flags, 0o644)
            os.dup2(target, fd)
            os.close(target)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["recover_patches.launch", *request["args"]]
        try:
            runpy.run_module("recover_patches.launch", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        atexit._run_exitfuncs()  # as at interpreter exit
    except BaseException:  # noqa: BLE001 -- printed as an uncaught exception would be
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def serve() -> None:
    from recover_patches import launch, launch_args
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # as the launcher sets it
    launch.preload(launch_args.DEFAULT_PRELOAD)
    signal.signal(signal.SIGCHLD, _reap)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # record the path first
        pid = os.fork()
        if pid == 0:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            _run_launcher(request)
        _status_paths[pid] = request["status"]
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        print(pid, flush=True)


if __name__ == "__main__":
    serve()
