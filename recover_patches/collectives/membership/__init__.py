"""A rank's view of the job's membership (`client.MembershipClient`), and what it reports to the
coordinator about the job (`job_reports`)."""
from recover_patches.collectives.membership.client import (EpochListener, MembershipClient,
                                                           ReconnectListener)

__all__ = ["EpochListener", "MembershipClient", "ReconnectListener"]
