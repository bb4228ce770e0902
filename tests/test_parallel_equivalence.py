"""The proof that schedule, p2p, DP reduction, loss normalisation and clipping are right: every
(TP, PP, DP) layout trains the tiny GPT along the single-process trajectory -- in fp32 within
reduction-order noise, in bf16 and fp16 within their rounding (see TOLERANCE)."""
from __future__ import annotations

import pytest

from tests._launch_util import TINY_GPT, launch

pytestmark = pytest.mark.multiprocess  # every test here starts several processes

ITERS = ["--train-iters", "6"]
LAYOUTS = [(2, 1, 2), (1, 2, 2), (2, 2, 1), (1, 2, 4)]  # (TP, PP, DP)
PRECISIONS = {"fp32": [], "bf16": ["--bf16"],
              # a scale that does not overflow on this model: every layout takes every step
              "fp16": ["--fp16", "--initial-loss-scale", "256"]}
# Relative loss tolerance against the single-process run of the same precision. fp32: reduction
# order only. bf16/fp16: a TP split changes the order of matmul reductions in half precision
# (bf16 keeps 8 mantissa bits, fp16 11) and a PP/DP split the fp32 accumulation order, so a
# half-precision weight can round the other way. Measured over these 6 iterations: at most 5.5e-5
# (bf16, TP 2) and 8.7e-6 (fp16); the tolerances are about 10x that.
TOLERANCE = {"fp32": 1e-5, "bf16": 5e-4, "fp16": 1e-4}


def _train(tmp_path_factory, precision: str, tp: int, pp: int, dp: int, *extra: str):
    out = tmp_path_factory.mktemp(f"{precision}-tp{tp}pp{pp}dp{dp}")
    run = launch(tp * pp * dp, [*TINY_GPT, *ITERS, *PRECISIONS[precision], *extra,
                                "--tensor-model-parallel-size", str(tp),
                                "--pipeline-model-parallel-size", str(pp)], out / "metrics.jsonl")
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.losses()) == 6, run.stdout[-2000:]
    return run


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return {}


def reference(references, tmp_path_factory, precision: str):
    if precision not in references:
        references[precision] = _train(tmp_path_factory, precision, 1, 1, 1)
    return references[precision]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def assert_same_trajectory(run, ref, precision: str, dp: int) -> None:
    # the reference must actually learn and clip, or equality would prove little
    assert ref.records[-1]["lm_loss"] < ref.records[0]["lm_loss"]
    assert any(r["grad_norm"] > 1.0 for r in ref.records), "clipping never engaged in the reference"
    tol = TOLERANCE[precision]
    for mine, theirs in zip(run.records, ref.records):
        assert mine["microbatches"] == theirs["microbatches"] == 8
        assert mine["tokens"] == theirs["tokens"]
        assert mine["skipped_iterations"] == theirs["skipped_iterations"] == 0
        assert _rel(mine["lm_loss"], theirs["lm_loss"]) <= tol, (mine, theirs)
        assert _rel(mine["grad_norm"], theirs["grad_norm"]) <= 10 * tol, (mine, theirs)
    assert {int(r) for r in run.records[0]["quotas"]} == set(range(dp))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("tp,pp,dp", LAYOUTS, ids=[f"tp{t}-pp{p}-dp{d}" for t, p, d in LAYOUTS])
def test_layout_matches_single_process(references, tmp_path_factory, precision, tp, pp, dp):
    ref = reference(references, tmp_path_factory, precision)
    assert_same_trajectory(_train(tmp_path_factory, precision, tp, pp, dp), ref, precision, dp)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_sequence_parallel_matches_single_process(references, tmp_path_factory, precision):
    ref = reference(references, tmp_path_factory, precision)
    run = _train(tmp_path_factory, precision, 2, 2, 1, "--sequence-parallel", "--qk-layernorm")
    ref_qk = _train(tmp_path_factory, precision, 1, 1, 1, "--qk-layernorm")
    assert_same_trajectory(run, ref_qk, precision, 1)
    assert ref_qk.losses() != ref.losses()  # --qk-layernorm really changed the model


@pytest.mark.timeout(600)
def test_overlapped_bucket_reduction_matches(references, tmp_path_factory):
    """--overlap-grad-reduce with many small buckets: the same gradients as one bucket."""
    ref = reference(references, tmp_path_factory, "fp32")
    run = _train(tmp_path_factory, "fp32", 1, 2, 2, "--overlap-grad-reduce",
                 "--ddp-bucket-size", "20000")
    assert "bytes per parameter" in run.stdout
    assert_same_trajectory(run, ref, "fp32", 2)


@pytest.mark.timeout(600)
def test_tp_pp_dp_mapping_matches(references, tmp_path_factory):
    """--use-tp-pp-dp-mapping reorders the ranks of (2,2,2): the same trajectory."""
    ref = reference(references, tmp_path_factory, "fp32")
    run = _train(tmp_path_factory, "fp32", 2, 2, 2, "--use-tp-pp-dp-mapping")
    assert_same_trajectory(run, ref, "fp32", 2)


MODEL_FLAGS = ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
               "--group-query-attention", "--num-query-groups", "2",
               "--position-embedding-type", "rope", "--rotary-percent", "0.5", "--rotary-base", "500",
               "--reset-attention-mask", "--reset-position-ids", "--attention-backend", "unfused"]


@pytest.mark.timeout(600)
def test_model_flags_keep_layouts_equivalent(tmp_path_factory):
    """The Llama-style flags through TP and PP: a TP split of a gated MLP or of grouped K/V heads
    must shard the same function (a wrong fc1 layout moved the first loss by 4e-4)."""
    single = _train(tmp_path_factory, "fp32", 1, 1, 1, *MODEL_FLAGS)
    split = _train(tmp_path_factory, "fp32", 2, 2, 1, *MODEL_FLAGS)
    assert_same_trajectory(split, single, "fp32", 1)


DIST_OPT = [(1, 1, 4, 1, "fp32", False), (1, 1, 4, 2, "fp32", False), (1, 2, 2, 1, "fp32", False),
            (1, 2, 2, 2, "fp32", False), (1, 1, 4, 2, "bf16", False), (1, 2, 2, 1, "fp32", True)]
OVERLAPPED = ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "20000"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tp,pp,dp,k,precision,overlap", DIST_OPT,
                         ids=[f"tp{t}-pp{p}-dp{d}-k{k}-{x}" + ("-overlap" if o else "")
                              for t, p, d, k, x, o in DIST_OPT])
def test_distributed_optimizer_matches_single_process(references, tmp_path_factory, tp, pp, dp, k,
                                                      precision, overlap):
    """--use-distributed-optimizer shards Adam over DP / K replicas: the same trajectory, and
    the replicas' weights compared every iteration stay bitwise identical (else status 3). With
    --overlap-param-gather (several buckets, the tied embedding in its own) each module's forward
    waits for its bucket's all-gather."""
    ref = reference(references, tmp_path_factory, precision)
    run = _train(tmp_path_factory, precision, tp, pp, dp, "--use-distributed-optimizer",
                 "--num-distributed-optimizer-instances", str(k),
                 "--check-weight-hash-across-dp-replicas-interval", "1",
                 *(OVERLAPPED if overlap else []))
    # the start-up memory line says whether it sharded (K = DP: one replica per instance)
    assert (f"over {dp // k} shards" in run.stdout) == (dp // k > 1)
    assert_same_trajectory(run, ref, precision, dp)
