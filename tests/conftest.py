"""Markers (declared in pyproject.toml): `gpu` tests need CUDA (scripts/gpu/check.sh runs them on a GPU machine); elsewhere
they are skipped with that reason. `extended` is given here, from tests/extended.py."""
from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    from tests.extended import extended
    chosen = extended([item.nodeid for item in items])
    for item in items:
        if item.nodeid in chosen:
            item.add_marker(pytest.mark.extended)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run scripts/gpu/check.sh on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _logging_as_pytest_found_it():
    """An entry point run in-process (launch.main, a coordinator's main) configures logging for the
    whole process; undo it so the next test's caplog still sees every record."""
    yield
    import logging

    from recover_patches.log import PACKAGES
    for package in PACKAGES:
        logger = logging.getLogger(package)
        logger.handlers.clear()
        logger.setLevel(logging.NOTSET)
        logger.propagate = True


@pytest.fixture(autouse=True)
def _a_driver_lock_of_its_own():
    """The emulated NCCL's driver lock is the process's, and every test here shares the process:
    each test is a process of its own to the emulation, so no thread a test left waiting in a
    host read can hold a later test's destructors."""
    from recover_patches.collectives.emulated_nccl import streams
    streams.DRIVER = streams.DriverLock()
    yield


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A 1-rank gloo default group for the module (in-process save/load: their barriers and DCP
    run on it); one already set up by another module is reused."""
    import torch.distributed as dist
    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
