"""What MoE's routers record per microbatch, counted like the loss: the auxiliary losses of
Megatron's log line and TensorBoard, and the token counts of the router's expert bias.

megatron-core's routers record each auxiliary loss (over its coefficient) per layer in a tracker,
and with --moe-router-enable-expert-bias count the tokens routed to each expert, while they run
forward. Megatron-LM sums both over a rank's microbatches and over the replicas (the losses over
the pipeline stages and, for the load-balancing ones, whose value each TP rank holds a part of,
over TP; the counts over TP); it logs each loss as the mean over the iteration's M microbatches,
averaged over the MoE layers, and moves each expert's bias by the update rate towards the
layer's mean count. Here a rank would count a redone microbatch twice and a filler once, so
`RouterMeter` takes the records per microbatch (`GPTStage`'s meter: none for a filler); the sums
of the microbatches the iteration commits ride in the gradient reduction's tail
(`Totals.measures`), and the replica's ranks combine their stages and TP ranks with the MAX they
already share the loss with (`RouterReport.rows`: every value is >= 0 and each rank fills only its
own TP row, so the maximum is that row). The result is the same on every replica, and on a
recovered iteration the same as on the failure-free one.

Counts ride in the float32 tail split at 256 (hi, lo per microbatch): exact while M < 65536
microbatches and an expert's count per iteration < 2**32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
from megatron.core.transformer.transformer_config import TransformerConfig

_TP_SUMMED = ("load_balancing_loss", "seq_load_balancing_loss")  # a part on each TP rank
_SPLIT = 256.0


def routers_of(model: torch.nn.Module) -> list:
    """megatron-core's routers with an expert bias, in this model (chunk)."""
    return [m for m in model.modules() if getattr(m, "expert_bias", None) is not None]


@dataclass(frozen=True)
class RouterReport:
    names: tuple[str, ...]  # Megatron-LM's track_names, in its order
    num_layers: int
    moe_layers: int
    per_layer: bool  # --moe-per-layer-logging
    experts: int
    bias_rate: float | None  # --moe-router-bias-update-rate with --moe-router-enable-expert-bias

    @property
    def loss_slots(self) -> int:
        return len(self.names) * self.num_layers

    @property
    def slots(self) -> int:
        counts = 2 * self.num_layers * self.experts if self.bias_rate is not None else 0
        return self.loss_slots + counts

    def rows(self, measures: torch.Tensor | None, tp: int, tp_rank: int) -> list[float]:
        """This rank's sums in its own TP row of [tp x slots], zeros elsewhere."""
        rows = [0.0] * (tp * self.slots)
        if measures is not None:
            rows[tp_rank * self.slots:(tp_rank + 1) * self.slots] = measures.tolist()
        return rows

    def conclude(self, shared: list[float], tp: int, microbatches: int,
                 model: torch.nn.Module) -> dict[str, float]:
        """The committed iteration's records: this rank's routers take Megatron's bias update;
        returns the log values (and with per-layer logging its `moe/<name>_layer_<i>` tags)."""
        table = torch.tensor(shared, dtype=torch.float64).reshape(tp, self.slots)
        if self.bias_rate is not None:
            split = table[:, self.loss_slots:].sum(0).reshape(2, self.num_layers, self.experts)
            self._update_biases(split[0] * _SPLIT + split[1], model, self.bias_rate)
        losses = table[:, :self.loss_slots].reshape(tp, len(self.names), self.num_layers)
        out: dict[str, float] = {}
        for k, name in enumerate(self.names):
            layers = losses[:, k].sum(0) if name in _TP_SUMMED else losses[:, k].mean(0)
            layers = layers / max(microbatches, 1)
            out[name] = float(layers.sum()) / self.moe_layers
            if self.per_layer:
                out.update({f"moe/{name}_layer_{i}": float(v) for i, v in enumerate(layers)})
        return out

    @staticmethod
    def _update_biases(counts: torch.Tensor, model: torch.nn.Module, rate: float) -> None:
        """megatron-core's get_updated_expert_bias, on the iteration's global counts."""
        with torch.no_grad():
            for router in routers_of(model):
                layer = counts[router.layer_number - 1].to(router.expert_bias.device)
                offset = layer.sum() / layer.numel() - layer
                router.expert_bias.add_(torch.sign(offset).float() * rate)


def router_report(config: TransformerConfig) -> RouterReport | None:
    """What a MoE model's routers report (None for a dense model, or one recording nothing)."""
    if not config.num_moe_experts:
        return None
    types = config.moe_router_load_balancing_type
    names = [name for kind, name in (("aux_loss", "load_balancing_loss"),
                                     ("seq_aux_loss", "seq_load_balancing_loss")) if kind in types]
    names += ["z_loss"] if config.moe_z_loss_coeff is not None else []
    bias = config.moe_router_bias_update_rate if config.moe_router_enable_expert_bias else None
    if not names and bias is None:
        return None
    freq = config.moe_layer_freq
    moe_layers = sum(1 for i in range(config.num_layers) if i % freq == 0) \
        if isinstance(freq, int) else sum(freq)
    return RouterReport(tuple(names), config.num_layers, moe_layers, config.moe_per_layer_logging,
                        config.num_moe_experts, bias)


class RouterMeter:
    """A `ForwardMeter` over megatron-core's tracker and this chunk's routers' token counts."""

    def __init__(self, report: RouterReport, chunk: torch.nn.Module, device: torch.device):
        self.report, self.device = report, device
        self.routers = routers_of(chunk) if report.bias_rate is not None else []

    def start(self) -> None:
        tracker = get_moe_layer_wise_logging_tracker()
        for name in self.report.names:
            if name in tracker:
                tracker[name]["values"].zero_()
        for router in self.routers:  # float32: counts stay exact (the cast model made it bf16)
            router.local_tokens_per_expert.data = torch.zeros_like(
                router.local_tokens_per_expert, dtype=torch.float32)

    def take(self) -> torch.Tensor:
        tracker, r = get_moe_layer_wise_logging_tracker(), self.report
        losses = [tracker[name]["values"].detach().double().reshape(-1) if name in tracker else
                  torch.zeros(r.num_layers, dtype=torch.float64, device=self.device)
                  for name in r.names]
        if r.bias_rate is None:
            return torch.cat(losses) if losses else torch.zeros(0, dtype=torch.float64)
        counts = torch.zeros(r.num_layers, r.experts, dtype=torch.float64, device=self.device)
        for router in self.routers:
            counts[router.layer_number - 1] = router.local_tokens_per_expert.double()
        hi = torch.floor(counts / _SPLIT)
        return torch.cat([*losses, hi.reshape(-1), (counts - hi * _SPLIT).reshape(-1)])
