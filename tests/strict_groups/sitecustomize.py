"""Test-only: loaded at interpreter start when this directory is on PYTHONPATH.

With RECOVER_STRICT_GROUPS=1 it installs `strict_groups_harness` (see there): once bootstrap is
over, any collective or p2p operation that reaches a plain torch ProcessGroup raises. Processes
forked from this interpreter (the launcher's ranks) inherit the patches.
"""
import os

if os.environ.get("RECOVER_STRICT_GROUPS") == "1":
    import strict_groups_harness

    strict_groups_harness.install()
