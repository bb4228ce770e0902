"""torch norms for megatron-core's local layer spec, with what the step needs to know of their
gradients over TP."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """--apply-layernorm-1p: the scale is 1 + weight, the weight starting at 0 (transformer-engine's
    zero-centred gamma, which Megatron-LM keeps for numerical stability)."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """The RMSNorm of --apply-layernorm-1p: scale 1 + weight, the weight starting at 0."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


class TorchNorm:
    """torch LayerNorm / RMSNorm for the local spec, like megatron-core's WrappedTorchNorm, which
    refuses sequence parallelism only because nothing would sum the norms' gradients over TP.
    Here the params say so (`sequence_parallel`), and the step sums them
    (`optimizer.sync_sequence_parallel_grads`). A per-head q/k norm sees only this TP rank's heads,
    so its gradient is partial whenever TP > 1."""
    narrower_is_per_head = True  # a norm narrower than the hidden size normalises heads

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        layer_norm = config.normalization == "LayerNorm"
        if config.layernorm_zero_centered_gamma:  # --apply-layernorm-1p
            norm_cls: type = ZeroCenteredLayerNorm if layer_norm else ZeroCenteredRMSNorm
        else:
            norm_cls = torch.nn.LayerNorm if layer_norm else torch.nn.RMSNorm
        norm = norm_cls(hidden_size, eps=eps)
        per_head = cls.narrower_is_per_head and hidden_size != config.hidden_size
        partial = config.tensor_model_parallel_size > 1 if per_head else config.sequence_parallel
        for p in norm.parameters():
            setattr(p, "sequence_parallel", partial)
            setattr(p, "latent_norm", not cls.narrower_is_per_head)
        return norm


class LatentNorm(TorchNorm):
    """A norm of multi-latent attention's query or key-value latent. Every TP rank holds the
    whole latent (megatron-core gathers it before the norm), so the gradient is whole there too,
    partial only under sequence parallelism; megatron-core names the query's `q_layernorm` all
    the same, and `latent_norm` keeps it out of the per-head q/k norms' TP sum."""
    narrower_is_per_head = False
