"""The seam ReCoVer needs: however the M microbatch ids are split across replicas, the reduced
gradient is the same -- including with dropout on, because masks are seeded by microbatch id."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.training.arguments import parse_and_validate
from megatron.training.config.io import DataConfig, TokenizerConfig
from megatron.training.data.datasets import build_datasets
from megatron.training.initialize import build_groups, torch_group_factory
from megatron.training.config import ModelConfig
from megatron.training.model import build_model
from megatron.training.data.tokenizer import build_tokenizer, padded_vocab_size
from megatron.training.step.parts import build_stages
from recover_patches.pipeline.p2p import StageLink
from recover_patches.recovery.grad_buffer import GradBuffer
from recover_patches.recovery.reduce import Totals, check_commit
from recover_patches.pipeline.rng import install_rng_tracker
from recover_patches.pipeline.schedule import run_1f1b
from recover_patches.topology import Topology
from tests._launch_util import TINY_GPT

M = 8
IDS = list(range(16, 16 + M))  # iteration 2's microbatches


@pytest.fixture(scope="module")
def world():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    args = parse_and_validate([*TINY_GPT, "--train-iters", "4", "--hidden-dropout", "0.1",
                               "--attention-dropout", "0.1"], world_size=1)
    groups = build_groups(Topology(1, 1, 1), 0, torch_group_factory)
    tokenizer = build_tokenizer(TokenizerConfig.from_args(args))
    train, _, _ = build_datasets(DataConfig.from_args(args), tokenizer)
    vocab = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by, 1)
    return args, groups, train, vocab, install_rng_tracker()


def local_gradient(model, ids, world) -> tuple[torch.Tensor, Totals]:
    """One replica's accumulated gradient over `ids`, through the trainer's gradient buffer."""
    args, groups, train, vocab, tracker = world
    buf = GradBuffer(list(model.parameters()), replicas=1, dp_group=None)
    link = StageLink(groups.pp, 0, 1, (args.seq_length, args.micro_batch_size, args.hidden_size))
    stage = build_stages(DataConfig.from_args(args), args.micro_batch_size, groups, model, train,
                         tracker)[0]
    done = run_1f1b(ids, stage, link)
    reduced = buf.reduce(Totals.of_ids(done.ids, done.tokens), replica=0, time_wire=1.0)
    return buf.reduced_grads.clone(), reduced.totals


def reduced_gradient(world, assignment: list[list[int]]) -> tuple[torch.Tensor, Totals]:
    """Each list is one replica's quota, computed on its own fresh model copy; the 'DP reduction'
    is the sum of the replicas' out-of-place gradient buffers."""
    args, groups, train, vocab, tracker = world
    flat, totals = None, Totals.of_ids([])
    for quota in assignment:
        model = build_model(ModelConfig.from_args(args, vocab), groups.pg_collection(), 0, 0)
        model.train()
        part, part_totals = local_gradient(model, quota, world)
        flat = part if flat is None else flat + part
        totals = totals + part_totals
    check_commit(totals, IDS)
    return flat / totals.tokens, totals


def split(sizes: list[int]) -> list[list[int]]:
    out, start = [], 0
    for n in sizes:
        out.append(IDS[start:start + n])
        start += n
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sizes", [[4, 4], [5, 3], [0, 8], [1, 2, 5], [3, 0, 3, 2]])
def test_any_split_gives_the_same_gradient(world, sizes):
    reference, ref_totals = reduced_gradient(world, split([M]))
    grad, totals = reduced_gradient(world, split(sizes))
    assert totals == ref_totals
    rel = (grad - reference).norm() / reference.norm()
    assert rel <= 1e-6, f"split {sizes}: relative gradient difference {rel:.2e}"


