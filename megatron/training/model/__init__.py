"""megatron-core's GPTModel built for ReCoVer: CPU-capable attention plugged in through the layer
spec, pipeline stages through pre/post_process, and parameters initialised by *global* name so every
TP x PP x DP layout starts from the same weights as a single-process run.

Precision: the model is cast to the training dtype (bf16/fp16) as Megatron's `Float16Module` does
(`module.bfloat16()`: torch norms are built in fp32 whatever `params_dtype` says). The wrapper
itself is not used: its other jobs are casting first-stage float inputs (ours are token ids) and
last-stage outputs to fp32 (the loss does that), and it would nest every state-dict key under
`module.`.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import math
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.common.embeddings import rotary_pos_embedding
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                      get_gpt_layer_local_spec)
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                         get_num_layers_to_build)
from torch.nn.attention import SDPBackend, sdpa_kernel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

from megatron.training.config import ModelConfig
from megatron.training.model.context_parallel import (context_parallel_attention,
                                                pos_emb_on_this_cp_rank)
from megatron.training.model.context_parallel.comm import ring_attention, ulysses_attention
from megatron.training.model.expert_linear import ExpertOutputLinear
from megatron.training.model.latent_attention import gather_latents_with_their_group
from megatron.training.model.norms import LatentNorm, TorchNorm
from megatron.training.model.gated_delta_net import use_torch_gated_delta_rule, with_linear_attention
from megatron.training.model.initialization import init_parameters_by_name
from megatron.training.model.moe_cpu import use_host_alltoall

logger = logging.getLogger(__name__)


CP_ATTENTION = {"allgather": context_parallel_attention, "p2p": ring_attention,
                "a2a": ulysses_attention}


class SDPACoreAttention(MegatronModule):
    """Core attention with `torch.nn.functional.scaled_dot_product_attention`.

    megatron-core's DotProductAttention allocates its score buffer on CUDA; this module takes the
    same constructor arguments (it is plugged in as the spec's `core_attention`) and runs anywhere.
    Attention dropout draws from the model-parallel RNG stream: heads are sharded across TP ranks.
    """

    # --attention-backend: which SDPA kernels may run (torch picks among them); auto: any.
    KERNELS = {AttnBackend.flash: [SDPBackend.FLASH_ATTENTION],
               AttnBackend.fused: [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
               AttnBackend.unfused: [SDPBackend.MATH], AttnBackend.local: [SDPBackend.MATH]}

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None, pg_collection=None,
                 k_channels=None, v_channels=None):
        # k_channels / v_channels: multi-latent attention's head sizes; SDPA reads the tensors'
        super().__init__(config=config)
        # read by megatron-core's default sharded_state_dict (a torch_dist checkpoint): it has no
        # parameters, but without a group of its own it would look up the global TP group
        self.tp_group = None if pg_collection is None else pg_collection.tp
        cp = None if pg_collection is None else pg_collection.cp  # CP: this replica's sequence
        self.cp_group = cp if cp is not None and cp.size() > 1 else None  # split over CP ranks
        # megatron-core passes this layer's --cp-comm-type (transformer-engine's names)
        self.cp_attention = CP_ATTENTION[cp_comm_type or "p2p"]
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale
        kernels = self.KERNELS.get(config.attention_backend)
        self.kernels = contextlib.nullcontext if kernels is None else (lambda: sdpa_kernel(kernels))
        # --window-size (LEFT, RIGHT) on this layer unless --window-attn-skip-freq skips it
        self.window = config.window_size if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number) else None

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("attention bias / packed sequences need transformer_engine")
        dropout = self.dropout if self.training else 0.0
        rng = get_cuda_rng_tracker().fork() if dropout > 0 else contextlib.nullcontext()
        if self.cp_group is not None:  # causal over the whole sequence (no mask: refused)
            with rng, self.kernels():
                return self.cp_attention(query, key, value, self.cp_group, self.softmax_scale,
                                         dropout)
        # megatron: [seq, batch, heads, head_dim]; sdpa: [batch, heads, seq, head_dim]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask = None if attention_mask is None else ~attention_mask  # megatron: True = masked out
        if self.window is not None:
            mask = windowed(self.window, q.size(2), mask, q.device)
        with rng, self.kernels():
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None,
                scale=self.softmax_scale, enable_gqa=q.size(1) != k.size(1))
        b, h, s, d = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, h * d)


def windowed(window: tuple[int, int], seq: int, mask: torch.Tensor | None,
             device) -> torch.Tensor:
    """Sliding-window attention's mask (True = attend) for causal self-attention over `seq`
    positions: query i sees keys j with i - LEFT <= j <= i (+ RIGHT, which causality caps;
    -1: unbounded), as transformer-engine reads megatron-core's window_size; within `mask`."""
    allowed = _band(*window, seq, str(device))
    return allowed if mask is None else allowed & mask


@functools.lru_cache(maxsize=16)
def _band(left: int, right: int, seq: int, device: str) -> torch.Tensor:
    """The window's seq x seq band, built once per shape and device (every windowed layer and
    microbatch reads the same one; nothing writes to it)."""
    i = torch.arange(seq, device=device).unsqueeze(1)
    j = torch.arange(seq, device=device).unsqueeze(0)
    return (j <= i) & ((j >= i - left) if left >= 0 else True) \
        & ((j <= i + right) if right >= 0 else True)


class RecoverGPTModel(GPTModel):
    """GPTModel whose tied-embedding set-up does not call `.cuda()`.

    With PP > 1 the stock set-up zeroes the last stage's copy of the word embeddings and all-reduces
    it on CUDA. Here both copies get identical values from `init_parameters_by_name`, and the
    trainer all-reduces their gradients over the embedding group each step.
    """

    def setup_embeddings_and_output_layer(self) -> None:
        if self.pre_process:
            self.embedding.word_embeddings.weight.is_embedding_or_output_parameter = True
        if self.post_process and self.output_layer.weight is not None:
            self.output_layer.weight.is_embedding_or_output_parameter = True
        if not self.share_embeddings_and_output_weights:
            return
        weight = self.shared_embedding_or_output_weight()
        if self.config.pipeline_model_parallel_size > 1:
            weight.tied_embedding_copy = True  # grads summed over the embedding group
            weight.tied_embedding_is_duplicate = not self.pre_process  # count it once in norms

    def tie_embeddings_and_output_weights_state_dict(self, sharded_state_dict, output_layer_weight_key,
                                                     first_stage_word_emb_key, metadata=None) -> None:
        """megatron-core's (the last stage's output weight is saved as a copy of the first
        stage's embedding), with the DP part of the replica id taken from metadata's group: the
        stock one reads parallel_state's global group, which ReCoVer does not set up."""
        if not self.post_process or self.pre_process:
            return
        group = metadata["dp_cp_group"]
        sharded_state_dict[output_layer_weight_key] = make_tp_sharded_tensor_for_checkpoint(
            tensor=self.shared_embedding_or_output_weight(), key=first_stage_word_emb_key,
            replica_id=(1, 0, dist.get_rank(group)), allow_shape_mismatch=True,
            tp_group=self.tp_group, dp_cp_group=group)


def layer_spec(implementation: str, config: TransformerConfig, vp_stage: int | None,
               pp_rank: int, tp_group=None):
    """This model chunk's layers: megatron-core's count (uneven first/last stages, embedding or
    loss counted as a layer, model chunks) with ReCoVer's CPU-capable modules; gated delta nets
    on the layers --linear-attention-freq names (only with local layers: checked before)."""
    block = _standard_layers(implementation, config, vp_stage, pp_rank, tp_group)
    if config.experimental_attention_variant is None:
        return block
    return with_linear_attention(block, config, TorchNorm, vp_stage, pp_rank)


def _standard_layers(implementation: str, config: TransformerConfig, vp_stage: int | None,
                     pp_rank: int, tp_group):
    te = implementation == "transformer_engine"  # a GPU with TE installed (checked before)
    if config.num_moe_experts:  # megatron-core's dense / MoE layers by --moe-layer-freq
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=te,
                                           normalization=config.normalization,
                                           vp_stage=vp_stage, pp_rank=pp_rank)
        for spec in {id(s): s for s in block.layer_specs}.values():  # the dense and MoE specs
            _recover_modules(spec, config, te, tp_group)
            if not te and spec.submodules.mlp.module is MoELayer:
                spec.submodules.mlp.submodules.experts.submodules.linear_fc2 = ExpertOutputLinear
        if not te:
            block.layer_norm = TorchNorm
        return block
    if te:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec)
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm,
                                                          qk_l2_norm=config.qk_l2_norm)
        _recover_modules(spec, config, te, tp_group)
        return spec
    spec = get_gpt_layer_local_spec(normalization=config.normalization,
                                    qk_layernorm=config.qk_layernorm,
                                    multi_latent_attention=config.multi_latent_attention,
                                    qk_l2_norm=config.qk_l2_norm)
    _recover_modules(spec, config, te, tp_group)
    return TransformerBlockSubmodules(
        layer_specs=[spec] * get_num_layers_to_build(config, vp_stage, pp_rank),
        layer_norm=TorchNorm)


