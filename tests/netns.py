"""Network-namespace hosts for tests (`scripts/hosts.py`), and the mark that skips a test where
they cannot be made."""
from __future__ import annotations

import pytest

from scripts.hosts import Hosts, available

needs_netns = pytest.mark.skipif(not available(),
                                 reason="needs root and iproute2 (network namespaces)")

__all__ = ["Hosts", "needs_netns"]
