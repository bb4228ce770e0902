"""Every flag of Megatron-LM's GPT parser (the facts file, read from its source at one commit) is
known here: honoured with Megatron's dest and default unless a row says why not, or refused by
name with a reason of its own; and docs/megatron_flags.md is the table of all of them."""
from __future__ import annotations

import argparse
import json
import re

import pytest

from megatron.training.arguments import build_parser, parse_and_validate
from megatron.training.arguments.refused import (FACTS, UNCLASSIFIED, is_megatrons_default,
                                                  megatron_flags, refusal_of)
from megatron.training.config.rules import megatron_differences
from megatron.training.config import StepConfig
from megatron.training.tools.flag_table import DIFFERENCES, OWN_WAY, REFUSED_BY_THE_CHECKS, flag_table
from tests._launch_util import REPO, TINY_GPT

PARSER = build_parser()
ROWS = megatron_flags()["flags"]


def _refused(action: argparse.Action) -> bool:
    return action.default is argparse.SUPPRESS


def _same_default(ours, theirs) -> bool:
    if isinstance(theirs, str) and theirs.startswith("<") and "." in theirs:
        theirs = theirs.split(".")[1].split(":")[0]  # an enum member's repr: its name
    return ours == theirs


def test_the_facts_name_their_source():
    facts = json.loads(FACTS.read_text())
    assert re.fullmatch(r"[0-9a-f]{40}", facts["commit"]) and "Megatron-LM" in facts["source"]
    assert len(ROWS) > 800 and all(r["flags"] and r["dest"] for r in ROWS)


def unknown_flags(parser: argparse.ArgumentParser) -> list[str]:
    return [f for r in ROWS for f in r["flags"] if f not in parser._option_string_actions]


def test_every_megatron_flag_is_known_here():
    assert not unknown_flags(PARSER), unknown_flags(PARSER)


def test_the_check_sees_flags_nobody_registered(monkeypatch):
    """Negative control: without the registered refusals most of Megatron-LM's flags are
    unknown to this parser, and the check above names them."""
    from megatron.training import arguments
    monkeypatch.setattr(arguments, "add_megatron_refusals", lambda parser: None)
    unknown = unknown_flags(arguments.build_parser())
    assert "--moe-enable-deepep" in unknown and "--dist-ckpt-optim-fully-reshardable" not in unknown


def test_every_refused_flag_has_a_reason_of_its_own():
    fallback = [f for r in ROWS for f in r["flags"]
                if getattr(PARSER._option_string_actions[f], "refusal", None) is not None
                and refusal_of(f, r["group"]) is UNCLASSIFIED]
    assert not fallback, f"refused only as 'not supported yet': {fallback}"


def test_honoured_flags_keep_megatrons_dest_and_default_or_say_why():
    unexplained = []
    for r in ROWS:
        action = PARSER._option_string_actions[r["flags"][0]]
        if _refused(action) or r["flags"][0] in {**DIFFERENCES, **REFUSED_BY_THE_CHECKS}:
            continue
        if action.dest != r["dest"] or not _same_default(action.default, r["default"]):
            unexplained.append((r["flags"][0], action.dest, action.default, r["dest"],
                                r["default"]))
    assert not unexplained, unexplained
    stale = [f for f in DIFFERENCES if f not in PARSER._option_string_actions]
    assert not stale, stale


@pytest.mark.parametrize("row", [r for r in ROWS if _refused(
    PARSER._option_string_actions[r["flags"][0]])], ids=lambda r: r["flags"][0])
def test_a_refused_flag_stops_the_run_with_one_line_naming_it(row, capsys):
    flag = row["flags"][0]
    value = [] if row["nargs"] == 0 else ["2" if is_megatrons_default(["1"], row["default"])
                                          else "1"]  # any value but Megatron's default
    with pytest.raises(SystemExit) as exit_info:
        parse_and_validate([*TINY_GPT, "--train-iters", "2", flag, *value], world_size=1)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: {flag}: {flag} " in err and "Fix: " in err, err


