"""Files that readers see whole or not at all (checkpoints' commit points), pruning, and
--verify-integrity's manifest (Megatron's format: `integrity.json`, {"algorithm": "sha256",
"files": {name: hex digest}} over every other file of the checkpoint directory)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from megatron.training.checkpointing.format import iter_dir_name
from megatron.training.checkpointing.resume import read_latest


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


def drop_unretained(save_dir: Path, previous: int | None, iteration: int, interval: int) -> None:
    """--save-retain-interval, Megatron-LM's rule: once `latest` names a new checkpoint, the one
    it named before goes, unless its iteration is a multiple of the interval (or it is a
    symbolic link, which Megatron-LM leaves alone too)."""
    if previous is None or previous in (0, iteration) or previous % interval == 0:
        return
    old = save_dir / iter_dir_name(previous)
    if not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)


INTEGRITY_FILE = "integrity.json"
_CHUNK = 1 << 20


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_integrity_manifest(directory: Path) -> None:
    files = {p.name: sha256_of(p) for p in sorted(directory.iterdir())
             if p.is_file() and p.name != INTEGRITY_FILE}
    write_atomically(directory / INTEGRITY_FILE, json.dumps(
        {"algorithm": "sha256", "files": files}, indent=2).encode())


def integrity_failure(directory: Path, share: tuple[int, int] = (0, 1)) -> str | None:
    """What is wrong with `directory` against its manifest, checking the files of this `share`
    (index, count: the ranks split the hashing); None if nothing."""
    try:
        manifest = json.loads((directory / INTEGRITY_FILE).read_text())
    except (OSError, ValueError) as err:
        return f"no readable {INTEGRITY_FILE} ({err.__class__.__name__})"
    if manifest.get("algorithm", "sha256") != "sha256":
        return f"{INTEGRITY_FILE} uses {manifest['algorithm']!r}, not sha256"
    index, count = share
    for name, expected in sorted(manifest.get("files", {}).items())[index::count]:
        try:
            if sha256_of(directory / name) != expected:
                return f"{name} does not match its hash in {INTEGRITY_FILE}"
        except OSError:
            return f"{name} is missing or unreadable"
    return None
