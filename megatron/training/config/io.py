"""Typed configuration of what a run reads: its data (and `config.py`'s model, optimizer and
loop). Like `config.py`: frozen dataclasses built once from the validated flags, each checked
where declared; the builders take these and never read the Namespace. The user-facing checks of
the data itself (files, splits, blend weights: one line naming the flag) stay in `datasets.py`,
where the files are read."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from megatron.training.config.data_sources import DataSources, data_sources
from megatron.training.config.rules import placed_topology
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # config.py imports megatron-core: not for a parse
    from megatron.training.config import RunLayout


@dataclass(frozen=True)
class FimFlags:
    """--fim-data's flags (Megatron-LM's names and defaults): data/fim.py applies them."""
    rate: float  # --fim-rate
    spm_rate: float  # --fim-spm-rate
    split_sample: str | None = None  # --fim-split-sample
    fragment_rate: float | None = None  # --fim-fragment-rate
    no_prefix: str | None = None  # --fim-no-prefix
    # --fim-prefix-token, --fim-middle-token, --fim-suffix-token, --fim-pad-token, --fim-eod-token
    tokens: tuple[str, str, str, str, str] = (
        "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<|endoftext|>")

    def __post_init__(self):
        for flag, rate in (("--fim-rate", self.rate), ("--fim-spm-rate", self.spm_rate),
                           ("--fim-fragment-rate", self.fragment_rate)):
            if rate is not None and not 0.0 <= rate <= 1.0:
                raise ValueError(f"{flag} {rate} is not a probability")
        if self.split_sample is not None and self.fragment_rate is None:
            raise ValueError("--fim-split-sample needs --fim-fragment-rate")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FimFlags | None:
        if not args.fim_data:
            return None
        return cls(args.fim_rate, args.fim_spm_rate, args.fim_split_sample, args.fim_fragment_rate,
                   args.fim_no_prefix, (args.fim_prefix_token, args.fim_middle_token,
                                        args.fim_suffix_token, args.fim_pad_token,
                                        args.fim_eod_token))


@dataclass(frozen=True)
class DataConfig:
    """The training data: megatron-core's GPT datasets (or mock data) and their sample counts."""
    mock: bool  # --mock-data
    sources: DataSources  # one blend split by --split, or a blend per split (config/data_sources.py)
    split: str | None  # --split (None: Megatron's default)
    cache_path: str | None  # --data-cache-path
    seed: int
    seq_length: int
    reset_position_ids: bool
    reset_attention_mask: bool
    eod_mask_loss: bool
    create_attention_mask: bool  # --create-attention-mask-in-dataloader
    mmap_bin_files: bool
    sizes: tuple[int, int, int]  # samples requested per split (train, valid, test)
    builder_threads: int = 1  # --num-dataset-builder-threads
    mid_level_surplus: float = 0.005  # --mid-level-dataset-surplus
    fim: FimFlags | None = None  # --fim-data: fill-in-the-middle samples

    def __post_init__(self):
        if min(self.sizes) < 0 or self.seq_length < 1:
            raise ValueError(f"split sizes {self.sizes}, sequence length {self.seq_length}")
        if self.fim is not None and self.mock:
            raise ValueError("--fim-data rewrites real text; mock data has none")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DataConfig:
        return cls(mock=bool(args.mock_data), sources=data_sources(args),
                   split=args.split, cache_path=args.data_cache_path, seed=args.seed,
                   seq_length=args.seq_length, reset_position_ids=bool(args.reset_position_ids),
                   reset_attention_mask=bool(args.reset_attention_mask),
                   eod_mask_loss=bool(args.eod_mask_loss),
                   create_attention_mask=bool(args.create_attention_mask_in_dataloader),
                   mmap_bin_files=bool(args.mmap_bin_files), sizes=dataset_sizes(args),
                   builder_threads=args.num_dataset_builder_threads,
                   mid_level_surplus=args.mid_level_dataset_surplus,
                   fim=FimFlags.from_args(args))


