"""Short name for the membership coordinator: ``python -m recover_patches.coordinator ...``.

The coordinator lives in `recover_patches.collectives.coordinator` (layer 1); this module only
forwards to its command line, so the documented short command and the real one never diverge.
Usually the launcher on node 0 starts the coordinator itself; run it by hand only when it must
live elsewhere, then point every launcher at it with RECOVER_COORDINATOR=host:port.
"""
from __future__ import annotations

import sys

from recover_patches.collectives.coordinator import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
