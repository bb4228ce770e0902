"""Megatron-FSDP's sharded parameters (optim_grads_params, design.md §19): between uses a rank holds
only its chunk of each module's parameters; each module gathers them for its forward and its
backward and frees them after. A shard group is a unit: in 2 groups of 2, rank 1 killed in a
backward costs its group, the other group finishes the lost microbatches in the same iteration on
one process's losses (the negative control, --recover-policy drop, leaves them out and leaves the
trajectory), and a replacement re-forms the group slot by slot from the live one. One group alone
cannot lose a member: the job stops with status 3 and says why. A hung member with exact
reduction keeps one process's bits; one group at TP 2 + SP, interleaved PP 2 and CP 2 follows one
process; a sharded checkpoint resumes in one process."""
from __future__ import annotations

import pytest
import torch

from megatron.training.arguments import parse_and_validate
from megatron.training.checkpointing import LATEST_FILE
from megatron.training.config.rules import megatron_differences
from megatron.training.optimizer.distributed.sharded_parameters import (ShardedParameters,
                                                                       ShardingRules)
from recover_patches.recovery.grad_buffer import flat_layout
from tests._launch_util import TINY_GPT, launch

FSDP = ["--use-megatron-fsdp", "--num-distributed-optimizer-instances", "2"]
# global batch 6: a group's 3 microbatches split 2 + 1 over its members, the short one pads
FLAGS = [*TINY_GPT, "--train-iters", "10", "--global-batch-size", "6", "--recover-balance", "even"]


def _two_layers() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    reference = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    reference.load_state_dict(model.state_dict())
    return model, reference


def _sharded(model: torch.nn.Module) -> ShardedParameters:
    params = list(model.parameters())
    module_of = {p: m for m, module in enumerate(model.modules())
                 for p in module.parameters(recurse=False)}
    gather = ShardedParameters(params, flat_layout(params, apart=module_of.__getitem__),
                               ShardingRules(keep_whole=lambda p: False))
    gather.watch(lambda: None, model)
    chunks = [torch.zeros(end - start) for start, end in gather.layout.buckets]
    for p, b in zip(params, gather.bucket_of):
        at = gather.layout.offsets[p] - gather.layout.buckets[b][0]
        chunks[b][at:at + p.numel()] = p.detach().reshape(-1)
    gather.after_step(chunks, [None] * len(chunks))  # (one member: its chunk is the bucket)
    return gather


def _held(model: torch.nn.Module) -> list[int]:
    return [p.untyped_storage().nbytes() for p in model.parameters()]


def test_each_module_is_gathered_for_its_forward_and_backward_and_freed_after():
    model, reference = _two_layers()
    _sharded(model)
    assert _held(model) == [0, 0, 0, 0]  # after the step: only the chunks
    seen = []
    model[2].register_forward_pre_hook(lambda m, a: seen.append(_held(model)))
    x = torch.randn(4, 6)
    out = model(x)
    assert seen == [[0, 0, 60, 12]]  # the second layer runs whole, the first freed again
    assert _held(model) == [0, 0, 0, 0]
    torch.testing.assert_close(out, reference(x), rtol=0, atol=0)
    out.square().sum().backward()
    reference(x).square().sum().backward()
    assert _held(model) == [0, 0, 0, 0]  # each module freed once its gradients were in
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=0)


def test_reading_or_loading_the_weights_outside_a_forward_makes_them_whole():
    model, reference = _two_layers()
    gather = _sharded(model)
    gather.finish()  # (a save, a join's donor, --log-params-norm)
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine, theirs)
    model(torch.randn(2, 6))
    assert _held(model) == [0, 0, 0, 0]
    model[2].load_state_dict(reference[2].state_dict())  # a load starting below the root (a
    assert _held(model) == [120, 20, 60, 12]  # model chunk): every parameter's storage back
    model(torch.randn(2, 6))
    model.load_state_dict(reference.state_dict())  # a checkpoint, a join: storage back first
    assert _held(model) == [120, 20, 60, 12]
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine, theirs)


def _flags(*given: str):
    return parse_and_validate([*TINY_GPT, "--train-iters", "2", *given], world_size=4)


def test_megatron_fsdp_runs_the_distributed_optimizer_and_writes_fsdp_dtensor_as_torch_dist():
    args = _flags(*FSDP, "--ckpt-format", "fsdp_dtensor")
    assert args.use_distributed_optimizer
    said = megatron_differences(args, "cpu")
    assert any(line.startswith("--ckpt-format fsdp_dtensor: checkpoints are written as "
                               "torch_dist") for line in said), said
    assert any(line.startswith("--data-parallel-sharding-strategy optim_grads_params")
               for line in said), said


def test_torch_fsdp2_runs_as_the_same_sharding_and_says_what_it_survives():
    args = _flags("--use-torch-fsdp2")
    assert args.use_distributed_optimizer and args.use_megatron_fsdp
    assert any(line.startswith("--use-torch-fsdp2: runs as --use-megatron-fsdp's sharded "
                               "parameters") and "in 1 shard group" in line
               for line in megatron_differences(args, "cpu"))


@pytest.mark.parametrize("given,named", [
    (["--ckpt-format", "fsdp_dtensor"], "--ckpt-format"),  # Megatron-FSDP's format alone
    ([*FSDP, "--megatron-fsdp-version", "2"], "--megatron-fsdp-version"),
    (["--use-megatron-fsdp", "--num-experts", "4", "--expert-model-parallel-size", "2"],
     "--expert-model-parallel-size"),
    (["--use-megatron-fsdp", "--check-weight-hash-across-dp-replicas-interval", "1"],
     "--check-weight-hash-across-dp-replicas-interval"),
    (["--use-megatron-fsdp", "--rerun-mode", "report_stats"], "--rerun-mode"),
    (["--use-torch-fsdp2", "--use-megatron-fsdp"], "--use-torch-fsdp2")])
