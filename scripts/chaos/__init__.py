"""The chaos harness (`python scripts/chaos.py`): a ReCoVer job over several launchers on this
machine, seeded random faults at random points of its work, restarts from checkpoints when a
fault leaves no complete copy, and the verdict against the failure-free run.

`plan` draws the faults, `cluster` starts and watches the launchers of one launch, `launches`
runs them until the job completes (restarting as SLURM's --requeue would), `verdict` compares
and measures, `run` is the command line."""
