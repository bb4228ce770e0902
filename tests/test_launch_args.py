"""The launcher's etcd rendezvous flags, checked before anything starts: torchrun's names,
each refusal one message naming the flag and the fix (the launcher exits 2 with it)."""
from __future__ import annotations

import pytest

from recover_patches.launch_args import LaunchUsageError, build_parser, lease_ttl, validate
from tests._launch_util import REPO

SCRIPT = str(REPO / "pretrain_gpt_recover.py")
ETCD = ["--nproc-per-node", "1", "--nnodes", "2", "--job-token", "t", "--rdzv-backend", "etcd",
        "--rdzv-endpoint", "h1:2379,h2,h3:2380", "--rdzv-id", "job7"]


def checked(*flags: str):
    args = build_parser().parse_args([*flags, SCRIPT])
    validate(args)
    return args


def test_an_etcd_rendezvous_needs_no_coordinator_port_and_takes_torchruns_spellings():
    args = checked(*ETCD)  # several nodes, --coordinator-port 0: each node picks its own port
    assert lease_ttl(args) == 5
    underscored = checked("--nproc_per_node", "1", "--rdzv_backend", "etcd", "--rdzv_endpoint",
                          "h1", "--rdzv_id", "j", "--rdzv_conf", "lease_ttl=2", "--local_addr",
                          "10.0.0.2")
    assert lease_ttl(underscored) == 2 and underscored.local_addr == "10.0.0.2"
    # a standby node finds the coordinator through etcd: no port, but still the job's token
    assert checked(*ETCD, "--node-rank", "2", "--standby").standby
    with pytest.raises(LaunchUsageError, match="--job-token"):
        checked(*[f for f in ETCD if f not in ("--job-token", "t")], "--standby")


@pytest.mark.parametrize("change, needle", [
    ({"--rdzv-endpoint": ""}, "--rdzv-endpoint ''"),
    ({"--rdzv-endpoint": "h1:2379,h1:2379"}, "names a member twice"),
    ({"--rdzv-endpoint": "h1:port"}, "is not host[:port]"),
    ({"--rdzv-id": "none"}, "needs --rdzv-id"),
    ({"--rdzv-conf": "timeout=30"}, "--rdzv-conf timeout"),
    ({"--rdzv-conf": "lease_ttl=0"}, "lease_ttl=0"),
    ({"--no-coordinator": None}, "drop --no-coordinator"),
])
def test_a_bad_etcd_rendezvous_is_refused_by_name(change, needle):
    flags = list(ETCD)
    for flag, value in change.items():
        if flag in flags:
            flags[flags.index(flag) + 1] = value
        else:
            flags += [flag] if value is None else [flag, value]
    with pytest.raises(LaunchUsageError) as refused:
        checked(*flags)
    assert needle in str(refused.value)


def test_the_static_rendezvous_still_needs_a_shared_coordinator_port_on_several_nodes():
    with pytest.raises(LaunchUsageError, match="--coordinator-port"):
        checked("--nproc-per-node", "1", "--nnodes", "2", "--job-token", "t")


def test_the_scripts_recover_timeout_is_read_past_flags_it_abbreviates(tmp_path):
    from recover_patches.launch_args import script_recover_timeout
    script = tmp_path / "train.py"
    script.write_text("")

    def parse(*rest: str) -> float:
        return script_recover_timeout(build_parser().parse_args(
            ["--nproc-per-node", "1", str(script), *rest]))
    assert parse("--recover", "off", "--lr", "1") == 10.0  # `--recover` is not an abbreviation
    assert parse("--recover", "off", "--recover-timeout", "3") == 3.0
    assert parse("--recover-timeout", "3") == 3.0 and parse("--recover_timeout", "4") == 4.0
    assert parse("--recover-timeout", "soon") == 10.0  # (the script refuses it by name)
