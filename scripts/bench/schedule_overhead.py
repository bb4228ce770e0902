#!/usr/bin/env python
"""ms/iteration of ReCoVer's training iteration versus a plain training step, as a ratio from one run.

    OMP_NUM_THREADS=1 python scripts/bench/schedule_overhead.py [--iters 30] [--warmup 3] [--dropout 0.1]

One process, world size 1, the same tiny GPT built twice from identical weights, the same global
batch (the same microbatch ids through the same sampler) in both arms:
  recover  the real Trainer's transaction: plan, 1F1B over the ids (RNG seeded per microbatch),
           out-of-place reduction, commit check, step (tied sync, /tokens, clip, AdamW, LR schedule)
  plain    a textbook loop: forward, masked summed cross-entropy, backward per microbatch; then
           /tokens, clip_grad_norm_, AdamW, zero_grad
Iterations alternate recover/plain after warm-up, so machine load hits both arms alike.
With one process there is no communication: the ratio is the bookkeeping cost only.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from typing import Callable

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")  # megatron-core's own default

# The tiny model of the benchmark, in Megatron flags (vocab 511 + EOD = 512 after padding).
MODEL_FLAGS = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "16",
    "--lr", "1e-3", "--clip-grad", "1.0",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "511",
    "--log-interval", "1000000", "--eval-interval", "1000000", "--eval-iters", "1",
]
BOOTSTRAP_RESAMPLES = 2000


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30, help="timed iterations per arm (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations per arm (default 3)")
    parser.add_argument("--dropout", type=float, default=0.1,
                        help="hidden and attention dropout (default 0.1, Megatron's default)")
    args = parser.parse_args(argv)
    if args.iters < 1:
        parser.error("argument --iters: must be >= 1 (e.g. --iters 30)")
    if args.warmup < 1:
        parser.error("argument --warmup: must be >= 1, the first iteration reports the loss check")
    if not 0.0 <= args.dropout < 1.0:
        parser.error("argument --dropout: must be in [0, 1) (e.g. --dropout 0.1)")
    return args


class RecoverArm:
    """What `Trainer.train()` does per iteration, minus logging: next ids, transaction, state."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.transaction = trainer.transaction()  # exactly what Trainer.train() runs
        self.phase_seconds: list[dict[str, float]] = []

    def next_ids(self) -> list[int]:
        return self.trainer.microbatch_ids()

    def run(self, ids: list[int]) -> float:
        state = self.trainer.state
        outcome = self.transaction.run(state.iteration + 1, ids)
        state.iteration += 1
        state.consumed_samples += len(outcome.ids) * self.trainer.config.batches.micro_batch_size
        self.phase_seconds.append(outcome.seconds)
        return outcome.step["lm_loss"]


class PlainArm:
    """The textbook single-process loop over the same microbatches."""

    def __init__(self, model, sampler, args, vocab: int):
        import torch
        self.model, self.sampler, self.vocab, self.clip = model, sampler, vocab, args.clip_grad
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=args.lr, weight_decay=args.weight_decay,
                                           betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)

    def run(self, ids: list[int]) -> float:
        import torch
        import torch.nn.functional as F
        self.model.train()
        loss_total, tokens = 0.0, 0
        for g in ids:
            batch = self.sampler(g)
            logits = self.model(batch["tokens"], batch["position_ids"], None)
            token_loss = F.cross_entropy(logits.float().view(-1, self.vocab), batch["labels"].view(-1),
                                         reduction="none")
            mask = batch["loss_mask"].view(-1).float()
            loss = (token_loss * mask).sum()
            loss.backward()
            loss_total += float(loss.detach())
            tokens += int(mask.sum().item())
        for p in self.params:
            p.grad.div_(max(tokens, 1))
        torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_total / max(tokens, 1)