@pytest.mark.parametrize("given", [["--softmax-type", "vanilla"],
                                   ["--query-in-block-prob", "0.10"], ["--cuda-graph-impl", "none"],
                                   ["--exit-signal", "15"]])
def test_a_refused_flag_given_megatrons_default_is_accepted_and_said(given):
    """Megatron-LM without the flag does the same: nothing to refuse, one start-up line."""
    args = parse_and_validate([*TINY_GPT, "--train-iters", "2", *given], world_size=1)
    said = [line for line in megatron_differences(args, "cpu") if line.startswith(given[0])]
    assert said == [f"{' '.join(given)} is Megatron-LM's default: accepted, it changes nothing "
                    "(any other value is refused)"]


@pytest.mark.parametrize("given", [["--softmax-type", "off-by-one"], ["--cp-comm-type", "ring"],
                                   ["--cp-comm-type", "p2p", "a2a"], ["--query-in-block-prob", "0.4"],
                                   ["--query-in-block-prob", "half"], ["--moe-enable-deepep"]])
def test_any_other_value_of_a_refused_flag_stops_the_run(given, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_and_validate([*TINY_GPT, "--train-iters", "2", *given], world_size=1)
    assert exit_info.value.code == 2 and f"error: {given[0]}: {given[0]} " in capsys.readouterr().err


@pytest.mark.parametrize("flag", sorted(OWN_WAY))
def test_a_flag_done_recovers_way_starts_the_run_and_says_what_happens_instead(flag):
    args = parse_and_validate([*TINY_GPT, "--train-iters", "2", flag], world_size=1)
    said = [line for line in megatron_differences(args, "cpu") if line.startswith(flag)]
    assert len(said) == 1, said


@pytest.mark.parametrize("given", [["--export-te-mcore-model"],
                                   ["--export-kd-teacher-load", "/teacher"]])
def test_modelopts_flags_are_refused_as_modelopts(given, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_and_validate([*TINY_GPT, "--train-iters", "2", *given], world_size=1)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "NVIDIA Model Optimizer" in err and given[0] in err, err


def test_modelopts_builder_flags_of_a_pretraining_recipe_change_nothing_and_say_so():
    """examples/gptoss/02_train.sh passes them to a run with no ModelOpt checkpoint or teacher,
    where Megatron-LM's pretrain_gpt.py does not build with ModelOpt's builder."""
    flags = ["--export-force-local-attention", "--enable-gpt-oss"]
    args = parse_and_validate([*TINY_GPT, "--train-iters", "2", *flags], world_size=1)
    said = [line for line in megatron_differences(args, "cpu") if "ModelOpt" in line]
    assert [line.split()[0] for line in said] == flags


def test_test_mode_compares_the_weights_over_the_replicas_every_iteration():
    """Megatron-LM's --test-mode checks that the q/k norm weights agree in every forward;
    ReCoVer's equivalent is its weight check at interval 1 (an interval given still wins)."""
    def interval(*flags: str) -> int:
        args = parse_and_validate([*TINY_GPT, "--train-iters", "2", *flags], world_size=1)
        return StepConfig.from_args(args, recovering=True).weight_check_interval
    assert (interval(), interval("--test-mode")) == (0, 1)
    assert interval("--test-mode", "--check-weight-hash-across-dp-replicas-interval", "5") == 5


def test_the_flag_table_is_current():
    written = (REPO / "docs" / "megatron_flags.md").read_text()
    assert written == flag_table(), \
        "regenerate: python -m megatron.training.tools.flag_table > docs/megatron_flags.md"


def test_the_readme_counts_the_flags_as_the_table_does():
    statuses = [line.rsplit(" | ", 2)[1] for line in flag_table().splitlines()
                if line.startswith("| `--")]
    accepted = sum(s.startswith("accepted") for s in statuses)
    refused = sum(s.startswith("refused") for s in statuses)
    readme = " ".join((REPO / "README.md").read_text().split())
    assert (f"Of Megatron-LM's {len(statuses)} GPT flags" in readme
            and f"{statuses.count('honoured')} are honoured, {accepted} are accepted" in readme
            and f"and {refused} are refused" in readme), "update the README's counts"
