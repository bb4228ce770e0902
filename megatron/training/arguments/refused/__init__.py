"""Every flag of Megatron-LM's current GPT parser that ReCoVer does not take, refused by name.

The facts -- each flag's name, dest, default and value count in Megatron-LM's parser, and the
commit they were read from -- are `megatron_lm_flags.json` (written by
`scripts/megatron/dump_flags.py` from a Megatron-LM checkout). What ReCoVer does with each flag is
decided here: a flag this parser declares is honoured (or says at start-up how it differs); every
other one is registered so that passing it stops the run with one line that says why and what to
do instead. `docs/megatron_flags.md` is the table of all of them (`scripts/megatron/flag_table.py`).
"""
from __future__ import annotations

import argparse
import json
import re
from functools import lru_cache
from pathlib import Path

from megatron.training.config.rules import GIVEN_AT_DEFAULT
from megatron.training.errors import ArgumentError
from megatron.training.arguments.refused.model import MODEL_FLAGS
from megatron.training.arguments.refused.reasons import (FAMILIES, GROUPS_NOT_FOR_PRETRAINING,
                                                          NOT_FOR_PRETRAINING, Refusal, not_yet)
from megatron.training.arguments.refused.run import RUN_FLAGS

FACTS = Path(__file__).with_name("megatron_lm_flags.json")

SINGLE_FLAGS: dict[str, Refusal] = {**MODEL_FLAGS, **RUN_FLAGS}
# what a flag no family and no entry covers gets (the flag-table test keeps this set empty)
UNCLASSIFIED = not_yet("is not supported yet")


@lru_cache(maxsize=1)
def megatron_flags() -> dict:
    """The facts file: {"commit": ..., "flags": [{"flags", "dest", "default", "nargs", "group"}]}."""
    return json.loads(FACTS.read_text())


def refusal_of(flag: str, group: str | None) -> Refusal:
    """Why ReCoVer refuses a Megatron-LM flag it does not declare."""
    if group in GROUPS_NOT_FOR_PRETRAINING:
        return Refusal(NOT_FOR_PRETRAINING, GROUPS_NOT_FOR_PRETRAINING[group])
    name = flag.removeprefix("--")
    positive = re.sub(r"^(no|disable)-", "", name)  # --no-X / --disable-X: X's family
    for pattern, refusal in FAMILIES:
        if re.match(pattern, name) or re.match(pattern, positive):
            return refusal
    return SINGLE_FLAGS.get(flag, UNCLASSIFIED)


def refusal_message(flag: str, refusal: Refusal) -> tuple[str, str, str]:
    """(flag, message, fix) of the one line a refused flag stops the run with."""
    said = "not supported" in refusal.why
    return flag, f"{flag} {refusal.why}" + ("" if said else f" ({refusal.kind})"), refusal.fix


def is_megatrons_default(values: list[str], default) -> bool:
    """Whether a flag's command-line values are the value Megatron-LM takes when it is left out
    (compared as Megatron's parser would convert them: numbers as numbers, lists item by item)."""
    wanted = default if isinstance(default, list) else [default]
    return default is not None and len(values) == len(wanted) \
        and all(_same_value(text, item) for text, item in zip(values, wanted))


def _same_value(text: str, default) -> bool:
    if isinstance(default, bool):
        return text.lower() in ("true", "1") if default else text.lower() in ("false", "0")
    if isinstance(default, (int, float)):
        try:
            return float(text) == float(default)
        except ValueError:
            return False
    return text == str(default)


class _RefuseMegatronFlag(argparse.Action):
    def __init__(self, option_strings, dest, refusal: Refusal, megatron_default=None,
                 **kwargs) -> None:
        self.refusal, self.megatron_default = refusal, megatron_default
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        flag = option_string or self.option_strings[0]
        if self.nargs != 0 and is_megatrons_default(values, self.megatron_default):
            # what Megatron-LM does without the flag: the feature stays off, nothing to refuse
            setattr(namespace, self.dest, (flag, " ".join(values)))
            return
        raise ArgumentError(*refusal_message(flag, self.refusal))


def add_megatron_refusals(parser: argparse.ArgumentParser) -> None:
    """Register every Megatron-LM flag the parser does not declare, refused with its reason
    unless it is given Megatron-LM's own default value (then accepted, said at start-up)."""
    declared = parser._option_string_actions
    for row in megatron_flags()["flags"]:
        for flag in row["flags"]:
            if flag in declared:
                continue
            parser.add_argument(flag, nargs=0 if row["nargs"] == 0 else "*",
                                action=_RefuseMegatronFlag,
                                refusal=refusal_of(flag, row["group"]),
                                megatron_default=row["default"],
                                dest=f"{GIVEN_AT_DEFAULT}{row['dest']}",
                                default=argparse.SUPPRESS, help=argparse.SUPPRESS)
