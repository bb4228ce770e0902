"""The command line of `python scripts/chaos.py` (its docstring is the usage)."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from scripts.chaos import verdict
from scripts.chaos.cluster import REPO, ClusterSettings
from scripts.chaos.launches import JobHistory, run_job
from scripts.chaos.plan import KINDS, JobShape, menu, plan
from scripts.chaos.site import Site
from scripts.etcd_members import ETCD
from scripts.hosts import available as hosts_available


class UsageError(Exception):
    """A bad command line: one line, exit 2, nothing started or written."""


def flag(flags: list[str], name: str, default: str | None = None) -> str | None:
    """The value of `name` among the training flags (the last one given wins, as argparse's)."""
    value = default
    for i, item in enumerate(flags):
        if item == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif item.startswith(name + "="):
            value = item.split("=", 1)[1]
    return value


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    from scripts.chaos.cli import build_parser
    ours, sep, script = (argv[:argv.index("--")], "--", argv[argv.index("--") + 1:]) \
        if "--" in argv else (argv, "", [])
    args = build_parser().parse_args(ours)
    if not sep or not script:
        raise UsageError("give the training flags after `--`: scripts/chaos.py ... -- "
                         "<pretrain_gpt_recover.py flags>")
    for name in ("--metrics-file", "--save", "--save-interval", "--train-iters"):
        if flag(script, name) is None:
            raise UsageError(f"{name} is needed after `--`: the harness restarts from "
                             "checkpoints and reads every launch's records")
    for name in ("--metrics-file", "--save"):
        path = Path(str(flag(script, name)))
        if path.exists() and (path.is_file() or any(path.iterdir())):
            raise UsageError(f"{name} {path} already holds a run: the harness appends every "
                             "launch's records and resumes from its checkpoints; remove it or "
                             "pass another path")
    if args.nodes < 2 or args.nproc_per_node < 1 or args.faults < 0 or args.standby < 1:
        raise UsageError("--nodes 2 or more, --nproc-per-node 1 or more, --standby 1 or more, "
                         "--faults 0 or more")
    return args, script


def shape_of(args: argparse.Namespace, script: list[str]) -> JobShape:
    def number(name: str, default: str) -> int:
        return int(str(flag(script, name, default)))
    eval_interval = flag(script, "--eval-interval")
    return JobShape(args.nodes * args.nproc_per_node, args.nproc_per_node,
                    number("--train-iters", "0"), float(str(flag(script, "--recover-timeout",
                                                                  "10"))),
                    number("--pipeline-model-parallel-size", "1"),
                    number("--tensor-model-parallel-size", "1"), number("--save-interval", "0"),
                    int(eval_interval) if eval_interval else None)


def without_flag(flags: list[str], name: str) -> list[str]:
    out, skip = [], False
    for item in flags:
        if skip:
            skip = False
        elif item == name:
            skip = True
        elif not item.startswith(name + "="):
            out.append(item)
    return out


def with_flag(flags: list[str], name: str, value: str) -> list[str]:
    """`flags` with `name value` set (replacing a given one)."""
    return [*without_flag(flags, name), name, value]


def reference_run(args: argparse.Namespace, script: list[str], out: Path,
                  env: dict[str, str]) -> tuple[Path, Path, float]:
    """The failure-free run: one launcher of every rank, same flags, no fault; its records, its
    final checkpoint's directory and its wall time."""
    directory = out / "reference"
    shutil.rmtree(directory, ignore_errors=True)
    flags = with_flag(with_flag(without_flag(script, "--load"), "--metrics-file",
                                str(directory / "metrics.jsonl")),
                      "--save", str(directory / "checkpoints"))
    directory.mkdir(parents=True)
    cmd = [sys.executable, "-m", "recover_patches.launch", "--nproc-per-node",
           str(args.nodes * args.nproc_per_node), "--master-port", "0",
           str(REPO / "pretrain_gpt_recover.py"), *flags]
    started = time.monotonic()
    with open(directory / "out", "w") as stdout, open(directory / "err", "w") as stderr:
        proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
                                stdout=stdout, stderr=stderr, start_new_session=True)
        try:
            status = proc.wait(timeout=args.stall_limit * 5)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # whatever its group left
            proc.wait()
    if status != 0:
        raise RuntimeError(f"the failure-free run failed (status {status}): see {directory}")
    return directory / "metrics.jsonl", directory / "checkpoints", time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    try:
        args, script = parse(sys.argv[1:] if argv is None else argv)
        shape = shape_of(args, script)
        kinds = KINDS if args.kinds is None else dict(
            (k, int(w)) for k, _, w in (item.partition("=") for item in args.kinds.split(",")))
        netns = not args.no_netns and hosts_available()
        if args.etcd and ETCD is None:
            raise UsageError("--etcd needs the etcd binary (Debian: apt install etcd-server)")
        faults = plan(args.seed, args.faults, shape, menu(kinds, netns, args.etcd))
    except (UsageError, ValueError) as err:
        print(f"chaos.py: error: {err}", file=sys.stderr)
        return 2
    from scripts.chaos.report import report
    env = {"RECOVER_EMULATE_NCCL": "1", "RECOVER_EMULATE_NCCL_TRANSPORT": args.emulate_nccl} \
        if args.emulate_nccl else {}
    out = Path(args.out or f"runs/chaos/seed{args.seed}")
    out.mkdir(parents=True, exist_ok=True)
    where = ("a network namespace each" if netns else "on loopback: no cut faults") + (
        ", the coordinator elected through 3 etcd members" if args.etcd else "")
    print(f"chaos: seed {args.seed}, {len(faults)} faults planned over {args.nodes} nodes x "
          f"{args.nproc_per_node} ranks ({where}); the failure-free run first", flush=True)
    ref_metrics, ref_ckpt, ref_wall = reference_run(args, script, out, env)
    metrics = Path(str(flag(script, "--metrics-file")))
    if flag(script, "--load") is None:
        script = [*script, "--load", str(flag(script, "--save"))]
    ledger = out / "ledger"
    shutil.rmtree(ledger, ignore_errors=True)
    ledger.mkdir()
    settings = ClusterSettings(args.nodes, args.nproc_per_node, args.standby, tuple(script),
                               tuple(env.items()), str(ledger))
    (out / "plan.json").write_text(json.dumps([f.spec() for f in faults], indent=1))
    site = Site(args.nodes, netns, args.etcd, out / "etcd")
    try:
        history = _run_with_progress(settings, site, faults, metrics, out, args, shape)
    finally:
        site.close()
    return report(history, shape, script, out, ref_metrics, ref_ckpt, ref_wall)


def _run_with_progress(settings, site, faults, metrics: Path, out: Path, args, shape
                       ) -> JobHistory:
    from tqdm import tqdm
    with tqdm(total=shape.train_iters, desc="records", unit="it", file=sys.stderr,
              disable=not sys.stderr.isatty()) as bar:
        return run_job(settings, site, faults, metrics, out, args.stall_limit,
                       args.max_launches or args.faults + 4, progress=bar.update)
