"""One GPU, GPT-2 345M (the published config) in bf16: ReCoVer's iteration against megatron-core's
own `get_forward_backward_func()` + `DistributedDataParallel` + `get_megatron_optimizer`, on the
same model code and the same batches, arms interleaved iteration by iteration in one process.

    python scripts/bench/gpu_throughput.py --out runs/gpu     # needs CUDA (scripts/gpu/check.sh)

Prints tokens/s, model TFLOP/s (Megatron's formula, no recompute), MFU against the GPU's dense
bf16 peak, peak memory per arm, and the ReCoVer / megatron-core ratios; writes a JSON and a PNG.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from functools import partial
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `scripts.*`

import torch
import torch.distributed as dist

MODEL = ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 "
         "--max-position-embeddings 1024 --lr 0.00015 --min-lr 1.0e-5 --lr-decay-style cosine "
         "--lr-warmup-fraction .01 --weight-decay 1e-2 --clip-grad 1.0 --bf16 "
         "--hidden-dropout 0.1 --attention-dropout 0.1 "
         "--mock-data --tokenizer-type NullTokenizer --vocab-size 50257").split()
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0}


def model_flops(args, tokens: int, vocab: int) -> float:
    """Megatron's count for a GPT iteration without recompute: 72 B s L h^2 (1 + s/6h + V/12Lh),
    here with B*s = tokens."""
    h, layers, s = args.hidden_size, args.num_layers, args.seq_length
    return 72.0 * tokens * layers * h * h * (1 + s / (6 * h) + vocab / (12 * layers * h))


def build(args_list):
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
    from recover_patches.topology import Topology

    args = parse_and_validate(args_list, world_size=1, device="cuda")
    groups = build_groups(Topology(1, 1, 1), 0, torch_group_factory)
    tracker = install_rng_tracker("cuda", args.seed)
    tokenizer = build_tokenizer(TokenizerConfig.from_args(args))
    vocab = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by, 1)
    data = DataConfig.from_args(args)
    train_ds, _, _ = build_datasets(data, tokenizer)
    model_config = ModelConfig.from_args(args, vocab)
    model = build_model(model_config, groups.pg_collection(), 0, 0, "cuda")
    optimizer = build_optimizer(model, OptimizerSetup.from_args(args), groups)
    trainer = Trainer(
        config=TrainingConfig.from_args(args),
        step_config=StepConfig.from_args(args, recovering=False), model_config=model_config,
        groups=groups, model=model, optimizer=optimizer,
        scheduler=build_scheduler(optimizer, ScheduleConfig.from_args(args)),
        grads=build_grad_buffer(groups, optimizer, args.overlap_grad_reduce, model),
        train_stages=build_stages(data, args.micro_batch_size, groups, model, train_ds, tracker),
        valid_stages=None, schedule=schedule_for(model_config, args.micro_batch_size, groups, "cuda",
                              vp_group=0, overlap_warmup_flush=False),
        faults=FaultInjector([], 0), metrics=MetricsWriter(None))
    return args, groups, vocab, train_ds, trainer


def megatron_arm(args, groups, vocab, train_ds):
    """megatron-core's own training step around the same model class."""
    from megatron.core import parallel_state
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module
    from megatron.training.config import ModelConfig
    from megatron.training.model import build_model
    from recover_patches.pipeline.sampler import MicrobatchSampler

    # build() installed ReCoVer's device-aware buffer; megatron-core insists on making its own.
    parallel_state._GLOBAL_MEMORY_BUFFER = None
    parallel_state.initialize_model_parallel(1, 1)
    model = build_model(ModelConfig.from_args(args, vocab), groups.pg_collection(), 0, 0, "cuda")
    model = Float16Module(model.config, model)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=False), model)
    ddp.config.finalize_model_grads_func = finalize_model_grads
    ddp.config.no_sync_func = ddp.no_sync
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        bf16=True, clip_grad=args.clip_grad), [ddp])
    sampler = MicrobatchSampler(train_ds, args.micro_batch_size)
    forward_backward = get_forward_backward_func()

    def loss_func(mask, per_token):
        loss = (per_token.float() * mask).sum() / mask.sum()
        return loss, {"lm loss": loss.detach()}

    def forward_step(data_iterator, module):
        batch = {k: v.cuda(non_blocking=True) for k, v in next(data_iterator).items()}
        per_token = module(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return per_token, partial(loss_func, batch["loss_mask"].float())

    def step(ids: list[int]) -> None:
        ddp.zero_grad_buffer()
        opt.zero_grad()
        forward_backward(forward_step_func=forward_step, data_iterator=iter(map(sampler, ids)),
                         model=[ddp], num_microbatches=len(ids), seq_length=args.seq_length,
                         micro_batch_size=args.micro_batch_size, forward_only=False)
        opt.step()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="runs/gpu")
    parser.add_argument("--profile", action="store_true",
                        help="after timing, print each arm's top kernels and host ops for one iteration")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_throughput.py needs a CUDA GPU")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    flags = [*MODEL, "--micro-batch-size", str(opts.micro_batch_size), "--global-batch-size",
             str(opts.global_batch_size), "--train-iters", str(10 * (opts.iters + opts.warmup))]
    args, groups, vocab, train_ds, trainer = build(flags)
    mcore_step = megatron_arm(args, groups, vocab, train_ds)
    transaction = trainer.transaction()
    m = opts.global_batch_size // opts.micro_batch_size
    tokens = opts.global_batch_size * args.seq_length
    times: dict[str, list[float]] = {"recover": [], "megatron-core": []}
    peak: dict[str, int] = {}
    arms = {"recover": lambda ids, i: transaction.run(i, ids),
            "megatron-core": lambda ids, i: mcore_step(ids)}
    for i in range(opts.warmup + opts.iters):
        ids = list(range(i * m, (i + 1) * m))
        for name, run in (arms.items() if i % 2 == 0 else reversed(arms.items())):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            run(ids, i + 1)
            torch.cuda.synchronize()
            if i >= opts.warmup:
                times[name].append(time.perf_counter() - start)
                peak[name] = max(peak.get(name, 0), torch.cuda.max_memory_allocated())
    if opts.profile:
        profile(arms, m, opts.warmup + opts.iters)
    device = torch.cuda.get_device_name()
    peak_tflops = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device), None)
    flops = model_flops(args, tokens, vocab)
    result = {"device": device, "micro_batch_size": opts.micro_batch_size,
              "global_batch_size": opts.global_batch_size, "iters": opts.iters, "arms": {}}
    for name, samples in times.items():
        sec = statistics.median(samples)
        tflops = flops / sec / 1e12
        result["arms"][name] = {"median_s": sec, "tokens_per_s": tokens / sec, "tflops": tflops,
                                "mfu": None if peak_tflops is None else tflops / peak_tflops,
                                "peak_memory_gib": peak[name] / 2**30}
        print(f"{name:14s} {sec * 1000:8.1f} ms/iter  {tokens / sec:10.0f} tokens/s  "
              f"{tflops:7.1f} TFLOP/s  MFU {result['arms'][name]['mfu']}  "
              f"peak {peak[name] / 2**30:.2f} GiB")
    ours, theirs = result["arms"]["recover"], result["arms"]["megatron-core"]
    result["throughput_ratio"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
    result["memory_ratio"] = ours["peak_memory_gib"] / theirs["peak_memory_gib"]
    print(f"recover / megatron-core: throughput {result['throughput_ratio']:.3f}, "
          f"peak memory {result['memory_ratio']:.3f}")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_throughput.json").write_text(json.dumps({**result, "samples_s": times}, indent=1))
    plot(times, out / "gpu_throughput.png", device)


def profile(arms, m: int, first: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    for offset, (name, run) in enumerate(arms.items()):
        i = first + offset
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run(list(range(i * m, (i + 1) * m)), i + 1)
            torch.cuda.synchronize()
        print(f"--- {name}: one iteration")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=8, max_name_column_width=60))


def plot(times: dict[str, list[float]], path: Path, device: str) -> None:
    from scripts.plot import pyplot
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, samples in times.items():
        ax.plot([s * 1000 for s in samples], marker="o", label=name)
    ax.set(xlabel="iteration (after warm-up)", ylabel="ms per iteration",
           title=f"GPT-2 345M bf16 on one {device}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
