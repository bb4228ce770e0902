"""Prove that no collective bypasses layer 1's ResilientProcessGroup (test-only harness).

Bootstrap may use plain torch groups: `init_process_group`, building the groups, and
megatron-core's `_get_param_groups` (an all_gather_object on the default group). Bootstrap is over
when `Trainer.train()` is entered -- the one place every rank passes after building everything and
before the first iteration. From then on, every collective / p2p method of the base
`torch.distributed.ProcessGroup` class raises `ShimBypass`.

Why patching the base class catches everything that matters: torch.distributed's functions
(all_reduce, all_gather_into_tensor, send, isend, batch_isend_irecv, all_gather_object, barrier,
...) all end in a method call on the group object. ResilientProcessGroup overrides the operations
it supports in Python, so its calls never reach the base class; a plain group's calls (including
the default group, `group=None`) always do, and so does an operation the shim does not implement.
Not covered: torch's functional collectives (`torch.ops._c10d_functional`, resolved by group name
in C++); megatron-core uses them only in FSDP, which this trainer does not use.

`ShimBypass` is not a RuntimeError on purpose: the shim turns RuntimeErrors of its backend into
PeerFailure, and recovery must not be able to swallow a bypass. Each violation is also printed to
stderr at once, so even a swallowed one is seen by the test.
"""
from __future__ import annotations

import importlib.abc
import os
import sys
import traceback

PREFIX = "[strict-groups]"
GUARDED_METHODS = (
    "allreduce", "allreduce_coalesced", "allgather", "_allgather_base", "all_gather_single",
    "allgather_coalesced", "allgather_into_tensor_coalesced", "all_gather_single_coalesced",
    "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
    "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced", "broadcast", "barrier",
    "monitored_barrier", "send", "recv", "recv_anysource", "reduce", "gather", "scatter",
    "alltoall", "alltoall_base", "all_to_all_single",
)


class ShimBypass(Exception):
    """A collective reached a plain torch ProcessGroup after bootstrap."""


class _State:
    bootstrap_over = False
    bootstrap_calls = 0  # operations on plain groups during bootstrap: proves the patch is live


def _rank() -> str:
    return os.environ.get("RANK", "?")


def _say(text: str) -> None:
    sys.stderr.write(f"{PREFIX} rank {_rank()}: {text}\n")
    sys.stderr.flush()


def _describe(group) -> str:
    kind = type(group).__name__
    name = getattr(group, "name", None)
    if not isinstance(name, str):  # a plain group: torch's description ("tp.replica0.stage0", ...)
        try:
            name = group.group_desc
        except Exception:
            name = "?"
    return f"{kind} {name!r}"


def _caller() -> str:
    """The first frame outside torch and this harness: who issued the operation."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace(os.sep, "/")
        if "/torch/" not in path and not path.endswith("strict_groups_harness.py"):
            return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "?"


def _guard(name: str, original):
    def guarded(self, *args, **kwargs):
        if _State.bootstrap_over:
            message = (f"BYPASS: ProcessGroup.{name} on {_describe(self)} after bootstrap, "
                       f"called from {_caller()}")
            _say(message)
            raise ShimBypass(message)
        _State.bootstrap_calls += 1
        return original(self, *args, **kwargs)
    guarded.__name__ = name
    guarded.__wrapped__ = original
    return guarded


def patch_process_group(dist) -> None:
    for name in GUARDED_METHODS:
        original = getattr(dist.ProcessGroup, name, None)
        if original is not None and not hasattr(original, "__wrapped__"):
            setattr(dist.ProcessGroup, name, _guard(name, original))


def mark_bootstrap_over() -> None:
    if not _State.bootstrap_over:
        _State.bootstrap_over = True
        _say(f"bootstrap over after {_State.bootstrap_calls} operation(s) on plain groups; "
             "from now on they raise ShimBypass")


def wrap_trainer(training_module) -> None:
    trainer = training_module.Trainer
    original = trainer.train  # AttributeError here fails the run loudly: the marker moved

    def train(self, *args, **kwargs):
        mark_bootstrap_over()
        return original(self, *args, **kwargs)
    trainer.train = train


class _PostImportHooks(importlib.abc.MetaPathFinder):
    """Runs a hook right after a module's code has executed, before anyone can use it."""

    def __init__(self, hooks: dict):
        self.hooks = hooks

    def find_spec(self, fullname, path, target=None):
        hook = self.hooks.get(fullname)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            execute = spec.loader.exec_module

            def exec_module(module):
                execute(module)
                hook(module)
            spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    def on_dist(module) -> None:
        if module.is_available():
            patch_process_group(module)

    hooks = {"torch.distributed": on_dist, "megatron.training.training": wrap_trainer}
    for name, hook in list(hooks.items()):
        if name in sys.modules:  # already imported: patch now
            hook(sys.modules[name])
            del hooks[name]
    sys.meta_path.insert(0, _PostImportHooks(hooks))