def dataset_sizes(args: argparse.Namespace) -> tuple[int, int, int]:
    """Samples requested per split, as Megatron computes them."""
    gbs = args.global_batch_size
    train_samples = args.train_samples
    train_iters = args.train_iters if args.train_iters is not None else train_samples // gbs
    train = train_samples if train_samples else train_iters * gbs
    valid = (train_iters // args.eval_interval + 1) * args.eval_iters * gbs
    test = args.eval_iters * gbs
    return train, valid, test


SHAPE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size")


FT_STATE_FILE = "recover_timeout.json"  # --calc-ft-timeouts' result, in --save


@dataclass(frozen=True)
class FtConfig:
    enabled: bool  # --enable-ft-package
    calculate: bool  # --calc-ft-timeouts (with --enable-ft-package, as in Megatron-LM)
    warmup_iters: int  # --ft-num-warmup-iters
    save: str | None  # the state file's directory: --save, as Megatron's ft_state.json

    def __post_init__(self):
        if self.warmup_iters < 0 or (self.enabled and not self.save):
            raise ValueError(f"fault-tolerance settings {self}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FtConfig:
        return cls(bool(args.enable_ft_package), bool(args.enable_ft_package and
                                                      args.calc_ft_timeouts),
                   args.ft_num_warmup_iters, args.save)

    @property
    def state_file(self) -> Path | None:
        return Path(self.save) / FT_STATE_FILE if self.enabled and self.save else None


@dataclass(frozen=True)
class NonPersistentConfig:
    """Megatron's non-persistent checkpoints (--non-persistent-*); checked against each other
    and the layout in `arguments.validate.io.validate_non_persistent`."""
    kind: str | None = None  # --non-persistent-ckpt-type: local or global (None: off)
    interval: int | None = None  # --non-persistent-save-interval (saves need --save, as there)
    local_dir: str | None = None  # --non-persistent-local-ckpt-dir
    global_dir: str | None = None  # --non-persistent-global-ckpt-dir (default SAVE/non_persistent)

    def __post_init__(self):
        if self.kind not in (None, "local", "global"):
            raise ValueError(f"non-persistent checkpoint type {self.kind!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> NonPersistentConfig:
        return cls(args.non_persistent_ckpt_type, args.non_persistent_save_interval,
                   args.non_persistent_local_ckpt_dir, args.non_persistent_global_ckpt_dir)


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving, loading and stopping (Megatron's checkpoint and exit flags)."""
    save: str | None
    load: str | None
    save_interval: int | None
    train_iters: int  # the last iteration always saves
    format: str  # --ckpt-format: torch or torch_dist
    async_save: bool
    persistent_worker: bool  # --use-persistent-ckpt-worker
    strictness: str  # --dist-ckpt-strictness
    finetune: bool
    load_optim: bool  # not --no-load-optim
    load_rng: bool
    save_optim: bool
    save_rng: bool
    exit_signal_handler: bool
    exit_interval: int | None
    exit_duration_in_mins: float | None
    tensor_parallel: int
    pipeline_parallel: int
    context_parallel: int  # CP ranks hold the same weights: they share a save as replicas do
    # the rank order of the run's layout: --use-tp-pp-dp-mapping's, or --recover-placement's choice
    tp_pp_dp_mapping: bool
    # --dist-ckpt-optim-fully-reshardable with --use-distributed-optimizer (Megatron's condition)
    optimizer_fully_reshardable: bool
    ckpt_step: int | None  # --ckpt-step: load this iteration instead of the latest
    exit_on_missing: bool  # --exit-on-missing-checkpoint
    assume_constant_structure: bool  # --ckpt-assume-constant-structure
    fully_parallel_save: bool  # torch_dist: the live replicas share the writing (not --no-ckpt-...)
    verify_integrity: bool  # --verify-integrity: a SHA-256 manifest written, checked on load
    non_persistent: NonPersistentConfig
    ft: FtConfig  # --enable-ft-package etc.: --calc-ft-timeouts times the iterations here
    model_shape: tuple[tuple[str, int | None], ...]  # (flag dest, value): a checkpoint must match
    # Megatron's format stores the run's whole Namespace under "args" (its loaders read it back):
    # a copy taken here is that payload, never read for a setting
    megatron_args: argparse.Namespace
    retain_interval: int | None = None  # --save-retain-interval

    def __post_init__(self):
        if self.format not in ("torch", "torch_dist"):
            raise ValueError(f"checkpoint format {self.format!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace, padded_vocab_size: int | None = None,
                  layout: RunLayout | None = None) -> CheckpointConfig:
        """`padded_vocab_size` and the `layout` go into the payload's args, where Megatron-LM
        keeps them."""
        payload = argparse.Namespace(**vars(args))
        if padded_vocab_size is not None:
            payload.padded_vocab_size = padded_vocab_size
        if layout is not None:
            vars(payload).update(layout.megatron_fields(args))
        return cls(
            save=args.save, load=args.load, save_interval=args.save_interval,
            train_iters=args.train_iters, format="torch_dist" if args.ckpt_format == "fsdp_dtensor" else args.ckpt_format, async_save=bool(args.async_save),
            persistent_worker=bool(args.use_persistent_ckpt_worker),
            strictness=args.dist_ckpt_strictness, finetune=bool(args.finetune),
            load_optim=not args.no_load_optim, load_rng=not args.no_load_rng,
            save_optim=not args.no_save_optim, save_rng=not args.no_save_rng,
            exit_signal_handler=bool(args.exit_signal_handler), exit_interval=args.exit_interval,
            exit_duration_in_mins=args.exit_duration_in_mins,
            tensor_parallel=args.tensor_model_parallel_size,
            pipeline_parallel=args.pipeline_model_parallel_size,
            context_parallel=args.context_parallel_size,
            tp_pp_dp_mapping=bool(args.use_tp_pp_dp_mapping) if layout is None else
            placed_topology(args, layout.world_size, layout.node_size).dp_last,
            optimizer_fully_reshardable=bool(args.dist_ckpt_optim_fully_reshardable
                                             and args.use_distributed_optimizer),
            ckpt_step=args.ckpt_step, exit_on_missing=bool(args.exit_on_missing_checkpoint),
            assume_constant_structure=bool(args.ckpt_assume_constant_structure),
            fully_parallel_save=args.ckpt_fully_parallel_save,
            verify_integrity=bool(args.verify_integrity),
            non_persistent=NonPersistentConfig.from_args(args), ft=FtConfig.from_args(args),
            retain_interval=args.save_retain_interval,
            model_shape=tuple((flag, vars(args)[flag]) for flag in SHAPE_FLAGS),
            megatron_args=payload)


# Megatron-LM builds these three alike: megatron-core's SentencePiece wrapper over a .model file
SENTENCEPIECE_TYPES = ("GPTSentencePieceTokenizer", "SentencePieceTokenizer", "Llama2Tokenizer")
SUPPORTED_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer", "TikTokenizer",
                   *SENTENCEPIECE_TYPES)
MODEL_FILE_TYPES = ("HuggingFaceTokenizer", "TikTokenizer", *SENTENCEPIECE_TYPES)  # read from
# --tokenizer-model


@dataclass(frozen=True)
class TokenizerConfig:
    """--tokenizer-type and what it needs (training's and preprocessing's flags alike); the
    files are checked, naming their flag, when the tokenizer is built (`tokenizer.py`)."""
    kind: str | None  # None: the default type
    vocab_file: str | None = None
    merge_file: str | None = None
    model: str | None = None  # --tokenizer-model (HuggingFace, TikToken, SentencePiece)
    vocab_size: int | None = None  # NullTokenizer; TikTokenizer's (with its special tokens)
    tiktoken_pattern: str | None = None  # --tiktoken-pattern v1|v2 (None: megatron-core's v2)
    tiktoken_special: int = 1000  # --tiktoken-num-special-tokens
    special_tokens: tuple[str, ...] | None = None  # --tokenizer-special-tokens
    sp_legacy: bool = False  # --tokenizer-sentencepiece-legacy
    # --no-tokenizer-sentencepiece-ignore-extra-whitespaces turns it off
    sp_ignore_extra_whitespaces: bool = True

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TokenizerConfig:
        special = args.special_tokens
        return cls(args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model,
                   args.vocab_size, args.tiktoken_pattern, args.tiktoken_num_special_tokens,
                   None if special is None else tuple(special),
                   bool(args.tokenizer_sentencepiece_legacy),
                   bool(args.tokenizer_sentencepiece_ignore_extra_whitespaces))


@dataclass(frozen=True)
class TensorBoardConfig:
    """What --tensorboard-dir and its companion flags ask for."""
    log_dir: str
    log_interval: int = 1
    queue_size: int = 1000
    validation_ppl: bool = False
    timers: bool = False
    timing_level: int = 0
    memory: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TensorBoardConfig | None:
        if args.tensorboard_dir is None:
            return None
        return cls(args.tensorboard_dir, args.tensorboard_log_interval, args.tensorboard_queue_size,
                   args.log_validation_ppl_to_tensorboard, args.log_timers_to_tensorboard,
                   args.timing_log_level, args.log_memory_to_tensorboard)


@dataclass(frozen=True)
class WandbConfig:
    """--wandb-project (on when given), --wandb-exp-name, --wandb-save-dir, --wandb-entity."""
    project: str
    exp_name: str
    save_dir: str
    entity: str
    run_config: dict

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WandbConfig | None:
        if not args.wandb_project:
            return None
        plain = {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
                 for k, v in vars(args).items() if k != "job_token"}
        return cls(args.wandb_project, args.wandb_exp_name, args.wandb_save_dir or ".",
                   args.wandb_entity, plain)
