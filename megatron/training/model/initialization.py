"""Parameters initialised by *global* name: each full tensor is drawn from a generator keyed by
(seed, its name in the unsplit model), then cut to this rank's shard, so every TP x PP x DP layout
starts from the single-process run's weights."""
from __future__ import annotations

import math
import re

import torch
from megatron.core.models.gpt import GPTModel

from recover_patches.pipeline.rng import derive_seed

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_SCALED_INIT = ("linear_proj.weight", "linear_fc2.weight")  # Megatron's output_layer_init_method


def global_parameter_name(model: GPTModel, local_name: str) -> str:
    """The parameter's name in the unsplit model: global layer index, tied copies share a name."""
    match = _LAYER.match(local_name)
    if match:
        layer = model.decoder.layers[int(match.group(1))]
        rest = local_name[match.end():]
        expert = _EXPERT.match("." + rest)
        if expert:  # MoE: with expert parallelism, local expert i is global expert offset + i
            rest = (f"mlp.experts.local_experts.{layer.mlp.local_expert_indices[int(expert[1])]}."
                    + rest[expert.end() - 1:])
        return f"decoder.layers.{layer.layer_number - 1}." + rest
    if local_name == "output_layer.weight" and model.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"
    return local_name


@torch.no_grad()
def init_parameters_by_name(model: GPTModel, *, seed: int, std: float, num_layers: int,
                            tp_size: int, tp_rank: int, gated: bool = False) -> None:
    """Draw each parameter's *full* tensor from a generator keyed by (seed, global name), then keep
    this TP rank's shard. Constant-initialised parameters (norm weights, biases) keep megatron's
    values. The result does not depend on TP, PP or DP -- the basis of parallel equivalence."""
    for local_name, param in model.named_parameters():
        if param.numel() == 0 or bool((param == param.reshape(-1)[0]).all()):
            continue
        name = global_parameter_name(model, local_name)
        scaled = name.endswith(_SCALED_INIT)
        sigma = std / math.sqrt(2.0 * num_layers) if scaled else std
        full_shape = list(param.shape)
        split = getattr(param, "tensor_model_parallel", False) and tp_size > 1
        if split:
            full_shape[param.partition_dim] *= tp_size
        generator = torch.Generator().manual_seed(derive_seed(seed, *name.encode()))
        # drawn in fp32 on the CPU whatever the training dtype and device: a bf16 model starts
        # from the fp32 model's weights, rounded
        full = torch.empty(full_shape, dtype=torch.float32)
        if not _drawn_by_its_own_law(name, full, generator):
            full.normal_(0.0, sigma, generator=generator)
        if split:
            full = _this_ranks_part(full, param, tp_size, tp_rank,
                                    gated_fc1=gated and ".linear_fc1." in name)
        param.copy_(full)


def _drawn_by_its_own_law(name: str, full: torch.Tensor, generator: torch.Generator) -> bool:
    """Gated delta net parameters, drawn as megatron-core's GatedDeltaNet draws them (not from
    the normal law of --init-method-std); True when `full` was drawn here."""
    if name.endswith(".self_attention.A_log"):  # the decay rates: log of U(1, 16)
        full.uniform_(1.0, 16.0, generator=generator).log_()
        return True
    if name.endswith(".self_attention.conv1d.weight"):  # torch's Conv1d default (kaiming,
        bound = 1.0 / math.sqrt(full[0].numel())       # a = sqrt 5): U(+-1/sqrt(fan in))
        full.uniform_(-bound, bound, generator=generator)
        return True
    return False


def _this_ranks_part(full: torch.Tensor, param: torch.nn.Parameter, tp_size: int, tp_rank: int,
                     gated_fc1: bool) -> torch.Tensor:
    """This TP rank's shard of a full tensor. A tensor stacking sections (a gated MLP's fc1 is
    [gate; up]; a gated delta net's projections name theirs in `tp_sections`) holds its part of
    each section, in order."""
    dim: int = getattr(param, "partition_dim")  # megatron-core's attribute of TP-split params
    sections = getattr(param, "tp_sections", None)
    if sections is None and gated_fc1:
        sections = (full.shape[dim] // 2,) * 2
    if sections is None:
        return full.chunk(tp_size, dim=dim)[tp_rank]
    return torch.cat([section.chunk(tp_size, dim=dim)[tp_rank]
                      for section in full.split(list(sections), dim=dim)], dim=dim)
