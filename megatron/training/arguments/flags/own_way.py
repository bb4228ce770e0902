"""Megatron-LM `pretrain_gpt.py` flags that ReCoVer takes although it does what they govern its
own way: the run starts, and a start-up line says what happens instead (`config.rules.own_way_lines`).

Each of these asks Megatron-LM to turn off a safety check, to build or skip process groups of its
own, or to move tensors in a way that ReCoVer's training loop has no place for. None of them can
change what ReCoVer computes, so refusing them would only make a working recipe fail."""
from __future__ import annotations

import argparse


def add_own_way_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("taken, done ReCoVer's way")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                   dest="check_for_nan_in_loss_and_grad",
                   help="Megatron-LM: stop checking for NaN. ReCoVer keeps the check that "
                        "--rerun-mode governs (a replica's non-finite loss is re-run on another "
                        "one; repeated, the run stops): a NaN of one replica must never be "
                        "committed by all. --rerun-mode disabled turns it off.")
    g.add_argument("--disable-gloo-process-groups", action="store_false",
                   dest="use_gloo_process_groups",
                   help="Megatron-LM: build no gloo groups beside NCCL's. ReCoVer builds none of "
                        "Megatron-LM's gloo groups anyway (on a CPU, gloo is the training "
                        "backend itself).")
    g.add_argument("--async-ckpt-use-cpu-shm", action="store_true",
                   help="Megatron-LM: hand --async-save's host copy to its writer process through "
                        "shared memory. ReCoVer's writer is a thread of the training process, "
                        "which reads the host copy where it is.")
    g.add_argument("--test-mode", action="store_true",
                   help="Megatron-LM: in every attention forward, check that the q/k norm "
                        "weights agree over DP and TP. ReCoVer checks instead that all the "
                        "weights agree over the DP replicas after every iteration "
                        "(--check-weight-hash-across-dp-replicas-interval 1, unless given).")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="Megatron-LM: reduce gradients in bf16. ReCoVer reduces them in fp32, as "
                        "Megatron-LM does without the flag: its exact, order-independent "
                        "reduction sums fp32 (4 bytes per parameter on the wire, not 2).")
    _add_modelopt_builder_args(g)


def _add_modelopt_builder_args(g) -> None:
    """Two of NVIDIA ModelOpt's model-builder flags that a published pre-training recipe passes
    (examples/gptoss/02_train.sh). Megatron-LM's pretrain_gpt.py builds its model with
    ModelOpt's builder only to load a ModelOpt checkpoint or to distil from a teacher; that
    recipe does neither, so there they change nothing, as here. (ModelOpt's other flags are
    refused: `refused.reasons`.)"""
    g.add_argument("--export-force-local-attention", action="store_true",
                   help="ModelOpt's builder: local attention instead of transformer-engine's. "
                        "Changes nothing here, as in Megatron-LM without a ModelOpt checkpoint.")
    g.add_argument("--enable-gpt-oss", action="store_true",
                   help="ModelOpt's builder: GPT-OSS's YaRN rope settings. Changes nothing here, "
                        "as in Megatron-LM without a ModelOpt checkpoint.")
