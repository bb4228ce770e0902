"""The Megatron-LM-compatible command line: published configs, defaults, derived values, user errors."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from megatron.training.arguments import (
    ArgumentError, global_batch_size_at, parse_and_validate, parse_args, validate_args)
from megatron.training.config import RunLayout, params_dtype_of
from megatron.training.config.rules import model_chunks_of

CONFIG_DIR = Path(__file__).resolve().parent.parent / "scripts" / "configs"
ARRAY_NAMES = ("MODEL_ARGS", "PARALLEL_ARGS", "BATCH_ARGS", "OPT_ARGS", "DATA_ARGS", "CKPT_ARGS",
               "LOG_ARGS", "PRECISION_ARGS")
REMOVED = {"--data-impl": 1, "--activations-checkpoint-method": 1, "--checkpoint-activations": 0}

# The published flag sets, verbatim (MEGATRON_FACTS.md), with placeholders for paths.
_345M_COMMON = ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 "
                "--max-position-embeddings 1024 --lr 0.00015 --lr-decay-iters 320000 "
                "--lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --lr-warmup-fraction .01 "
                "--clip-grad 1.0 --data-path $DATA_PATH --vocab-file $VOCAB_FILE --merge-file $MERGE_FILE "
                "--data-impl mmap --split 949,50,1 --save $CKPT_DIR --load $CKPT_DIR --save-interval 10000 "
                "--log-interval 100 --eval-interval 1000 --eval-iters 10 --fp16")
_GPT3_COMMON = ("--seq-length 2048 --max-position-embeddings 2048 --attention-backend auto "
                "--train-iters 500000 --lr 6.0e-5 --min-lr 6.0e-6 --lr-decay-style cosine "
                "--lr-warmup-fraction .001 --lr-decay-iters 430000 --weight-decay 0.1 --adam-beta1 0.9 "
                "--adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --data-path $DATA_PATH "
                "--vocab-file $VOCAB_FILE --merge-file $MERGE_FILE --split 949,50,1 --save $CKPT_DIR "
                "--load $CKPT_DIR --save-interval 10000 --log-interval 100 --eval-interval 1000 "
                "--eval-iters 10 --tensorboard-dir $TENSORBOARD_DIR --fp16")
PUBLISHED = {  # name: (verbatim flags, world size of the published launch)
    "gpt2_345m": (_345M_COMMON + " --micro-batch-size 4 --global-batch-size 8 --train-iters 500000", 1),
    "gpt2_345m_with_mp": (_345M_COMMON + " --micro-batch-size 4 --global-batch-size 16 --train-iters "
                          "500000 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
                          "--sequence-parallel --activations-checkpoint-method uniform", 8),
    "gpt3_857m": ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 "
                  "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 1 --micro-batch-size 8 "
                  "--global-batch-size 128 " + _GPT3_COMMON, 8),
    "gpt3_175b": ("--num-layers 96 --hidden-size 12288 --num-attention-heads 96 "
                  "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --micro-batch-size 1 "
                  "--global-batch-size 1536 --rampup-batch-size 16 16 5859375 " + _GPT3_COMMON, 128),
}
# Megatron-LM's defaults (MEGATRON_FACTS.md), except --ckpt-format: ReCoVer writes torch files.
MEGATRON_DEFAULTS = {
    "global_batch_size": None, "split": None, "mock_data": False, "tokenizer_type": "GPT2BPETokenizer",
    "save_interval": None, "log_interval": 100, "eval_interval": 1000, "eval_iters": 100, "seed": 1234,
    "lr_decay_style": "linear", "min_lr": 0.0, "weight_decay": 0.01, "adam_beta1": 0.9,
    "adam_beta2": 0.999, "adam_eps": 1e-8, "clip_grad": 1.0, "init_method_std": 0.02,
    "hidden_dropout": 0.1, "attention_dropout": 0.1, "make_vocab_size_divisible_by": 128,
    "distributed_backend": "nccl", "distributed_timeout_minutes": 10, "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1, "context_parallel_size": 1, "position_embedding_type":
    "learned_absolute", "attention_backend": "auto", "transformer_impl": None, "optimizer": "adam",
    "lr_warmup_iters": 0, "lr_warmup_samples": 0, "lr_warmup_init": 0.0, "lr_warmup_fraction": None,
    "weight_decay_incr_style": "constant", "num_workers": 2, "normalization": "LayerNorm",
    "add_bias_linear": True, "swiglu": False, "sequence_parallel": False, "fp16": False, "bf16": False,
    "initial_loss_scale": 2.0**32, "ckpt_format": "torch_dist", "recover": True,
    "recover_policy": "redistribute", "recover_timeout": 10.0, "recover_min_replicas": 1,
    "inject_fault": [], "recover_balance": "throughput", "coordinator_addr": None, "job_token": None,
}
TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 --train-iters 10 "
        "--lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 128").split()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "RECOVER_COORDINATOR", "RECOVER_JOB_TOKEN"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def paths(tmp_path) -> dict[str, str]:
    for name in ("vocab.json", "merges.txt"):
        (tmp_path / name).write_text("x")
    return {"DATA_PATH": str(tmp_path / "corpus_text_document"), "VOCAB_FILE": str(tmp_path / "vocab.json"),
            "MERGE_FILE": str(tmp_path / "merges.txt"), "CKPT_DIR": str(tmp_path / "ckpt"),
            "TENSORBOARD_DIR": str(tmp_path / "tb")}


def _fill(tokens: list[str], paths: dict[str, str]) -> list[str]:
    return [re.sub(r"\$\{?(\w+)\}?", lambda m: paths[m.group(1)], t) for t in tokens]


def read_config_arrays(name: str) -> dict[str, list[str]]:
    """A small extractor for the `NAME=( ... )` bash arrays of scripts/configs/*.sh."""
    text = (CONFIG_DIR / f"{name}.sh").read_text()
    arrays = {m.group(1): shlex.split(m.group(2), comments=True)
              for m in re.finditer(r"^(\w+)=\((.*?)\)[ \t]*$", text, re.M | re.S)}
    assert set(arrays) == set(ARRAY_NAMES), f"{name}.sh defines {sorted(arrays)}"
    return arrays


def config_argv(name: str, paths: dict[str, str], skip: tuple[str, ...] = ()) -> list[str]:
    arrays = read_config_arrays(name)
    return _fill([t for n in ARRAY_NAMES if n not in skip for t in arrays[n]], paths)


def drop_flags(argv: list[str], flags: dict[str, int]) -> list[str]:
    out, i = [], 0
    while i < len(argv):
        if argv[i] in flags:
            i += 1 + flags[argv[i]]
        else:
            out.append(argv[i])
            i += 1
    return out


def fake_find_spec(monkeypatch, installed: set[str]) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name in installed else
                        (None if name in ("tensorboard", "transformer_engine", "wandb")
                         else real(name, *a)))


# --- published configs -------------------------------------------------------------------------

@pytest.mark.parametrize("name", [*PUBLISHED, "tiny_cpu"])
def test_config_file_parses(name, paths):
    args = parse_args(config_argv(name, paths))
    assert args.micro_batch_size >= 1 and args.num_layers >= 1


@pytest.mark.parametrize("name", PUBLISHED)
def test_config_file_equals_published_set_minus_removed_flags(name, paths):
    published = drop_flags(_fill(PUBLISHED[name][0].split(), paths), REMOVED)
    assert vars(parse_args(config_argv(name, paths))) == vars(parse_args(published))


@pytest.mark.parametrize("name", ["gpt2_345m", "gpt2_345m_with_mp"])
def test_verbatim_published_set_with_removed_flag_names_the_replacement(name, paths):
    with pytest.raises(ArgumentError) as err:
        parse_args(_fill(PUBLISHED[name][0].split(), paths))
    assert err.value.flag in REMOVED and "removed" in err.value.message


@pytest.mark.parametrize("flag, value, replacement", [
    ("--data-impl", ["mmap"], "always mmap"),
    ("--checkpoint-activations", [], "--recompute-activations"),
    ("--activations-checkpoint-method", ["uniform"], "--recompute-method"),
])
def test_removed_flag_says_what_replaced_it(flag, value, replacement):
    with pytest.raises(ArgumentError) as err:
        parse_args(TINY + [flag, *value])
    assert err.value.flag == flag and replacement in str(err.value)


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_config_validates_on_its_gpu_world(name, paths, monkeypatch):
    fake_find_spec(monkeypatch, {"tensorboard"})
    world = PUBLISHED[name][1]
    args = validate_args(parse_args(config_argv(name, paths)), world, device="cuda")
    dp = world // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
    assert RunLayout.from_args(args, world, "cuda").data_parallel_size == dp
    assert args.global_batch_size % args.micro_batch_size == 0
    assert (args.transformer_impl, args.distributed_backend, str(params_dtype_of(args))) == (
        "local", "nccl", "torch.float16")


@pytest.mark.parametrize("installed, fused", [(set(), False), ({"transformer_engine"}, True)])
def test_rope_fusion_on_gpu_needs_transformer_engine(monkeypatch, installed, fused):
    # megatron-core raises at model build for the fused rope kernel without TE (seen on an H100)
    fake_find_spec(monkeypatch, installed)
    args = validate_args(parse_args(TINY + ["--position-embedding-type", "rope"]), 1, device="cuda")
    assert args.rope_fusion is fused
    args = validate_args(parse_args(TINY + ["--no-rope-fusion"]), 1, device="cuda")
    assert args.rope_fusion is False


@pytest.mark.parametrize("name", [*PUBLISHED, "tiny_cpu"])
def test_config_with_cpu_sizes_validates_on_cpu(name, paths):
    arrays = read_config_arrays(name)
    tp = pp = 1
    for flag, value in zip(arrays["PARALLEL_ARGS"], arrays["PARALLEL_ARGS"][1:]):
        tp = int(value) if flag == "--tensor-model-parallel-size" else tp
        pp = int(value) if flag == "--pipeline-model-parallel-size" else pp
    argv = drop_flags(config_argv(name, paths, skip=("PRECISION_ARGS",)),
                      {"--sequence-parallel": 0, "--tensorboard-dir": 1})
    argv += ["--num-layers", str(2 * pp), "--hidden-size", str(8 * tp), "--num-attention-heads", str(tp),
             "--seq-length", "32", "--max-position-embeddings", "32"]
    args = validate_args(parse_args(argv), world_size=2 * tp * pp, device="cpu")
    layout = RunLayout.from_args(args, 2 * tp * pp, "cpu")
    assert (layout.data_parallel_size, args.distributed_backend, args.transformer_impl) == (
        2, "gloo", "local")
    assert args.global_batch_size % args.micro_batch_size == 0


# --- defaults and derived values ---------------------------------------------------------------

def test_defaults_match_megatron():
    args = parse_args(["--micro-batch-size", "1"])
    assert {k: getattr(args, k) for k in MEGATRON_DEFAULTS} == MEGATRON_DEFAULTS


def test_derived_values():
    args = validate_args(parse_args([a for a in TINY if a not in ("--global-batch-size", "8")]), 4)
    layout = RunLayout.from_args(args, 4, "cpu", environ={})
    assert (layout.data_parallel_size, args.global_batch_size) == (4, 8)  # micro 2 * DP 4
    assert (args.ffn_hidden_size, args.kv_channels, args.lr_decay_iters) == (256, 16, 10)
    assert args.start_weight_decay == args.end_weight_decay == args.weight_decay
    assert args.use_cpu_initialization is True and layout.local_rank == 0


def test_microbatches_per_iteration_is_not_divided_by_data_parallel_size():
    args = validate_args(parse_args(TINY + ["--global-batch-size", "6"]), world_size=4)
    megatron = RunLayout.from_args(args, 4, "cpu", environ={}).megatron_fields(args)
    assert (megatron["data_parallel_size"], megatron["num_microbatches_per_iteration"]) == (4, 3)


def test_swiglu_ffn_default_follows_megatron_rounding():
    args = validate_args(parse_args(TINY + ["--hidden-size", "96", "--swiglu"]), 1)
    assert args.ffn_hidden_size == 256  # int(4*96*2/3 / 64) * 64


def test_train_samples_sets_train_iters_and_sample_based_lr_schedule():
    argv = [a for a in TINY if a not in ("--train-iters", "10")] + [
        "--train-samples", "100", "--lr-warmup-samples", "16", "--lr-decay-samples", "80"]
    args = validate_args(parse_args(argv), 1)
    assert (args.train_iters, args.lr_decay_iters, args.lr_decay_samples) == (12, None, 80)


def test_rampup_schedule_and_sample_based_iteration_count():
    argv = [a for a in TINY if a not in ("--train-iters", "10")] + [
        "--train-samples", "40", "--rampup-batch-size", "4", "2", "16"]
    args = validate_args(parse_args(argv), 1)
    # ramp 4 -> 6 -> 8 in two steps of 8 samples each: batches 4, 4, 6, 6 at consumed 0, 4, 8, 14;
    # past the 16 ramp samples (consumed 20) full batches of 8 while they fit in 40: 2 more
    assert [global_batch_size_at(args, c) for c in (0, 4, 8, 14, 16, 20)] == [4, 4, 6, 6, 8, 8]
    assert args.train_iters == 6


def test_rampup_is_allowed_with_train_iters():
    args = validate_args(parse_args(TINY + ["--rampup-batch-size", "2", "2", "100"]), 1)
    assert global_batch_size_at(args, 0) == 2 and global_batch_size_at(args, 1000) == 8


def test_split_default_warns_once_with_data_path(paths, caplog):
    argv = drop_flags(TINY, {"--mock-data": 0, "--tokenizer-type": 1, "--vocab-size": 1}) + [
        "--data-path", paths["DATA_PATH"], "--vocab-file", paths["VOCAB_FILE"],
        "--merge-file", paths["MERGE_FILE"]]
    assert validate_args(parse_args(argv), 1).split == "969, 30, 1"
    def split_warnings() -> int:
        return sum(r.levelname == "WARNING" and r.getMessage().startswith("--split not given")
                   for r in caplog.records)
    assert split_warnings() == 1
    validate_args(parse_args(argv + ["--split", "98,2,0"]), 1)
    assert validate_args(parse_args(TINY), 1).split == "1,1,1"  # megatron-core's mock split
    assert split_warnings() == 1


def test_backend_and_impl_resolution_by_device(monkeypatch):
    assert validate_args(parse_args(TINY), 1, "cpu").distributed_backend == "gloo"
    assert validate_args(parse_args(TINY), 1, "cuda").distributed_backend == "nccl"
    fake_find_spec(monkeypatch, {"transformer_engine"})
    assert validate_args(parse_args(TINY), 1, "cuda").transformer_impl == "transformer_engine"
    assert validate_args(parse_args(TINY), 1, "cpu").transformer_impl == "local"


def test_recover_flags_and_env_defaults(monkeypatch):
    monkeypatch.setenv("RECOVER_COORDINATOR", "node0:29400")
    monkeypatch.setenv("RECOVER_JOB_TOKEN", "s3cret")
    monkeypatch.setenv("LOCAL_RANK", "3")
    args = validate_args(parse_args(TINY + ["--recover", "off", "--local-rank", "1", "--inject-fault",
                                            "kill:rank=1", "--inject-fault", "hang:rank=2"]), 4)
    local_rank = RunLayout.from_args(args, 4, "cpu").local_rank  # the launcher's env wins
    assert (args.coordinator_addr, args.job_token, local_rank) == ("node0:29400", "s3cret", 3)
    assert args.recover is False and args.inject_fault == ["kill:rank=1", "hang:rank=2"]
    assert parse_args(TINY + ["--coordinator-addr", "h:1"]).coordinator_addr == "h:1"


# --- user errors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("flag", [  # MoE's refusals: tests/test_moe.py
    "--fp8-format hybrid",
    "--optimizer sgd"])
def test_unsupported_megatron_flag(flag):
    with pytest.raises(ArgumentError) as err:
        parse_args(TINY + flag.split())
    assert err.value.flag == flag.split()[0] and "not supported by ReCoVer yet" in err.value.message


def test_unknown_flag_is_an_argument_error():
    with pytest.raises(ArgumentError) as err:
        parse_args(TINY + ["--no-such-flag"])
    assert err.value.flag == "--no-such-flag"


def _replace(argv: list[str], flag: str, value: str | None) -> list[str]:
    out = drop_flags(argv, {flag: 0 if flag in ("--mock-data",) else 1})
    return out if value is None else out + [flag, *value.split()]


ERRORS = [  # (extra argv / replacements, world size, device, flag named, text in message)
    ({"--tensor-model-parallel-size": "2"}, 3, "cpu", "--tensor-model-parallel-size",
     "--pipeline-model-parallel-size"),
    ({"--tensor-model-parallel-size": "8"}, 8, "cpu", "--num-attention-heads", "not divisible"),
    ({"--pipeline-model-parallel-size": "4"}, 4, "cpu", "--num-layers", "not divisible"),
    ({"--global-batch-size": "7"}, 1, "cpu", "--global-batch-size", "--micro-batch-size"),
    ({"--hidden-size": "66"}, 1, "cpu", "--hidden-size", "--kv-channels"),
    ({"--ffn-hidden-size": "129", "--tensor-model-parallel-size": "2"}, 2, "cpu", "--ffn-hidden-size",
     "divisible"),
    ({"--kv-channels": "0"}, 1, "cpu", "--kv-channels", ">= 1"),
    ({"--hidden-size": "20", "--swiglu": ""}, 1, "cpu", "--ffn-hidden-size", "--swiglu"),
    ({"--position-embedding-type": "rope", "--kv-channels": "15"}, 1, "cpu", "--kv-channels", "even"),
    ({"--seq-length": "64"}, 1, "cpu", "--max-position-embeddings", "--seq-length"),
    ({"--num-attention-heads": None}, 1, "cpu", "--num-attention-heads", "required"),
    ({"--train-iters": None}, 1, "cpu", "--train-iters", "--train-samples"),
    ({"--train-samples": "80"}, 1, "cpu", "--train-samples", "exclusive"),
    ({"--lr-decay-samples": "100"}, 1, "cpu", "--lr-decay-samples", "--train-iters"),
    ({"--lr-warmup-fraction": ".1", "--lr-warmup-iters": "2"}, 1, "cpu", "--lr-warmup-fraction",
     "--lr-warmup-iters"),
    ({"--lr": None}, 1, "cpu", "--lr", "required"),
    ({"--start-weight-decay": "0.1"}, 1, "cpu", "--start-weight-decay", "--weight-decay-incr-style"),
    ({"--rampup-batch-size": "4 3 100"}, 1, "cpu", "--rampup-batch-size", "--micro-batch-size"),
    ({"--rampup-batch-size": "2 4 100"}, 1, "cpu", "--rampup-batch-size", "--global-batch-size"),
    ({"--save": "/tmp/ckpt"}, 1, "cpu", "--save-interval", "--save"),
    ({"--save": "/tmp/ckpt", "--save-interval": "0"}, 1, "cpu", "--save-interval", "positive"),
    ({"--data-path": "/data/corpus"}, 1, "cpu", "--mock-data", "--data-path"),
    ({"--mock-data": None}, 1, "cpu", "--data-path", "--mock-data"),
    ({"--mock-data": None, "--data-path": "0.3 a b c"}, 1, "cpu", "--data-path", "weighted"),
    ({"--train-data-path": "a"}, 1, "cpu", "--mock-data", "--train-data-path"),
    ({"--mock-data": None, "--valid-data-path": "v"}, 1, "cpu", "--train-data-path",
     "no training split"),
    ({"--mock-data": None, "--data-args-path": "/nonexistent/list"}, 1, "cpu",
     "--data-args-path", "cannot read"),
    ({"--mock-data": None, "--per-split-data-args-path": "/nonexistent/splits.json"}, 1, "cpu",
     "--per-split-data-args-path", "as JSON"),
    ({"--tokenizer-type": "GPT2BPETokenizer"}, 1, "cpu", "--vocab-file", "GPT2BPETokenizer"),
    ({"--tokenizer-type": "GPT2BPETokenizer", "--vocab-file": "/nonexistent/vocab.json",
      "--merge-file": "/nonexistent/merges.txt"}, 1, "cpu", "--vocab-file", "/nonexistent/vocab.json"),
    ({"--vocab-size": None}, 1, "cpu", "--vocab-size", "NullTokenizer"),
    ({"--fp16": "", "--bf16": ""}, 1, "cpu", "--bf16", "exclusive"),
    ({"--fp16": "", "--min-loss-scale": "0"}, 1, "cpu", "--min-loss-scale", "> 0"),
    ({"--fp16": "", "--loss-scale": "-1"}, 1, "cpu", "--loss-scale", "> 0"),
    ({"--fp16": "", "--initial-loss-scale": "0.5"}, 1, "cpu", "--initial-loss-scale",
     "--min-loss-scale"),
    ({"--fp16": "", "--hysteresis": "0"}, 1, "cpu", "--loss-scale-window", "--hysteresis"),
    ({"--group-query-attention": "", "--num-query-groups": "3"}, 1, "cpu", "--num-query-groups",
     "divide"),
    ({"--group-query-attention": "", "--num-query-groups": "2",
      "--tensor-model-parallel-size": "4"}, 4, "cpu", "--num-query-groups", "TP"),
    ({"--rotary-percent": "0"}, 1, "cpu", "--rotary-percent", "(0, 1]"),
    ({"--recompute-granularity": "full"}, 1, "cpu", "--recompute-method", "full"),
    ({"--recompute-method": "uniform"}, 1, "cpu", "--recompute-method", "full only"),
    ({"--recompute-granularity": "full", "--recompute-method": "block",
      "--recompute-num-layers": "3"}, 1, "cpu", "--recompute-num-layers", "1..2"),
    ({"--recompute-granularity": "selective", "--recompute-modules": "mla_up_proj"}, 1, "cpu",
     "--recompute-modules", "multi-latent attention"),
    ({"--save": "/tmp/x", "--save-interval": "2", "--save-retain-interval": "3"}, 1, "cpu",
     "--save-retain-interval", "positive multiple of --save-interval"),
    ({"--reset-attention-mask": "", "--no-create-attention-mask-in-dataloader": ""}, 1, "cpu",
     "--reset-attention-mask", "--no-create-attention-mask-in-dataloader"),
    ({"--attention-backend": "flash"}, 1, "cpu", "--attention-backend", "GPU"),
    ({"--transformer-impl": "transformer_engine"}, 1, "cpu", "--transformer-impl", "GPU"),
    ({"--transformer-impl": "transformer_engine"}, 1, "cuda", "--transformer-impl", "not installed"),
    ({"--tensorboard-dir": "/tmp/tb"}, 1, "cpu", "--tensorboard-dir", "tensorboard"),
    ({"--profile": "", "--profile-step-start": "5", "--profile-step-end": "5"}, 1, "cpu",
     "--profile-step-end", "after"),
    ({"--use-rotary-position-embeddings": "", "--kv-channels": "15"}, 1, "cpu",
     "--kv-channels", "even"),
    ({"--rope-type": "yarn"}, 1, "cpu", "--rope-type", "multi-latent"),
    ({"--squared-relu": "", "--swiglu": ""}, 1, "cpu", "--squared-relu", "--swiglu"),
    ({"--error-injection-rate": "3", "--rerun-mode": "disabled"}, 1, "cpu",
     "--error-injection-rate", "validate_results"),
    ({"--wandb-project": "p"}, 1, "cpu", "--wandb-project", "recover[wandb]"),
    ({"--exit-interval": "0"}, 1, "cpu", "--exit-interval", "> 0"),
    ({"--log-timers-to-tensorboard": ""}, 1, "cpu", "--log-timers-to-tensorboard",
     "--tensorboard-dir"),
    ({"--log-memory-to-tensorboard": ""}, 1, "cpu", "--log-memory-to-tensorboard",
     "--tensorboard-dir"),
    ({"--tensorboard-dir": "/tmp/tb", "--tensorboard-log-interval": "0"}, 1, "cpu",
     "--tensorboard-log-interval", ">= 1"),
    ({"--recover-min-replicas": "3"}, 2, "cpu", "--recover-min-replicas", "2"),
    ({"--coordinator-addr": "nohostport"}, 1, "cpu", "--coordinator-addr", "HOST:PORT"),
    ({"--lr-warmup-iters": "100000000"}, 1, "cpu", "--lr-warmup-iters", "decay length"),
]


@pytest.mark.parametrize("changes, world, device, flag, text", ERRORS,
                         ids=[f"{e[3]}-{i}" for i, e in enumerate(ERRORS)])
def test_validation_error_names_the_flag(changes, world, device, flag, text, monkeypatch):
    fake_find_spec(monkeypatch, set())  # neither tensorboard nor transformer_engine installed
    argv = list(TINY)
    for changed, value in changes.items():
        argv = _replace(argv, changed, value if value != "" else None) + ([changed] if value == "" else [])
    with pytest.raises(ArgumentError) as err:
        validate_args(parse_args(argv), world, device)
    assert err.value.flag == flag
    assert flag in str(err.value) and text in str(err.value) and err.value.fix


def test_parse_and_validate_exits_2_with_one_stderr_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_and_validate(TINY + ["--pipeline-model-parallel-size", "4"], world_size=4)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert re.fullmatch(r"pretrain_gpt_recover\.py: error: --num-layers: .+\. Fix: .+\n", err)


@pytest.mark.parametrize("extra, line", [
    (["--hiden-size", "64"], "--hiden-size: unknown flag --hiden-size. Fix: did you mean --hidden-size?"),
    (["--zyzzyva"], "--zyzzyva: unknown flag --zyzzyva. Fix: drop it"),
    (["--lr"], "--lr: expected one argument. Fix: see pretrain_gpt_recover.py --help for --lr"),
])
def test_argparse_errors_are_one_line_naming_the_flag(capsys, extra, line):
    with pytest.raises(SystemExit) as exit_info:
        parse_and_validate(TINY + extra, world_size=1)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"pretrain_gpt_recover.py: error: {line}"), err


def test_parse_and_validate_reports_refused_flags_the_same_way(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_and_validate(TINY + ["--data-impl", "mmap"], world_size=1)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("pretrain_gpt_recover.py: error: --data-impl: ")


@pytest.mark.parametrize("flags, named", [
    (["--async-save", "--ckpt-format", "torch"], "--async-save"),
])
def test_checkpoint_flags_refused_in_one_line(flags, named):
    with pytest.raises(ArgumentError) as err:
        parse_args(TINY + flags)
    assert err.value.flag == named


def test_checkpoint_flags_taken():
    args = parse_args(TINY + ["--async-save", "--use-persistent-ckpt-worker",
                              "--no-ckpt-fully-parallel-save", "--dist-ckpt-strictness", "log_all"])
    assert (args.ckpt_format, args.async_save, args.dist_ckpt_strictness) == \
        ("torch_dist", True, "log_all")
    assert args.ckpt_fully_parallel_save is False  # Megatron's default (True) turned off
    assert parse_args(TINY).ckpt_fully_parallel_save is True


def test_strictness_choices_are_megatron_cores():
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from megatron.training.arguments.flags.checkpoint import STRICTNESS
    assert set(STRICTNESS) == {s.value for s in StrictHandling}


def test_parse_and_validate_returns_validated_args():
    args = parse_and_validate(TINY, world_size=2)
    megatron = RunLayout.from_args(args, 2, "cpu", environ={}).megatron_fields(args)
    assert (megatron["data_parallel_size"], megatron["num_microbatches_per_iteration"]) == (2, 4)
    # the layout is not written into the flags (Megatron-LM's checks do write it into theirs)
    assert not {"world_size", "rank", "data_parallel_size", "device", "params_dtype"} & set(vars(args))


# Flags in nearly all of Megatron-LM's GPT functional-test configs, plus the common and rare ones
# MEGATRON_FACTS.md lists (values where they take one): each must be taken, or refused in one line
# that names it -- never an unknown-flag error, never a usage dump.
FUNCTIONAL_TEST_FLAGS = [
    ["--tensorboard-dir", "/tmp/tb"], ["--timing-log-level", "2"], ["--log-timers-to-tensorboard"],
    ["--log-validation-ppl-to-tensorboard"], ["--log-num-zeros-in-grad"], ["--log-params-norm"],
    ["--log-memory-to-tensorboard"], ["--no-gradient-accumulation-fusion"], ["--bf16"],
    ["--use-mcore-models"], ["--use-persistent-ckpt-worker"], ["--async-save"],
    ["--data-cache-path", "/tmp/cache"], ["--ckpt-format", "torch_dist"],
    ["--transformer-impl", "transformer_engine"], ["--attention-softmax-in-fp32"],
    ["--dist-ckpt-strictness", "log_all"], ["--deterministic-mode"],
    ["--use-checkpoint-opt_param-scheduler"], ["--attention-backend", "unfused"],
    ["--sequence-parallel"], ["--use-distributed-optimizer"], ["--context-parallel-size", "1"],
    ["--overlap-grad-reduce"], ["--overlap-param-gather"], ["--disable-bias-linear"],
    ["--num-layers-per-virtual-pipeline-stage", "1"], ["--manual-gc"], ["--use-tp-pp-dp-mapping"],
    ["--rerun-mode", "disabled"], ["--log-throughput"], ["--no-mmap-bin-files"],
    ["--exit-interval", "5"], ["--exit-duration-in-mins", "30"], ["--wandb-project", "p"],
]


@pytest.mark.parametrize("flags", FUNCTIONAL_TEST_FLAGS, ids=[f[0] for f in FUNCTIONAL_TEST_FLAGS])
def test_megatron_test_config_flags_are_taken_or_refused_in_one_line(flags, capsys, monkeypatch):
    fake_find_spec(monkeypatch, {"tensorboard", "wandb"})
    extra = flags if flags[0] != "--log-timers-to-tensorboard" and "tensorboard" not in flags[0] \
        else [*flags, "--tensorboard-dir", "/tmp/tb"]
    try:
        parse_and_validate(TINY + extra, world_size=1)
    except SystemExit as exit_info:
        assert exit_info.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"error: {flags[0]}" in err, err
        assert "unknown flag" not in err, err  # known to ReCoVer: taken or refused by name


def test_huggingface_tokenizer_flags_reach_the_tokenizer(tmp_path):
    from megatron.training.config.io import TokenizerConfig
    from megatron.training.data.tokenizer import build_tokenizer
    from tests.test_preprocess import write_hf_tokenizer

    model = write_hf_tokenizer(tmp_path / "hf")
    base = [a for a in TINY if a not in ("NullTokenizer", "--vocab-size", "128")]
    args = validate_args(parse_args(base + ["HuggingFaceTokenizer", "--tokenizer-model", str(model)]), 1)
    tokenizer = build_tokenizer(TokenizerConfig.from_args(args))
    assert tokenizer.detokenize([tokenizer.eod]) == "</s>"
    from tokenizers import Tokenizer
    # Megatron's HF vocab_size is len(tokenizer): added tokens counted
    assert tokenizer.vocab_size == Tokenizer.from_file(str(model / "tokenizer.json")).get_vocab_size(True)
    with pytest.raises(ArgumentError) as error:
        validate_args(parse_args(base + ["HuggingFaceTokenizer"]), 1)
    assert error.value.flag == "--tokenizer-model"


@pytest.mark.parametrize("extra, world, flag", [
    (["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "3"], 4,
     "--num-distributed-optimizer-instances"),  # K must divide DP
    (["--num-distributed-optimizer-instances", "2"], 4, "--num-distributed-optimizer-instances"),
    (["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "0"], 4,
     "--num-distributed-optimizer-instances"),
    (["--overlap-param-gather", "--overlap-grad-reduce"], 4, "--overlap-param-gather"),
    (["--overlap-param-gather", "--use-distributed-optimizer"], 4, "--overlap-param-gather"),
])
def test_distributed_optimizer_flags_are_checked(extra, world, flag):
    with pytest.raises(ArgumentError) as error:
        validate_args(parse_args(TINY + extra), world)
    assert error.value.flag == flag


def test_distributed_optimizer_flags_are_taken():
    args = validate_args(parse_args(TINY + ["--use-distributed-optimizer",
                                            "--num-distributed-optimizer-instances", "2"]), 4)
    assert args.use_distributed_optimizer and args.num_distributed_optimizer_instances == 2


def test_a_changed_schedule_on_resume_follows_megatrons_flags():
    """megatron-core's scheduler compares the schedule with the checkpoint's: a changed one is an
    error unless --use-checkpoint-opt_param-scheduler (the checkpoint's wins) or
    --override-opt_param-scheduler (this run's wins); the step count always comes back."""
    import torch

    from megatron.training.config import ScheduleConfig
    from megatron.training.optimizer.setup import build_scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    def scheduler(*extra: str):
        return build_scheduler(optimizer, ScheduleConfig.from_args(
            validate_args(parse_args(TINY + list(extra)), 1)))
    first = scheduler("--train-iters", "6")
    first.step(increment=16)
    saved = first.state_dict()
    with pytest.raises(AssertionError):
        scheduler("--train-iters", "10").load_state_dict(saved)
    taken = scheduler("--train-iters", "10", "--use-checkpoint-opt_param-scheduler")
    taken.load_state_dict(saved)
    kept = scheduler("--train-iters", "10", "--override-opt_param-scheduler")
    kept.load_state_dict(saved)
    assert (taken.lr_decay_steps, kept.lr_decay_steps) == (6 * 8, 10 * 8)
    assert taken.num_steps == kept.num_steps == 16
    with pytest.raises(ArgumentError) as error:
        validate_args(parse_args(TINY + ["--use-checkpoint-opt_param-scheduler",
                                         "--override-opt_param-scheduler"]), 1)
    assert error.value.flag == "--override-opt_param-scheduler"


PP2 = ["--pipeline-model-parallel-size", "2", "--num-layers", "4"]


@pytest.mark.parametrize("extra, world, device, flag, text", [
    (PP2 + ["--num-layers-per-virtual-pipeline-stage", "1",
            "--num-virtual-stages-per-pipeline-rank", "2"], 2, "cpu",
     "--num-layers-per-virtual-pipeline-stage", "both"),
    (["--num-virtual-stages-per-pipeline-rank", "2"], 1, "cpu",
     "--num-layers-per-virtual-pipeline-stage", "2 or more"),
    (PP2 + ["--num-layers-per-virtual-pipeline-stage", "3"], 2, "cpu",
     "--num-layers-per-virtual-pipeline-stage", "does not divide"),
    (PP2 + ["--num-virtual-stages-per-pipeline-rank", "4"], 2, "cpu",
     "--num-virtual-stages-per-pipeline-rank", "do not split"),
    (PP2 + ["--num-layers-per-virtual-pipeline-stage", "1", "--no-overlap-p2p-communication"], 2,
     "cpu", "--no-overlap-p2p-communication", "asynchronously"),
    (PP2 + ["--num-layers-per-virtual-pipeline-stage", "1",
            "--microbatch-group-size-per-virtual-pipeline-stage", "1"], 2, "cpu",
     "--microbatch-group-size-per-virtual-pipeline-stage", "below"),
    (PP2 + ["--microbatch-group-size-per-virtual-pipeline-stage", "2"], 2, "cpu",
     "--microbatch-group-size-per-virtual-pipeline-stage", "there is none"),
    (PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"], 2, "cuda",
     "--num-layers-per-virtual-pipeline-stage", "needs ReCoVer's launcher"),
    (PP2 + ["--overlap-p2p-communication-warmup-flush"], 2, "cpu",
     "--overlap-p2p-communication-warmup-flush", "model chunks"),
    (PP2 + ["--num-layers-per-virtual-pipeline-stage", "1",
            "--decoder-first-pipeline-num-layers", "2"], 2, "cpu",
     "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank"),
    (["--decoder-first-pipeline-num-layers", "2"], 1, "cpu",
     "--decoder-first-pipeline-num-layers", "one"),
    (PP2 + ["--decoder-last-pipeline-num-layers", "5"], 2, "cpu",
     "--decoder-last-pipeline-num-layers", "middle"),
    (PP2 + ["--decoder-first-pipeline-num-layers", "1", "--num-virtual-stages-per-pipeline-rank",
            "2"], 2, "cpu", "--decoder-first-pipeline-num-layers", "2 model chunks"),
    (PP2 + ["--decoder-first-pipeline-num-layers", "1",
            "--account-for-loss-in-pipeline-split"], 2, "cpu",
     "--decoder-first-pipeline-num-layers", "account-for"),
    (PP2 + ["--account-for-embedding-in-pipeline-split"], 2, "cpu", "--num-layers",
     "embedding/loss counted"),
])
def test_pipeline_split_flags_are_checked_in_one_line(extra, world, device, flag, text,
                                                      monkeypatch):
    fake_find_spec(monkeypatch, set())
    with pytest.raises(ArgumentError) as error:
        validate_args(parse_args(TINY + extra), world, device)
    assert error.value.flag == flag and text in str(error.value) and error.value.fix


def test_the_interleaved_schedule_on_one_hardware_queue_is_refused_on_nccl(monkeypatch):
    """CUDA_DEVICE_MAX_CONNECTIONS=1 under the interleaved schedule, on a GPU or the emulated
    NCCL: refused in one line (tests/test_p2p_nccl_rules.py shows why); gloo, 1F1B, or the
    variable unset: taken."""
    fake_find_spec(monkeypatch, set())
    vp = TINY + PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"]
    monkeypatch.setenv("RECOVER_COORDINATOR", "127.0.0.1:1")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setenv("RECOVER_EMULATE_NCCL", "1")
    for device in ("cuda", "cpu"):
        with pytest.raises(ArgumentError) as error:
            validate_args(parse_args(vp), 2, device)
        assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in str(error.value) and error.value.fix
    validate_args(parse_args(TINY + PP2), 2, "cuda")  # 1F1B
    monkeypatch.delenv("RECOVER_EMULATE_NCCL")
    validate_args(parse_args(vp), 2, "cpu")  # gloo
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    validate_args(parse_args(vp), 2, "cuda")


def test_pipeline_split_flags_are_taken_with_megatrons_meaning():
    by_layers = validate_args(parse_args(TINY + PP2 + [
        "--num-layers-per-virtual-pipeline-stage", "1"]), 2)
    assert model_chunks_of(by_layers) == 2  # 4 layers / PP 2 / 1 per chunk
    assert by_layers.microbatch_group_size_per_vp_stage == 2  # Megatron's default: PP
    assert by_layers.overlap_p2p_comm
    one_chunk = validate_args(parse_args(TINY + PP2 + [
        "--num-layers-per-virtual-pipeline-stage", "2", "--no-overlap-p2p-communication"]), 2)
    assert model_chunks_of(one_chunk) is None  # VP 1 is Megatron's None
    assert not one_chunk.overlap_p2p_comm
    uneven = validate_args(parse_args(TINY + PP2 + [
        "--num-virtual-stages-per-pipeline-rank", "2", "--decoder-last-pipeline-num-layers", "2",
        "--microbatch-group-size-per-virtual-pipeline-stage", "3"]), 2)
    assert model_chunks_of(uneven) == 2
    assert uneven.microbatch_group_size_per_vp_stage == 3
    counted = validate_args(parse_args(TINY + [  # (4 + 2) layers over PP 3: taken, no chunks
        "--pipeline-model-parallel-size", "3", "--num-layers", "4",
        "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]), 3)
    assert model_chunks_of(counted) is None
    assert "virtual_pipeline_model_parallel_size" not in vars(counted)  # derived, not written
