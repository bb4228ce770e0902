"""The harness's own flags (the training flags follow `--`)."""
from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scripts/chaos.py", usage="python scripts/chaos.py --nodes N --nproc-per-node P "
        "--faults K --seed S [--emulate-nccl [silent|socket]] [--etcd] -- "
        "<pretrain_gpt_recover.py flags>",
        description="A ReCoVer job over N launchers on this machine with K seeded random faults, "
                    "restarted from its checkpoints when one leaves no complete copy, judged "
                    "against the failure-free run.")
    p.add_argument("--nodes", type=int, default=2, help="launchers (nodes) of the job")
    p.add_argument("--nproc-per-node", type=int, default=4)
    p.add_argument("--faults", type=int, default=12, help="faults planned (a fault whose rank "
                   "waits as a spare at its point never fires; the last line counts those)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--emulate-nccl", nargs="?", const="silent", choices=["silent", "socket"],
                   default=None, help="run on the emulated NCCL (RECOVER_EMULATE_NCCL=1); how a "
                   "lost member shows: silent (default) or socket")
    p.add_argument("--standby", type=int, default=1,
                   help="standby launchers kept ready for lost nodes' slots")
    p.add_argument("--kinds", default=None, metavar="NAME=W,...",
                   help="the fault menu's weights (default: every kind; see scripts/chaos/plan.py)")
    p.add_argument("--no-netns", action="store_true",
                   help="keep every launcher on this machine's loopback even as root (default: "
                        "a network namespace each where they can be made; `cut` faults need it)")
    p.add_argument("--etcd", action="store_true",
                   help="elect the coordinator through 3 etcd members the harness starts "
                        "(--rdzv-backend etcd), and kill their leader among the faults")
    p.add_argument("--out", default=None, help="logs, plan, summary and plot "
                   "(default runs/chaos/seedS)")
    p.add_argument("--stall-limit", type=float, default=90.0,
                   help="seconds without a new record before a launch counts as hung")
    p.add_argument("--max-launches", type=int, default=None,
                   help="launches before giving up (default: faults + 4)")
    return p
