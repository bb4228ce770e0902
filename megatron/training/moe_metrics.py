"""[P] MoE's auxiliary losses in Megatron's log line and TensorBoard, counted like the loss.

megatron-core's routers record each auxiliary loss (over its coefficient) per layer in a tracker
while they run forward. Megatron-LM sums the tracker over a rank's microbatches, over the
pipeline stages and (for the load-balancing losses, whose value each TP rank holds a part of)
over TP, averages it over the data-parallel ranks, divides by the rank's microbatch count and
averages over the MoE layers: the mean over the iteration's M microbatches of each layer's loss,
averaged over layers. Here a rank would count a redone microbatch twice and a filler once, so
`AuxLossMeter` takes the tracker per microbatch (`GPTStage`'s meter: none for a filler); the
sums of the microbatches the iteration commits ride in the gradient reduction's tail
(`Totals.measures`), and the replica's ranks combine their stages and TP ranks with the MAX
they already share the loss with (`share_rows`: every value is >= 0 and each rank fills only
its own TP row, so the maximum is that row). The result is the same number on every replica,
and on a recovered iteration the same as on the failure-free one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

_TP_SUMMED = ("load_balancing_loss", "seq_load_balancing_loss")  # a part on each TP rank


def aux_loss_report(config: TransformerConfig) -> AuxLossReport | None:
    """What a MoE model's log line reports: Megatron-LM's track_names, in its order (its test of
    the balancing type included), over its count of MoE layers. None for a dense model."""
    if not config.num_moe_experts:
        return None
    types = config.moe_router_load_balancing_type
    names = [name for kind, name in (("aux_loss", "load_balancing_loss"),
                                     ("seq_aux_loss", "seq_load_balancing_loss")) if kind in types]
    names += ["z_loss"] if config.moe_z_loss_coeff is not None else []
    if not names:
        return None
    freq = config.moe_layer_freq
    moe_layers = sum(1 for i in range(config.num_layers) if i % freq == 0) \
        if isinstance(freq, int) else sum(freq)
    return AuxLossReport(tuple(names), config.num_layers, moe_layers,
                         config.moe_per_layer_logging)


class AuxLossMeter:
    """A `ForwardMeter` over megatron-core's tracker: [names x layers] per microbatch."""

    def __init__(self, names: tuple[str, ...], num_layers: int, device: torch.device):
        self.names, self.num_layers, self.device = names, num_layers, device

    def start(self) -> None:
        tracker = get_moe_layer_wise_logging_tracker()
        for name in self.names:
            if name in tracker:
                tracker[name]["values"].zero_()

    def take(self) -> torch.Tensor:
        tracker = get_moe_layer_wise_logging_tracker()
        return torch.stack([
            tracker[name]["values"].detach().double().clone() if name in tracker else
            torch.zeros(self.num_layers, dtype=torch.float64, device=self.device)
            for name in self.names])


@dataclass(frozen=True)
class AuxLossReport:
    names: tuple[str, ...]
    num_layers: int
    moe_layers: int
    per_layer: bool  # --moe-per-layer-logging

    @property
    def slots(self) -> int:
        return len(self.names) * self.num_layers

    def rows(self, measures: torch.Tensor | None, tp: int, tp_rank: int) -> list[float]:
        """This rank's sums in its own TP row of [tp x names x layers], zeros elsewhere."""
        rows = [0.0] * (tp * self.slots)
        if measures is not None:
            rows[tp_rank * self.slots:(tp_rank + 1) * self.slots] = measures.tolist()
        return rows

    def scalars(self, shared: list[float], tp: int, microbatches: int) -> dict[str, float]:
        """Megatron's values (and with per-layer logging, its `moe/<name>_layer_<i>` tags)."""
        table = torch.tensor(shared, dtype=torch.float64).reshape(tp, len(self.names),
                                                                   self.num_layers)
        out: dict[str, float] = {}
        for k, name in enumerate(self.names):
            layers = table[:, k].sum(0) if name in _TP_SUMMED else table[:, k].mean(0)
            layers = layers / max(microbatches, 1)
            out[name] = float(layers.sum()) / self.moe_layers
            if self.per_layer:
                out.update({f"moe/{name}_layer_{i}": float(v) for i, v in enumerate(layers)})
        return out