def _recover_modules(spec, config: TransformerConfig, te: bool, tp_group) -> None:
    """ReCoVer's attention and norms in a megatron-core layer spec (with transformer-engine,
    only the attention with CP: not run on a GPU yet)."""
    layer, attention = spec.submodules, spec.submodules.self_attention.submodules
    if te:
        if config.context_parallel_size > 1:
            attention.core_attention = SDPACoreAttention
        return
    attention.core_attention = SDPACoreAttention
    layer.input_layernorm = layer.pre_mlp_layernorm = TorchNorm
    if config.multi_latent_attention and config.q_lora_rank is None:
        # megatron-core 0.16.1 builds MLA's query projection without its TP group (then looked
        # up in parallel_state, which ReCoVer does not set up): the spec hands it over
        attention.linear_q_proj = ModuleSpec(module=attention.linear_q_proj,
                                             params={"tp_group": tp_group})
    if config.qk_layernorm and config.multi_latent_attention:  # the latents' norms
        attention.q_layernorm = attention.kv_layernorm = LatentNorm
    elif config.qk_layernorm and not config.qk_l2_norm:  # (megatron-core's L2Norm wins)
        attention.q_layernorm = attention.k_layernorm = TorchNorm


class DeviceMemoryBuffer:
    """megatron-core's GlobalMemoryBuffer (the all-gather scratch of sequence parallelism) on a
    given device: the stock one allocates on `torch.cuda.current_device()`."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.buffer: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None) -> torch.Tensor:
        numel = math.prod(tensor_shape)
        held = self.buffer.get((name, dtype))
        if held is None or held.numel() < numel:
            held = self.buffer[(name, dtype)] = torch.empty(numel, dtype=dtype, device=self.device)
        return held[:numel].view(*tensor_shape)


class ModelChunks(torch.nn.ModuleList):
    """A pipeline rank's model chunks (the interleaved schedule): chunk c is virtual stage
    c * PP + rank. Parameters, `state_dict` and `modules()` span every chunk, so the optimizer,
    the gradient buffer and state transfer take it like one model; checkpoints store each chunk
    under Megatron's key (`checkpoint_keys`)."""


