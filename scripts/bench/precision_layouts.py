"""How far half-precision runs of each (TP, PP, DP) layout land from the single-process run of the
same precision, and how far a bf16 run that loses a replica lands from its failure-free run (with
`drop` for contrast): the numbers the tolerances of tests/test_parallel_equivalence.py and
tests/test_mixed_precision.py rest on.

    python scripts/bench/precision_layouts.py          # about 2 minutes on 2 cores
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests._launch_util import TINY_GPT, launch  # noqa: E402
from tests.test_mixed_precision import BF16, KILL, train_records  # noqa: E402

PRECISIONS = {"bf16": ["--bf16"], "fp16": ["--fp16", "--initial-loss-scale", "256"]}
LAYOUTS = [(2, 1, 2), (1, 2, 2), (2, 2, 1), (1, 2, 4)]


def max_rel(run: list[float], ref: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(run, ref))


def main() -> None:
    out = Path(tempfile.mkdtemp(prefix="precision-layouts-"))
    print("layout (TP,PP,DP) | " + " | ".join(PRECISIONS))
    refs = {p: launch(1, [*TINY_GPT, "--train-iters", "6", *f], out / f"{p}.jsonl").losses()
            for p, f in PRECISIONS.items()}
    for tp, pp, dp in LAYOUTS:
        cells = []
        for precision, flags in PRECISIONS.items():
            run = launch(tp * pp * dp, [*TINY_GPT, "--train-iters", "6", *flags,
                                        "--tensor-model-parallel-size", str(tp),
                                        "--pipeline-model-parallel-size", str(pp)],
                         out / f"{precision}-{tp}{pp}{dp}.jsonl")
            cells.append(f"{max_rel(run.losses(), refs[precision]):.1e}")
        print(f"({tp},{pp},{dp}) | " + " | ".join(cells), flush=True)
    ref = [r["lm_loss"] for r in train_records(launch(4, BF16, out / "bf16-ref.jsonl",
                                                      launcher_args=[]))]
    for name, extra in (("recover", KILL), ("drop", [*KILL, "--recover-policy", "drop"])):
        run = launch(4, [*BF16, *extra], out / f"bf16-{name}.jsonl", launcher_args=[])
        print(f"bf16 (1,2,2), rank 3 killed in backward, {name}: max relative loss difference "
              f"{max_rel([r['lm_loss'] for r in train_records(run)], ref):.1e}", flush=True)


if __name__ == "__main__":
    main()
