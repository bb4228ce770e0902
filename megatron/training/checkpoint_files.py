"""Files that readers see whole or not at all (checkpoints' commit points), and pruning."""
from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from megatron.training.checkpoint_resume import iter_dir_name, read_latest


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes | Callable[[BinaryIO], None]) -> None:
    """Readers see the old file or the new one, never a torn one. `data`: the bytes, or what
    writes them into the open file (a large state is streamed, not held twice in memory)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        if isinstance(data, bytes):
            f.write(data)
        else:
            data(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def keep_only_latest(save_dir: Path) -> None:
    """Remove the committed checkpoints other than `latest`'s (global non-persistent saves)."""
    latest = read_latest(save_dir)
    if latest is None:  # nothing committed there yet
        return
    for old in save_dir.glob("iter_*"):
        if old.name != iter_dir_name(latest):
            shutil.rmtree(old, ignore_errors=True)
