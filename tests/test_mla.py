"""Multi-latent attention (`--multi-latent-attention`): megatron-core's MLASelfAttention in the
GPT layers, its heads split over TP. DP 2 with a rank killed in its backward, PP 2 and TP 2 (with
and without sequence parallelism) keep one process's losses; what is not built yet (CP,
transformer-engine layers) is one line naming the flag."""
from __future__ import annotations

import math

import pytest
from megatron.core.transformer.transformer_config import MLATransformerConfig

from megatron.training.arguments import parse_and_validate
from megatron.training.checkpointing import LATEST_FILE
from megatron.training.config import ModelConfig, transformer_config
from megatron.training.config.rules import megatron_differences
from tests._launch_util import TINY_GPT, launch

ITERS = 4
MLA = ["--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--position-embedding-type", "rope",
       "--normalization", "RMSNorm"]
FLAGS = [*TINY_GPT, "--train-iters", str(ITERS), *MLA, "--recover-balance", "even"]
# the query latent, the latents' norms and yarn rope
LATENT = [*FLAGS, "--q-lora-rank", "24", "--qk-layernorm", "--rope-type", "yarn",
          "--rotary-scaling-factor", "4"]


def test_the_flags_build_megatron_cores_mla_config():
    args = parse_and_validate([*FLAGS, "--q-lora-rank", "24", "--rope-type", "yarn",
                               "--rotary-scaling-factor", "4", "--mscale", "0.7"], world_size=1)
    config = transformer_config(args)
    assert isinstance(config, MLATransformerConfig) and config.multi_latent_attention
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim,
            config.qk_pos_emb_head_dim, config.v_head_dim) == (24, 16, 16, 8, 16)
    assert (config.rope_type, config.rotary_scaling_factor, config.mscale) == ("yarn", 4.0, 0.7)
    plain = parse_and_validate([*TINY_GPT, "--train-iters", "2"], world_size=1)
    assert not isinstance(transformer_config(plain), MLATransformerConfig)
    # the latents' norms: whole on each TP rank (tests/test_tp_partial_grads.py)
    from megatron.training.model import LatentNorm, layer_spec
    normed = transformer_config(parse_and_validate([*FLAGS, "--qk-layernorm", "--q-lora-rank",
                                                    "24"], world_size=1))
    attention = layer_spec("local", normed, None, 0).layer_specs[0].submodules.self_attention
    assert attention.submodules.q_layernorm is attention.submodules.kv_layernorm is LatentNorm


@pytest.mark.parametrize("given, said", [
    (["--tensor-model-parallel-size", "2", "--kv-lora-rank", "15"], "= 23 does not split over"),
    (["--group-query-attention", "--num-query-groups", "2"], "shares its keys and values through a latent"),
    (["--attention-output-gate"], "not supported by megatron-core's MLA"),
    (["--qk-l2-norm"], "not supported by megatron-core's MLA")])
def test_what_mla_does_not_take_yet_is_one_line(given, said, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_and_validate([*FLAGS, *given], world_size=2)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert "--multi-latent-attention" in err and said in err, err


def on_a_transformer_engine_node(flags: list[str]):
    """The flags validated, then resolved as on a GPU with transformer-engine installed."""
    args = parse_and_validate(flags, world_size=1)
    args.transformer_impl = "transformer_engine"
    return args


def test_a_transformer_engine_mla_recipe_runs_on_local_layers_and_says_so():
    args = on_a_transformer_engine_node(FLAGS)
    assert ModelConfig.from_args(args, 256).implementation == "local"
    said = [line for line in megatron_differences(args, "cuda")
            if line.startswith("--transformer-impl transformer_engine:")]
    assert len(said) == 1 and "multi-latent attention" in said[0], said
    plain = on_a_transformer_engine_node([*TINY_GPT, "--train-iters", "2"])
    assert ModelConfig.from_args(plain, 256).implementation == "transformer_engine"


def test_yarn_without_mla_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_and_validate([*TINY_GPT, "--train-iters", "2", "--rope-type", "yarn"],
                           world_size=1)
    assert "--rope-type yarn is for multi-latent attention" in capsys.readouterr().err


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_a_killed_mla_rank_keeps_one_process_losses(tmp_path):
    """The query projected directly (no --q-lora-rank: megatron-core builds that projection
    without its TP group, which ReCoVer's spec hands over). DP 2, rank 1 killed in a backward
    of iteration 2: replica 0 recomputes its microbatches in the same iteration. Also one
    process with the query latent, its norms and yarn rope trains (finite, falling losses), and
    TP 2 follows it, with and without sequence parallelism; PP 2 follows one process, and one
    process resumes from PP 2's checkpoint of iteration 2."""
    runs = [launch(1, FLAGS, tmp_path / "one.jsonl"),
            launch(2, [*FLAGS, "--recover-spares", "off",
                       "--inject-fault", "kill:rank=1,iter=2,phase=backward"],
                   tmp_path / "two.jsonl", launcher_args=[], timeout=240),
            launch(1, LATENT, tmp_path / "latent.jsonl"),
            launch(2, [*LATENT, "--tensor-model-parallel-size", "2"], tmp_path / "tp2.jsonl"),
            launch(2, [*LATENT, "--tensor-model-parallel-size", "2", "--sequence-parallel"],
                   tmp_path / "tp2_sp.jsonl"),
            launch(2, [*FLAGS, "--pipeline-model-parallel-size", "2", "--save",
                       str(tmp_path / "ckpt"), "--save-interval", "2"], tmp_path / "pp2.jsonl")]
    assert all(r.returncode == 0 for r in runs), runs[1].stdout[-3000:] + runs[1].stderr[-3000:]
    one, two, latent, tp2, tp2_sp, pp2 = ([r for r in run.records if "lm_loss" in r]
                                          for run in runs)
    for split in (tp2, tp2_sp):  # heads over TP; the latents whole, their norms not summed
        for mine, ref in zip(split, latent, strict=True):
            assert abs(mine["lm_loss"] - ref["lm_loss"]) <= 1e-5 * ref["lm_loss"], (mine, ref)
            assert abs(mine["grad_norm"] - ref["grad_norm"]) <= 1e-4 * ref["grad_norm"], (mine,
                                                                                       ref)
    for mine, ref in zip(pp2, one, strict=True):  # the layers split over two stages
        assert abs(mine["lm_loss"] - ref["lm_loss"]) <= 1e-5 * ref["lm_loss"], (mine, ref)
    (tmp_path / "ckpt" / LATEST_FILE).write_text("2")  # PP 2's checkpoint, read by one process
    resumed = launch(1, [*FLAGS, "--load", str(tmp_path / "ckpt")], tmp_path / "resumed.jsonl")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert all(abs(a - b["lm_loss"]) <= 1e-5 * b["lm_loss"]
               for a, b in zip(resumed.losses(), one[2:], strict=True)), resumed.losses()
    assert [r["live_replicas"] for r in two] == [[0, 1]] + [[0]] * (ITERS - 1)
    for mine, ref in zip(two, one, strict=True):
        assert mine["microbatches"] == 8, mine
        assert abs(mine["lm_loss"] - ref["lm_loss"]) <= 1e-5 * ref["lm_loss"], (mine, ref)
    losses = [r["lm_loss"] for r in latent]
    assert len(losses) == ITERS and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0], losses
