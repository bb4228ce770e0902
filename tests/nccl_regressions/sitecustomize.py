"""Test-only: loaded at interpreter start when this directory is on PYTHONPATH.

With RECOVER_PUT_BACK=<bug>[,<bug>...] it puts bugs a GPU found back into the processes of a
run (the launcher's ranks inherit the environment), so a test can show that the emulated NCCL
makes the run fail or hang the way the GPU did:

  work-result-name  a work's WorkResult read as an enum's name (torch hands over the integer):
                    every success is taken for a failure, so no communicator connects;
  missing-work      a synchronous collective's missing work taken for a group that dropped it:
                    the first tensor-parallel all-reduce fails on every rank;
  busy-set-aside    a communicator with an operation in flight set aside for a shrink when an
                    epoch declares a member dead, instead of aborted: the survivor's stream waits
                    on it for ever, and so does its next host read;
  member-fate       a group's backend ends only when one of its own members dies, not when a
                    member's replica breaks;
  startup-is-t      start-up (the first connects, the first iteration) bounded by T like any
                    operation: a connect or a first iteration slower than T fails;
  silent-departure  a member that gives up on a backend tells nobody (NCCL's own behaviour).
                    With member-fate: a survivor whose partner left as a spare waits for it
                    until its watchdog's T, its replica gives up on it first, and the job stops
                    with no verdict (the H200's unexplained survivor).
Each patch is applied right after its module is first imported.
"""
import importlib.abc
import importlib.util
import os
import sys


def _result_as_enum_name(watchdog):
    watchdog._result_name = lambda value: getattr(value, "name", str(value))


def _missing_work(emulated):
    original = emulated.install

    def install(host_thread=True):
        import dataclasses

        from recover_patches.collectives import backends
        kind = original(host_thread)
        backends.KINDS[kind] = dataclasses.replace(backends.KINDS[kind], stream_work=lambda: None)
        return kind
    emulated.install = install


def _busy_set_aside(watchdog):
    forget = watchdog.Watchdog.forget

    def forget_as_if_idle(self, owner):
        forget(self, owner)
        return 0
    watchdog.Watchdog.forget = forget_as_if_idle


def _member_fate(initialize):
    initialize.unit_fate = lambda topology: frozenset


def _startup_is_t(initialize):
    factory = initialize.resilient_group_factory
    initialize.resilient_group_factory = lambda *args, **kwargs: factory(
        *args, **{**kwargs, "startup": 0.0})


def _silent_departure(departures):
    departures.announce = lambda store, prefix: None


BUGS = {
    "work-result-name": ("recover_patches.collectives.watchdog", _result_as_enum_name),
    "missing-work": ("recover_patches.collectives.emulated_nccl", _missing_work),
    "busy-set-aside": ("recover_patches.collectives.watchdog", _busy_set_aside),
    "member-fate": ("megatron.training.initialize.factories", _member_fate),
    "startup-is-t": ("megatron.training.initialize.factories", _startup_is_t),
    "silent-departure": ("recover_patches.collectives.process_group.departures",
                         _silent_departure),
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, module: str, patch):
        self.module, self.patch = module, patch

    def find_spec(self, name, path, target=None):
        if name != self.module:
            return None
        sys.meta_path.remove(self)  # find the real spec without us, once
        spec = importlib.util.find_spec(name)
        run, patch = spec.loader.exec_module, self.patch

        def exec_module(module):
            run(module)
            patch(module)
        spec.loader.exec_module = exec_module
        return spec


for _bug in filter(None, os.environ.get("RECOVER_PUT_BACK", "").split(",")):
    sys.meta_path.insert(0, _PatchAfterImport(*BUGS[_bug]))
