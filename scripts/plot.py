"""matplotlib for the scripts that draw curves; it is the `plot` extra, so a missing install is one
line naming the extra instead of an ImportError traceback."""
from __future__ import annotations

import sys
from types import ModuleType


def pyplot() -> ModuleType:
    """matplotlib.pyplot on the file-only Agg backend; exits 2 with one line when not installed."""
    try:
        import matplotlib
    except ImportError:
        print("error: plotting needs matplotlib: pip install 'recover[plot]' (or matplotlib)",
              file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