def model_chunks(model: torch.nn.Module) -> list[RecoverGPTModel]:
    """The model chunks of `build_model`'s result, in virtual-stage order."""
    chunks = list(model) if isinstance(model, ModelChunks) else [model]
    return cast(list[RecoverGPTModel], chunks)


def checkpoint_keys(model: torch.nn.Module) -> list[str]:
    """Megatron's checkpoint keys of a rank's model, one per chunk: "model", or "model0",
    "model1", ... with an interleaved schedule."""
    chunks = model_chunks(model)
    return ["model"] if len(chunks) == 1 else [f"model{c}" for c in range(len(chunks))]


def build_model(model_config: ModelConfig, pg_collection: ProcessGroupCollection,
                pp_stage: int, tp_rank: int, device: torch.device | str = "cpu"
                ) -> torch.nn.Module:
    """This rank's GPTModel, or its `ModelChunks` with an interleaved schedule."""
    m, config = model_config, model_config.transformer
    parallel_state._GLOBAL_MEMORY_BUFFER = DeviceMemoryBuffer(device)
    _fit_megatron_core_to_this_host(config)
    vp = m.model_chunks
    first, last = pp_stage == 0, pp_stage == config.pipeline_model_parallel_size - 1
    chunks = [
        RecoverGPTModel(
            config=config,
            transformer_layer_spec=layer_spec(m.implementation, config, vp_stage, pp_stage,
                                              pg_collection.tp),
            vocab_size=m.padded_vocab_size,
            max_sequence_length=m.max_sequence_length,
            pre_process=first and not vp_stage,
            post_process=last and vp_stage in (None, (vp or 1) - 1),
            parallel_output=True,
            share_embeddings_and_output_weights=m.share_embeddings,
            position_embedding_type=m.position_embedding_type,
            rotary_percent=m.rotary_percent,
            rotary_base=m.rotary_base,
            rope_scaling=m.rope_scaling,
            rope_scaling_factor=m.rope_scaling_factor,
            seq_len_interpolation_factor=m.rope_interpolation,
            pg_collection=pg_collection,
            vp_stage=vp_stage,
        ) for vp_stage in ([None] if vp is None else range(vp))]
    for chunk in chunks:
        init_parameters_by_name(chunk, seed=m.seed, std=config.init_method_std,
                                num_layers=config.num_layers,
                                tp_size=config.tensor_model_parallel_size, tp_rank=tp_rank,
                                gated=config.gated_linear_unit)
    model = chunks[0] if vp is None else ModelChunks(chunks)
    if config.multi_latent_attention and config.tensor_model_parallel_size > 1:
        gather_latents_with_their_group(model)
    if pg_collection.ep.rank() > 0:  # MoE: the unit's first replica counts its dense weights
        mark_unit_duplicates(model)
    return model.to(device=device, dtype=config.params_dtype)