def build_arms(bench: argparse.Namespace):
    """Model, data, groups and both arms, exactly as pretrain_gpt_recover.py builds them."""
    import torch
    import torch.distributed as dist

    from megatron.training.arguments import parse_and_validate
    from megatron.training.config.io import DataConfig, TokenizerConfig
    from megatron.training.data.datasets import build_datasets
    from megatron.training.initialize import build_groups, torch_group_factory
    from megatron.training.metrics import MetricsWriter
    from megatron.training.config import (ModelConfig, OptimizerSetup, ScheduleConfig,
                                          StepConfig, TrainingConfig)
    from megatron.training.model import build_model
    from megatron.training.optimizer.setup import build_optimizer, build_scheduler
    from megatron.training.data.tokenizer import build_tokenizer, padded_vocab_size
    from megatron.training.step.parts import build_grad_buffer, build_stages, schedule_for
    from megatron.training.training import Trainer
    from recover_patches.faults import FaultInjector
    from recover_patches.pipeline.rng import install_rng_tracker
    from recover_patches.pipeline.sampler import MicrobatchSampler
    from recover_patches.topology import Topology

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dropout = str(bench.dropout)
    args = parse_and_validate([*MODEL_FLAGS, "--train-iters", str(bench.warmup + bench.iters),
                               "--hidden-dropout", dropout, "--attention-dropout", dropout], world_size=1)
    groups = build_groups(Topology(1, 1, 1), 0, torch_group_factory)
    tracker = install_rng_tracker()
    tokenizer = build_tokenizer(TokenizerConfig.from_args(args))
    vocab = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by, 1)
    data = DataConfig.from_args(args)
    train_ds, _, _ = build_datasets(data, tokenizer)
    model_config = ModelConfig.from_args(args, vocab)
    model_a = build_model(model_config, groups.pg_collection(), 0, 0)
    model_b = build_model(model_config, groups.pg_collection(), 0, 0)
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        if not torch.equal(a, b):  # the comparison is meaningless otherwise
            raise RuntimeError(f"the two model copies differ at {name}")
    optimizer = build_optimizer(model_a, OptimizerSetup.from_args(args), groups)
    trainer = Trainer(
        config=TrainingConfig.from_args(args),
        step_config=StepConfig.from_args(args, recovering=False), model_config=model_config,
        groups=groups, model=model_a, optimizer=optimizer,
        scheduler=build_scheduler(optimizer, ScheduleConfig.from_args(args)),
        grads=build_grad_buffer(groups, optimizer, args.overlap_grad_reduce, model_a),
        train_stages=build_stages(data, args.micro_batch_size, groups, model_a, train_ds, tracker),
        valid_stages=None, schedule=schedule_for(model_config, args.micro_batch_size, groups, "cpu",
                              vp_group=0, overlap_warmup_flush=False),
        faults=FaultInjector([], 0), metrics=MetricsWriter(None))
    plain = PlainArm(model_b, MicrobatchSampler(train_ds, args.micro_batch_size), args, vocab)
    return args, vocab, RecoverArm(trainer), plain


def timed(run: Callable[[list[int]], float], ids: list[int]) -> tuple[float, float]:
    start = time.perf_counter()
    loss = run(ids)
    return (time.perf_counter() - start) * 1000.0, loss


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def bootstrap_band(a: list[float], b: list[float]) -> tuple[float, float]:
    """95% band of median(a)/median(b), resampling each arm's iterations (fixed seed)."""
    import numpy as np
    rng = np.random.default_rng(0)
    xa, xb = np.asarray(a), np.asarray(b)
    ratios = [np.median(rng.choice(xa, xa.size)) / np.median(rng.choice(xb, xb.size))
              for _ in range(BOOTSTRAP_RESAMPLES)]
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(low), float(high)


def main(argv: list[str] | None = None) -> int:
    bench = parse_args(argv)
    import torch
    torch.set_num_threads(1)
    args, vocab, recover, plain = build_arms(bench)
    m = args.global_batch_size // args.micro_batch_size
    times: dict[str, list[float]] = {"recover": [], "plain": []}
    for k in range(bench.warmup + bench.iters):
        ids = recover.next_ids()  # both arms get the same M microbatch ids
        ms_a, loss_a = timed(recover.run, ids)
        ms_b, loss_b = timed(plain.run, ids)
        if k == 0:
            note = "" if bench.dropout == 0 else " (dropout on: masks differ, not comparable)"
            print(f"first-iteration loss: recover {loss_a:.6f} plain {loss_b:.6f}{note}")
        if k >= bench.warmup:
            times["recover"].append(ms_a)
            times["plain"].append(ms_b)

    print(f"tiny GPT: {args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} heads, "
          f"seq {args.seq_length}, vocab {vocab}, micro {args.micro_batch_size}, global "
          f"{args.global_batch_size} (M={m}), dropout {bench.dropout}; world size 1, 1 thread")
    print(f"{bench.iters} timed iterations per arm, interleaved after {bench.warmup} warm-up")
    print(f"{'arm':<10}{'median ms':>12}{'p90 ms':>10}{'min ms':>10}{'max ms':>10}")
    for arm, values in times.items():
        print(f"{arm:<10}{statistics.median(values):>12.1f}{p90(values):>10.1f}"
              f"{min(values):>10.1f}{max(values):>10.1f}")
    phases = recover.phase_seconds[bench.warmup:]
    print("recover phases (median ms): " + ", ".join(
        f"{name} {statistics.median(p[name] for p in phases) * 1000:.1f}" for name in phases[0]))
    pairs = [a / b for a, b in zip(times["recover"], times["plain"])]  # neighbours share the load
    print(f"median of per-iteration ratios {statistics.median(pairs):.2f}; "
          f"ratio of minima {min(times['recover']) / min(times['plain']):.2f}")
    ratio = statistics.median(times["recover"]) / statistics.median(times["plain"])
    low, high = bootstrap_band(times["recover"], times["plain"])
    print(f"ratio recover/plain: {ratio:.2f}  (ratio of medians; bootstrap 95% band [{low:.2f}, {high:.2f}])")
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