def test_what_megatron_fsdp_does_not_run_with_is_one_line(given, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _flags(*given)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"error: {named}: " in err and err.count("\n") == 1, err


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = launch(1, FLAGS, tmp_path_factory.mktemp("fsdp-ref") / "m.jsonl")
    assert run.returncode == 0, run.stderr[-3000:]
    return run.losses()


def _close(mine: list[float], ref: list[float]) -> bool:
    return len(mine) == len(ref) and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(mine, ref))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_shard_group_lost_in_a_backward_costs_the_group_and_grows_back(reference, tmp_path):
    """Rank 1 dies in a backward of iteration 3: its parameter gather fails in rank 0, group 0
    leaves, group 1 computes its three microbatches, a replacement and rank 0 re-form group 0 from
    group 1 (slot k from replica 2 + k), and all ten iterations keep one process's losses. (Rank
    2 is slowed from iteration 4 on, so that the replacement starts before the run ends.)"""
    run = launch(4, [*FLAGS, *FSDP, "--inject-fault", "kill:rank=1,iter=3,phase=backward",
                     "--inject-fault", "slow:rank=2,seconds=0.2,iter=4,phase=forward"],
                 tmp_path / "m.jsonl", launcher_args=["--max-replacements", "1"])
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "distopt.tp0.stage0.replicas0.allgather failed" in out  # a module's gather
    assert "lost microbatches [12, 13, 14] -> replica 2: [12, 13], replica 3: [14]" in out
    live = [r["live_replicas"] for r in run.records if "lm_loss" in r]
    assert live[2] == [2, 3] and live[-1] == [0, 1, 2, 3], live
    assert "rank 1: after iteration" in out and "replicas [1] joined (state from replica 3" in out
    assert _close(run.losses(), reference), (run.losses(), reference)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_dropping_the_lost_groups_microbatches_leaves_the_trajectory(reference, tmp_path):
    """The negative control: the same death with the replica-dropping baseline."""
    run = launch(4, [*FLAGS, *FSDP, "--recover-policy", "drop", "--recover-spares", "off",
                     "--inject-fault", "kill:rank=1,iter=3,phase=backward"],
                 tmp_path / "m.jsonl", launcher_args=[])
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    mine = run.losses()
    assert _close(mine[:2], reference[:2]) and not _close(mine, reference), (mine, reference)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_one_shard_group_cannot_lose_a_member_and_stops_saying_why(tmp_path):
    run = launch(2, [*FLAGS, "--use-megatron-fsdp", "--recover-spares", "off",
                     "--inject-fault", "kill:rank=1,iter=2,phase=backward"],
                 tmp_path / "m.jsonl", launcher_args=[])
    out = run.stdout + run.stderr
    assert run.returncode == 3, out[-3000:]
    assert "--use-megatron-fsdp with --num-distributed-optimizer-instances 1 is one shard group" \
        in out, out[-3000:]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [
    ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
    ["--context-parallel-size", "2"]])  # (norms summed per replica: each counts its shards)
def test_one_shard_group_of_two_follows_one_process_at_tp_pp_and_cp(reference, tmp_path, layout):
    run = launch(4, [*FLAGS, "--use-megatron-fsdp", *layout], tmp_path / "m.jsonl")
    assert run.returncode == 0, run.stderr[-3000:]
    assert _close(run.losses(), reference), (run.losses(), reference)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_sharded_checkpoint_resumes_in_one_process(reference, tmp_path):
    """Saved by 2 groups of 2 with Megatron-LM's --ckpt-format fsdp_dtensor (written as
    torch_dist), iteration 2 resumes in one process on the uninterrupted losses."""
    ckpt = tmp_path / "ckpt"
    saved = launch(4, [*FLAGS, *FSDP, "--ckpt-format", "fsdp_dtensor", "--save", str(ckpt),
                       "--save-interval", "2"], tmp_path / "a.jsonl")
    assert saved.returncode == 0, saved.stderr[-3000:]
    assert list((ckpt / "iter_0000002").glob("*.distcp"))
    (ckpt / LATEST_FILE).write_text("2")
    resumed = launch(1, [*FLAGS, "--load", str(ckpt)], tmp_path / "b.jsonl")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _close(resumed.losses(), reference[2:]), (resumed.losses(), reference)
    assert _close(saved.losses(), reference), (saved.losses(), reference)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_hung_member_with_exact_reduction_keeps_one_process_bits(tmp_path):
    """Rank 2 hangs in a forward of iteration 3 (its group-mate's gather times out); with
    --recover-exact-reduction and overlapped bucket reductions the recovered run's losses and
    gradient norms are one process's, bit for bit."""
    exact = [*FLAGS, "--train-iters", "4", "--recover-exact-reduction"]
    one = launch(1, exact, tmp_path / "one.jsonl")
    assert one.returncode == 0, one.stderr[-3000:]
    run = launch(4, [*exact, *FSDP, "--overlap-grad-reduce", "--ddp-bucket-size", "2000",
                     "--recover-spares", "off", "--recover-timeout", "5",
                     "--inject-fault", "hang:rank=2,iter=3,phase=forward"],
                 tmp_path / "m.jsonl", launcher_args=[])
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert "distopt.tp0.stage0.replicas2.allgather failed" in run.stdout + run.stderr
    mine = [(r["lm_loss"], r["grad_norm"]) for r in run.records if "lm_loss" in r]
    assert mine == [(r["lm_loss"], r["grad_norm"]) for r in one.records if "lm_loss" in r]
    assert [r["live_replicas"] for r in run.records if "lm_loss" in r][-1] == [0, 1]