def mark_unit_duplicates(model: torch.nn.Module) -> None:
    """Norms are summed over a unit (expert parallelism, a Megatron-FSDP shard group), whose
    first replica alone counts the dense weights: the other replicas mark theirs."""
    for param in model.parameters():
        setattr(param, "unit_duplicate", getattr(param, "allreduce", True))  # not an expert


def _fit_megatron_core_to_this_host(config: TransformerConfig) -> None:
    """Where megatron-core 0.16.1 assumes CUDA, transformer-engine or fla, the CPU-capable
    piece of the same meaning, put where megatron-core looks it up."""
    if not torch.cuda.is_available():
        # megatron-core's sequence-parallel mappings allocate their outputs on
        # `torch.cuda.current_device()`; on a CPU-only build that raises. Answering "cpu" turns
        # those allocations into CPU ones and nothing else (CUDA stays unavailable).
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    if config.context_parallel_size > 1:
        # rope's table is cut to this CP rank's chunks by a megatron-core function that moves its
        # index with `.cuda()`; the module reads it by name at each call, so the CPU-capable one
        # of the same meaning goes there (the only way in: it is not a constructor argument)
        rotary_pos_embedding.get_pos_emb_on_this_cp_rank = pos_emb_on_this_cp_rank
    if config.num_moe_experts and not hasattr(moe_utils, "te_general_gemm"):
        # megatron-core 0.16.1's router reads this name when transformer-engine is absent too
        # (its import failed, so the name is undefined); None is the value its check expects
        moe_utils.te_general_gemm = None
    if config.num_moe_experts and not torch.cuda.is_available():
        use_host_alltoall()  # megatron-core's alltoall dispatcher asks for a CUDA stream
    if config.multi_latent_attention and importlib.util.find_spec("transformer_engine") is None:
        # megatron-core 0.16.1's MLA takes its transformer-engine names from a module that
        # answers mocks without transformer-engine, and then asks isinstance(.., the mock)
        multi_latent_attention.HAVE_TE = False
    if config.experimental_attention_variant is not None:
        use_torch_gated_delta_rule()


def memory_note(model: torch.nn.Module, grad_bytes_per_param: int, optimizer_shards: int = 1,
                weights_sharded: bool = False) -> None:
    """Start-up line: bytes per parameter of weights, fp32 main weights, Adam, gradient buffers;
    main weights and Adam divided over `optimizer_shards` (--use-distributed-optimizer), and the
    weights too between uses if `weights_sharded` (Megatron-FSDP)."""
    n = sum(p.numel() for p in model.parameters())
    weight = next(model.parameters()).element_size() / (optimizer_shards if weights_sharded else 1)
    # fp32: the main weights are the model's, unless the weights are freed between uses
    main = (0 if weight == 4 and not weights_sharded else 4) / optimizer_shards
    adam = 8 / optimizer_shards
    sharded = f", main weights and Adam over {optimizer_shards} shards" if optimizer_shards > 1 else ""
    if weights_sharded:
        sharded = (f", all but gradients over {optimizer_shards} shards (a module's weights "
                   "whole while it runs)")
    logger.info(f"{n} parameters on this rank: {weight:g} (weights) + {main:g} (fp32 main weights)"
                f" + {adam:g} (Adam) + {grad_bytes_per_param} (gradient buffers: local + "
                f"out-of-place reduced; Megatron's DDP keeps one, 4) = "
                f"{weight + main + adam + grad_bytes_per_param:g} bytes per parameter{sharded}")
