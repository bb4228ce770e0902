"""--dist-ckpt-optim-fully-reshardable: the distributed optimizer's state in Megatron's
fully_reshardable layout, checked against megatron-core's own code for that layout, and resumed
exactly whichever layout the resuming run would write."""
from __future__ import annotations

from argparse import Namespace
from types import SimpleNamespace

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron.training.checkpointing.torch_dist import checkpoint_state, model_sharded
from megatron.training.checkpointing.reshardable import content_metadata
from megatron.training.checkpointing import LATEST_FILE, Checkpointer
from megatron.training.config.io import CheckpointConfig
from tests.test_checkpoint_dist import GPTTrainer, make_args, run
@pytest.fixture(autouse=True)
def _one_rank(one_rank_group):  # conftest's: save/load coordinate on the default group
    yield


FLAGS = ("--bf16", "--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable")


def megatron_cores_layout(trainer: GPTTrainer) -> dict:
    """megatron-core's `sharded_param_state_fully_reshardable` run on a stand-in for its
    DistributedOptimizer: one buffer holding the trainer's parameters back to back, its DP-rank-0
    gather answered with the trainer's main params and moments laid flat the same way."""
    params = trainer.optimizer.model_params
    state = trainer.optimizer.state_dict()
    mains = iter(state["fp32_from_fp16_params"])
    flat = {"param": [], "exp_avg": [], "exp_avg_sq": []}
    index_map, start = {}, 0
    for i, p in enumerate(params):
        index_map[p] = (start, start + p.numel(), 0)
        start += p.numel()
        flat["param"].append((next(mains) if p.dtype != torch.float32 else p).reshape(-1))
        for name in ("exp_avg", "exp_avg_sq"):
            flat[name].append(state["optimizer"]["state"][i][name].reshape(-1))
    world = {name: torch.cat(parts) for name, parts in flat.items()}
    stand_in = SimpleNamespace(
        gbuf_ranges=[{torch.float32: [None]}],
        buffers=[SimpleNamespace(param_index_map=index_map, numel_unpadded=start)],
        get_parameter_state_dp_zero=lambda **_: {0: {torch.float32: world}})
    return DistributedOptimizer.sharded_param_state_fully_reshardable(
        stand_in, model_sharded(trainer.training_state), is_loading=False, metadata={})


def test_the_layout_is_megatron_cores_fully_reshardable(tmp_path):
    trainer = GPTTrainer(make_args(tmp_path, *FLAGS))
    trainer.train_step()
    theirs = megatron_cores_layout(trainer)
    ours = checkpoint_state(trainer.training_state, trainer.args, trainer.optimizer.state_dict(), None,
                            fully_reshardable=True)["optimizer"]["param_state"]
    assert len(ours) == len(theirs) == len(trainer.optimizer.model_params)
    fields = ("key", "global_shape", "global_offset", "axis_fragmentations", "replica_id",
              "dtype")
    for i, mine in ours.items():
        assert set(mine) == set(theirs[i]) == {"param", "exp_avg", "exp_avg_sq"}
        for name, sharded in mine.items():
            expected = theirs[i][name]
            assert [getattr(sharded, f) for f in fields] == [getattr(expected, f) for f in fields]
            assert torch.equal(sharded.data, expected.data), (i, name)


@pytest.mark.parametrize("resume_flags", [FLAGS, FLAGS[:2]],
                         ids=["same-flags", "without-the-flag"])
def test_a_fully_reshardable_checkpoint_resumes_exactly(tmp_path, resume_flags):
    args = make_args(tmp_path, *FLAGS)
    first = GPTTrainer(args)
    reference = run(first, Checkpointer(CheckpointConfig.from_args(args), 0, 1), 4)
    directory = tmp_path / "ck" / "iter_0000002"
    with torch.serialization.safe_globals([Namespace]):  # as Megatron-LM registers it
        assert dist_checkpointing.load_content_metadata(str(directory)) == content_metadata()
    keys = dist_checkpointing.load_tensors_metadata(str(directory))
    weight = "embedding.word_embeddings.weight"
    assert {f"optimizer.state.{n}.{weight}" for n in ("param", "exp_avg", "exp_avg_sq")} <= \
        set(keys)
    assert f"optimizer.state.fp32_param.{weight}" not in keys  # not the regular optimizer's
    (tmp_path / "ck" / LATEST_FILE).write_text("2\n")

    torch.manual_seed(123)
    args = make_args(tmp_path, *resume_flags, "--load", str(tmp_path / "ck"))
    resumed = GPTTrainer(args)
    checkpointer = Checkpointer(CheckpointConfig.from_args(args), 0, 1)
    checkpointer.load(resumed)
    assert run(resumed, checkpointer, 2) == reference[2:]  # bitwise: moments and main params
    for a, b in zip(first.optimizer.main_params, resumed.optimizer.main_params):
        assert torch.equal(a, b)


def test_without_the_distributed_optimizer_the_flag_writes_the_regular_layout(tmp_path):
    """As in Megatron-LM, the flag only chooses the distributed optimizer's layout."""
    args = make_args(tmp_path, "--bf16", "--dist-ckpt-optim-fully-reshardable")
    run(GPTTrainer(args), Checkpointer(CheckpointConfig.from_args(args), 0, 1), 2)
    directory = str(tmp_path / "ck" / "iter_0000002")
    with torch.serialization.safe_globals([Namespace]):
        assert dist_checkpointing.load_content_metadata(directory) is None
    assert any(k.startswith("optimizer.state.fp32_param.")
               for k in dist_checkpointing.load_tensors_metadata(directory))

