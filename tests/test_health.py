"""Admission (`recover_patches/health.py`, the launcher's supervisor): a replacement process or a
standby node gets ranks only after the node's health check passes, and a node whose ranks failed
twice within the window gets none again."""
from __future__ import annotations

import logging
import subprocess
import sys
from types import SimpleNamespace

import pytest

from recover_patches import health
from recover_patches.supervisor import Rank, Supervisor
from tests._launch_util import REPO


def test_the_builtin_check_passes_on_a_working_device_and_names_a_broken_one(monkeypatch):
    assert health.check(health.BUILTIN, 0) is None  # in a fresh interpreter
    import torch.distributed as dist

    class LossyGloo:  # a backend that loses data
        def __init__(self, *args):
            pass

        def allreduce(self, tensors):
            for tensor in tensors:
                tensor.zero_()
            return SimpleNamespace(wait=lambda: True)
    monkeypatch.setattr(dist, "ProcessGroupGloo", LossyGloo)
    with pytest.raises(RuntimeError, match="a one-process all-reduce over gloo returned"):
        health.builtin_check(0)


def test_the_warm_launcher_forks_its_check_and_hears_why_it_failed():
    """The launcher forks the built-in check from its warm parent; what the child raised comes
    back as the one line, and a child killed without a word is no pass either (a fresh process
    here: this one may hold threads of a collective)."""
    code = ("from recover_patches import health\n"
            "assert health.check(health.BUILTIN, 0, fork=True) is None\n"
            "health.builtin_check = lambda local: (_ for _ in ()).throw(OSError('no device 0'))\n"
            "print(health.check(health.BUILTIN, 0, fork=True))\n"
            "import os, signal\n"  # a crash that leaves no word: the child is killed
            "health.builtin_check = lambda local: os.kill(os.getpid(), signal.SIGSEGV)\n"
            "print(health.check(health.BUILTIN, 0, fork=True))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines() == [
        "the built-in health check failed: OSError: no device 0",
        "the built-in health check failed: its process ended with -11"]


def test_a_command_check_passes_on_status_0_and_says_why_otherwise():
    assert health.check("exit 0", 0) is None
    assert health.check('test "$LOCAL_RANK" = 5', 5) is None  # the device it checks for
    why = health.check("echo GPU 3 fell off the bus >&2; exit 4", 3)
    assert why == "health check 'echo GPU 3 fell off the bus >&2; exit 4' exited 4: GPU 3 fell " \
                  "off the bus"
    assert "did not finish within 0.5s" in health.check("sleep 5", 0, timeout=0.5)
    assert health.check(health.OFF, 0) is None


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_two_failures_within_the_window_exhaust_a_node():
    clock = Clock()
    spaced = health.FailureWindow(window=10.0, clock=clock)
    spaced.note()
    clock.now = 15.0
    spaced.note()  # the first is out of the window by now
    assert not spaced.exhausted()
    clock.now = 20.0
    spaced.note()
    assert spaced.exhausted()
    unlimited = health.FailureWindow(window=0.0, clock=clock)  # --failure-window 0
    for _ in range(3):
        unlimited.note()
    assert not unlimited.exhausted()


class Link:
    """A coordinator link for a job that neither completed nor stopped."""

    def completion(self):
        return None

    def stop_reason(self):
        return None


def supervisor(admit) -> Supervisor:
    return Supervisor([], 1.0, Link(), respawn=lambda r: r, max_replacements=5, admit=admit,
                      failures=health.FailureWindow(window=600.0))


def test_a_replacement_starts_only_on_a_healthy_node_that_did_not_fail_twice(caplog):
    caplog.set_level(logging.INFO, logger="recover_patches.supervisor")
    killed = Rank(rank=1, pid=101, status=9)  # killed by SIGKILL
    assert not supervisor(lambda r: "GPU 1 is not visible")._should_replace(killed)
    assert "rank 1: no replacement on this node: GPU 1 is not visible" in caplog.text
    healthy = supervisor(lambda r: None)
    assert healthy._should_replace(killed)  # the node's first failure: replaced
    assert not healthy._should_replace(Rank(rank=2, pid=102, status=9))  # its second
    assert "2 rank failures on this node within 600s: it starts no replacement again" \
        in caplog.text
    assert not healthy._should_replace(Rank(rank=3, pid=103, status=3 << 8))  # a restart status


@pytest.mark.multiprocess
def test_a_standby_node_whose_check_fails_is_not_offered(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "recover_patches.launch", "--standby", "--nproc-per-node", "2",
         "--coordinator-port", "1", "--job-token", "t", "--health-check",
         'test "$LOCAL_RANK" = 0', str(REPO / "pretrain_gpt_recover.py")],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "this standby node is not offered to the job: health check " \
           "'test \"$LOCAL_RANK\" = 0' exited 1" in done.stderr  # its second device
    assert "standby 0.0" not in done.stderr  # no process was started
