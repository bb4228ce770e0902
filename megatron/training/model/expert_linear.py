"""The second linear layer of a mixture-of-experts expert, as megatron-core's local spec builds it
(a RowParallelLinear), made safe for the expert MLP's bias.

megatron-core's `MLP.forward` adds an expert's output bias, scaled by the routing probabilities,
in place into the output of `linear_fc2`. Without expert or tensor parallelism that output is what
the reduction over a one-rank group returns: its input as-is, through a custom autograd Function,
and autograd refuses to let such an output change in place ("Output 0 of
_ReduceFromModelParallelRegion is a view and is being modified inplace"). With expert or tensor
parallelism megatron-core skips that reduction, so only EP 1 at TP 1 met it.
"""
from __future__ import annotations

from megatron.core.tensor_parallel.layers import RowParallelLinear


class ExpertOutputLinear(RowParallelLinear):
    """RowParallelLinear returning a copy of its output where the expert MLP would change the
    reduction's own output in place: a bias to add and the one-rank reduction taken."""

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        if bias is not None and not self.explicit_expert_comm:
            output = output.clone()
        return output, bias
