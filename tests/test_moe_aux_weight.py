"""MoE: the auxiliary losses' weight, end to end in one process: ReCoVer sums each microbatch's
token losses and divides the reduced gradient by the iteration's tokens, and sets megatron-core's
aux-loss gradient scale to a microbatch's nominal tokens before each backward. The resulting
gradient must equal Megatron-LM's: each microbatch's mean token loss over M, with the aux scale
1 / M (`MoEAuxLossAutoScaler.set_loss_scale(loss_scale / num_microbatches)` in its forward step).
The router's gradient, where the aux losses act, is compared; a scale of 1 instead of the
tokens (the control) changes it."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from megatron.training.arguments import parse_and_validate
from megatron.training.config import ModelConfig
from megatron.training.config.io import DataConfig, TokenizerConfig
from megatron.training.data.datasets import build_datasets
from megatron.training.initialize import build_groups, torch_group_factory
from megatron.training.model import build_model
from megatron.training.step.parts import build_stages
from megatron.training.data.tokenizer import build_tokenizer, padded_vocab_size
from recover_patches.pipeline.p2p import StageLink
from recover_patches.pipeline.rng import install_rng_tracker
from recover_patches.pipeline.schedule import run_1f1b
from recover_patches.recovery.grad_buffer import GradBuffer
from recover_patches.recovery.reduce import Totals
from recover_patches.topology import Topology
from tests._launch_util import TINY_GPT

IDS = list(range(8, 12))  # four microbatches
MOE = ["--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2",
       "--moe-aux-loss-coeff", "1.0", "--moe-z-loss-coeff", "0.1"]


@pytest.fixture(scope="module")
def world():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    args = parse_and_validate([*TINY_GPT, "--train-iters", "4", *MOE], world_size=1)
    groups = build_groups(Topology(1, 1, 1), 0, torch_group_factory)
    tokenizer = build_tokenizer(TokenizerConfig.from_args(args))
    train, _, _ = build_datasets(DataConfig.from_args(args), tokenizer)
    vocab = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by, 1)
    yield args, groups, train, vocab, install_rng_tracker()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))


def router_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) if p.grad is not None else p.main_grad.reshape(-1)
                      for name, p in model.named_parameters() if ".router." in name])


def recover_gradient(world) -> torch.Tensor:
    """The trainer's path: the stage's token-sum losses and aux scale, the buffer's reduction,
    the division by the iteration's tokens."""
    args, groups, train, vocab, tracker = world
    model = build_model(ModelConfig.from_args(args, vocab), groups.pg_collection(), 0, 0)
    buf = GradBuffer(list(model.parameters()), replicas=1, dp_group=None)
    link = StageLink(groups.pp, 0, 1, (args.seq_length, args.micro_batch_size, args.hidden_size))
    stage = build_stages(DataConfig.from_args(args), args.micro_batch_size, groups, model, train,
                         tracker)[0]
    done = run_1f1b(IDS, stage, link)
    buf.reduce(Totals.of_ids(done.ids, done.tokens), replica=0, time_wire=1.0)
    buf.divide_gradients(done.tokens)
    for p in model.parameters():
        p.main_grad = buf.reduced_grad(p)  # the reduced values, where router_grads reads them
    return router_grads(model)


def megatron_gradient(world, aux_scale: float) -> torch.Tensor:
    """Megatron-LM's weighting of the same forwards: mean token loss / M, aux scale 1 / M."""
    args, groups, train, vocab, tracker = world
    model = build_model(ModelConfig.from_args(args, vocab), groups.pg_collection(), 0, 0)
    stage = build_stages(DataConfig.from_args(args), args.micro_batch_size, groups, model, train,
                         tracker)[0]
    for g in IDS:
        loss_sum = stage.forward(g, None)
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(aux_scale))
        (loss_sum / stage.tokens(g) / len(IDS)).backward()
    return router_grads(model)


def test_the_aux_losses_weigh_as_in_megatron(world):
    ours = recover_gradient(world)
    megatron = megatron_gradient(world, 1.0 / len(IDS))
    assert torch.allclose(ours, megatron, rtol=1e-5, atol=1e-9), (ours - megatron).abs().max()
    tokens = world[0].seq_length * world[0].micro_batch_size
    wrong = megatron_gradient(world, 1.0 / len(IDS) / tokens)  # as if the scale were 1
    assert not torch.allclose(ours, wrong, rtol=1e-3, atol=1e-7)
