"""tests/extended.py names only tests that exist, so the set CI leaves out cannot rot into names
that select nothing (or silently drop a renamed test from both sets)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.extended import FIRST_VARIANT_ONLY, WHOLE, base_of, extended

REPO = Path(__file__).resolve().parents[1]


def collected() -> list[str]:
    files = sorted({name.split("::")[0] for name in (*WHOLE, *FIRST_VARIANT_ONLY)})
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", *files], cwd=REPO, capture_output=True,
                         text=True, timeout=240)
    return [line.strip() for line in out.stdout.splitlines() if "::" in line]


def test_every_listed_name_is_collected_and_ci_keeps_a_variant_of_each_parametrized_test():
    nodeids = collected()
    bases = {base_of(n) for n in nodeids}
    assert not set(WHOLE) - bases and not set(FIRST_VARIANT_ONLY) - bases, \
        sorted(set(WHOLE) - bases) + sorted(set(FIRST_VARIANT_ONLY) - bases)
    chosen = extended(nodeids)
    for base in FIRST_VARIANT_ONLY:
        variants = [n for n in nodeids if base_of(n) == base]
        assert len(variants) >= 2, f"{base}: not parametrized: list it in WHOLE"
        assert variants[0] not in chosen and set(variants[1:]) <= chosen


def test_the_first_collected_variant_stays_in_ci_and_whole_tests_leave(monkeypatch):
    from tests import extended as module
    monkeypatch.setattr(module, "FIRST_VARIANT_ONLY", ("a.py::t",))
    monkeypatch.setattr(module, "WHOLE", ("b.py::u",))
    ids = ["a.py::t[y]", "a.py::t[x]", "b.py::u[1]", "b.py::u[2]", "c.py::v", "a.py::t[z]"]
    assert module.extended(ids) == {"a.py::t[x]", "a.py::t[z]", "b.py::u[1]", "b.py::u[2]"}
