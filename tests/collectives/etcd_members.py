"""Real etcd members for tests (`scripts/etcd_members.py`), and the mark that skips a test
without the etcd binary, with the reason."""
from __future__ import annotations

import pytest

from scripts.etcd_members import ETCD, EtcdMembers

needs_etcd = pytest.mark.skipif(ETCD is None, reason="needs the etcd binary (Debian: etcd-server)")

__all__ = ["EtcdMembers", "needs_etcd"]