@pytest.mark.timeout(300)
def test_a_lost_microbatch_changes_the_gradient(world):
    """The comparison above is sharp enough to see one microbatch missing."""
    reference, _ = reduced_gradient(world, split([M]))
    args, groups, train, vocab, tracker = world
    model = build_model(ModelConfig.from_args(args, vocab), groups.pg_collection(), 0, 0)
    part, part_totals = local_gradient(model, IDS[:-1], world)
    with pytest.raises(Exception, match="microbatches"):
        check_commit(part_totals, IDS)
    rel = (part / part_totals.tokens - reference).norm() / reference.norm()
    assert rel > 1e-3


RECOMPUTE = {"selective": ["--recompute-activations"],
             "full-uniform": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                              "--recompute-num-layers", "2"],
             "full-block": ["--recompute-granularity", "full", "--recompute-method", "block",
                            "--recompute-num-layers", "3"]}


def recompute_gradient(world, flags: list[str]) -> torch.Tensor:
    args, groups, train, vocab, tracker = world
    recompute_args = parse_and_validate([*TINY_GPT, "--train-iters", "4", "--hidden-dropout", "0.1",
                                         "--attention-dropout", "0.1", *flags], world_size=1)
    model = build_model(ModelConfig.from_args(recompute_args, vocab), groups.pg_collection(),
                        0, 0)
    model.train()
    grad, _ = local_gradient(model, IDS[:3], world)
    return grad


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", list(RECOMPUTE))
def test_recompute_draws_the_same_dropout_masks(world, kind):
    """megatron-core's activation recompute replays each microbatch's RNG streams: with dropout
    on, the gradient is bitwise the one without recompute."""
    assert torch.equal(recompute_gradient(world, RECOMPUTE[kind]), recompute_gradient(world, []))


@pytest.mark.timeout(300)
def test_recompute_without_rng_replay_would_differ(world, monkeypatch):
    """Negative control: if the recompute did not restore the RNG states, the masks would differ."""
    from megatron.core.tensor_parallel import random as mcore_random

    reference = recompute_gradient(world, [])
    monkeypatch.setattr(mcore_random, "_set_all_rng_states", lambda *states: None)
    assert not torch.equal(recompute_gradient(world, RECOMPUTE["full-uniform"]), reference)


def test_the_fused_cross_entropy_gives_the_same_gradient(world):
    """--cross-entropy-loss-fusion: megatron-core's fused vocab-parallel cross entropy, through
    the stage: the same loss to fp32 round-off, and the same gradient to bf16's precision (the
    fused kernel returns the logits' gradient in bf16, as in Megatron-LM, whatever the dtype)."""
    args, groups, train, vocab, tracker = world
    fused_args = parse_and_validate([*TINY_GPT, "--train-iters", "4", "--hidden-dropout", "0.1",
                                     "--attention-dropout", "0.1", "--cross-entropy-loss-fusion"],
                                    world_size=1)
    results = []
    for flags in (args, fused_args):
        model = build_model(ModelConfig.from_args(flags, vocab), groups.pg_collection(), 0, 0)
        buf = GradBuffer(list(model.parameters()), replicas=1, dp_group=None)
        link = StageLink(groups.pp, 0, 1, (args.seq_length, args.micro_batch_size,
                                           args.hidden_size))
        stage = build_stages(DataConfig.from_args(flags), args.micro_batch_size, groups, model,
                             train, tracker)[0]
        done = run_1f1b(IDS[:2], stage, link)
        buf.reduce(Totals.of_ids(done.ids, done.tokens), replica=0, time_wire=1.0)
        results.append((float(done.loss_sum), buf.reduced_grads.clone(), stage.cross_entropy))
    (plain_loss, plain_grad, plain_fn), (fused_loss, fused_grad, fused_fn) = results
    assert plain_fn is not fused_fn  # the flag chose megatron-core's kernel
    assert fused_loss == pytest.approx(plain_loss, rel=1e-6)
    error = float((fused_grad - plain_grad).norm() / plain_grad.norm())
    assert 0 < error < 2 ** -8, error  # bf16 keeps 8 significant bits
