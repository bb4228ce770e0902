"""--verify-integrity: a torch_dist save writes Megatron's SHA-256 manifest (integrity.json);
a load checks every file against it and stops in one line naming the flag and the file. One
process (the ranks' split of the hashing is the same code with a share of one)."""
from __future__ import annotations

import hashlib
import json

import pytest

from megatron.training.checkpointing.files import integrity_failure
from megatron.training.checkpointing import CheckpointError, Checkpointer
from megatron.training.config.io import CheckpointConfig
from tests.test_checkpoint_dist import GPTTrainer, make_args, run


@pytest.fixture(scope="module", autouse=True)
def _one_rank(one_rank_group):
    yield


def load(tmp_path, *flags: str) -> GPTTrainer:
    args = make_args(tmp_path, "--load", str(tmp_path / "ck"), *flags)
    trainer = GPTTrainer(args)
    Checkpointer(CheckpointConfig.from_args(args), 0, 1).load(trainer)
    return trainer


def test_the_manifest_is_megatrons_and_a_changed_file_stops_the_load(tmp_path):
    args = make_args(tmp_path, "--verify-integrity")
    run(GPTTrainer(args), Checkpointer(CheckpointConfig.from_args(args), 0, 1), 2)
    directory = tmp_path / "ck" / "iter_0000002"
    manifest = json.loads((directory / "integrity.json").read_text())
    assert manifest["algorithm"] == "sha256"
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "common.pt",
                                         "metadata.json"]
    shard = directory / "__0_0.distcp"
    assert manifest["files"]["__0_0.distcp"] == hashlib.sha256(shard.read_bytes()).hexdigest()
    assert load(tmp_path, "--verify-integrity").state.iteration == 2

    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, so DCP's own checks pass
    shard.write_bytes(bytes(data))
    assert integrity_failure(directory, (0, 2)) is None  # that share holds other files
    with pytest.raises(CheckpointError) as err:
        load(tmp_path, "--verify-integrity")
    assert err.value.flag == "--verify-integrity"
    assert "__0_0.distcp does not match its hash in integrity.json" in str(err.value)
    load(tmp_path)  # negative control: without the flag nothing looks


def test_a_checkpoint_without_a_manifest_is_refused_when_verifying(tmp_path):
    args = make_args(tmp_path)
    run(GPTTrainer(args), Checkpointer(CheckpointConfig.from_args(args), 0, 1), 2)
    assert not (tmp_path / "ck" / "iter_0000002" / "integrity.json").exists()
    with pytest.raises(CheckpointError, match="no readable integrity.json"):
        load(tmp_path, "--verify-integrity")


def test_the_torch_format_with_verification_is_one_line_and_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        make_args(tmp_path, "--verify-integrity", "--ckpt-format", "torch")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith(
        "pretrain_gpt_recover.py: error: --verify-integrity: --verify-integrity needs --ckpt-format")
