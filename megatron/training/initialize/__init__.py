"""Process-group set-up: the default group for bootstrap, then one group object per role.

Groups are made by a `GroupFactory` passed in (plain torch groups, or layer 1's resilient ones when
recovery is on), called only on member ranks, in one global order (tp, pp, replica, embedding, dp,
self) so creation never deadlocks. `factories` makes groups, `layout` says which a rank is in,
`groups.ParallelGroups` holds them for the running job.
"""
from megatron.training.initialize.factories import (GroupFactory, env_rank_world,
                                                    gather_switches, init_default_group, resilient_group_factory,
                                                    torch_group_factory, unit_fate)
from megatron.training.initialize.groups import ParallelGroups
from megatron.training.initialize.layout import build_groups, p2p_channels

__all__ = ["GroupFactory", "ParallelGroups", "build_groups", "env_rank_world", "gather_switches",
           "init_default_group", "p2p_channels", "resilient_group_factory",
           "torch_group_factory", "unit_fate"]
