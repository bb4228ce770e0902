"""A resilient group's entries in torch.distributed's group tables, so that `dist.get_rank(group)`,
`broadcast(src=...)` and torch's profiler treat it as any group."""
from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, BackendConfig

_TABLES = ("pg_map", "pg_group_ranks", "pg_backend_config")


def register(group: dist.ProcessGroup, kind: str, store, members: Sequence[int]) -> None:
    world = dist.distributed_c10d._world
    world.pg_map[group] = (kind, store)
    world.pg_group_ranks[group] = {g: i for i, g in enumerate(members)}
    # and its backend's configuration: torch's profiler lists every registered group's
    world.pg_backend_config[group] = str(BackendConfig(Backend(kind)))


def unregister(group: dist.ProcessGroup) -> None:
    for table in _TABLES:
        getattr(dist.distributed_c10d._world, table).pop(group, None)
