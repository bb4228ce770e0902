"""ReCoVer's step: one replica's part of an iteration (`replica.GPTReplicaStep`), and what
the iteration transaction asks of it: the commit vote, the exact reduction, the execute clock,
the weight check across replicas, and the state a joining replica is sent."""
