"""Which of Megatron-LM's own GPT pre-training jobs start under pretrain_gpt_recover.py: every
`tests/functional_tests/test_cases/gpt/*/model_config.yaml` of a Megatron-LM checkout (those
without MODE inference or rl), its MODEL_ARGS given to ReCoVer's argument checks as on a GPU node
of 8 ranks with transformer-engine installed. Prints the count that pass and, for the others,
the one line each is refused with, grouped by the flag it names.

    python scripts/megatron/survey_functional_tests.py /path/to/Megatron-LM [--verbose]

Only the command line is checked (the data and tokenizer files are stand-ins), so a job that
passes here may still stop later on its data; what it measures is the flags.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path
from unittest import mock

import yaml
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
FILE_FLAGS = re.compile(r"--(vocab-file|merge-file|tokenizer-model|data-args-path|"
                        r"per-split-data-args-path)$")


def command_line(model_args: dict, scratch: Path) -> list[str]:
    """MODEL_ARGS as Megatron-LM's launcher turns them into flags, ${...} pointing into scratch,
    the files a check opens made (empty). A string with spaces is one value for a flag that
    takes one (--step-batch-size-schedule "0:384 200B:768"), else several (--data-path A B)."""
    from megatron.training.arguments import build_parser
    actions = build_parser()._option_string_actions
    argv: list[str] = []
    for flag, value in model_args.items():
        if value is True or value == "true":
            argv.append(flag)
            continue
        if value is False or value == "false" or value is None:
            continue
        action = actions.get(flag)
        one = action is not None and action.nargs is None
        text = str(value).strip("[]") if isinstance(value, str) else value  # "[2 2]": 2 2
        raw = value if isinstance(value, list) else [str(text)] if one else str(text).split()
        # ${VAR}: a path in scratch, or 1 where the flag takes a number (--seed ${REPEAT})
        number = action is not None and action.type in (int, float)
        values = [re.sub(r"\$\{(\w+)\}", lambda m: "1" if number else
                         str(scratch / m.group(1).lower()), str(v)) for v in raw]
        if FILE_FLAGS.match(flag):
            for path in values:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                Path(path).touch()
        argv += [flag, *values]
    return argv


def verdict(argv: list[str], world_size: int) -> str | None:
    """None when the checks pass; else the one line they print."""
    from megatron.training.arguments import parse_and_validate
    real_find_spec = importlib.util.find_spec

    def with_transformer_engine(name, *args, **kwargs):  # a GPU node's install
        if name == "transformer_engine":
            return importlib.machinery.ModuleSpec(name, None)
        return real_find_spec(name, *args, **kwargs)
    err = io.StringIO()
    # started by ReCoVer's launcher, as the README starts a job (its coordinator's address)
    with mock.patch.dict(os.environ, {"RECOVER_COORDINATOR": "127.0.0.1:29400"}), \
            mock.patch("importlib.util.find_spec", with_transformer_engine), \
            contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parse_and_validate(argv, world_size=world_size, device="cuda")
        except SystemExit:
            return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "exit"
    return None


def pretraining_configs(checkout: Path) -> list[tuple[str, dict]]:
    found = []
    for path in sorted((checkout / "tests/functional_tests/test_cases/gpt").glob("*/model_config.yaml")):
        config = yaml.safe_load(path.read_text())
        if str(config.get("MODE", "pretraining")).lower() in ("inference", "rl"):
            continue
        found.append((path.parent.name, config.get("MODEL_ARGS") or {}))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="a Megatron-LM checkout")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--verbose", action="store_true", help="print each refused job's line")
    parser.add_argument("--local-layers", action="store_true",
                        help="give every job --transformer-impl local (megatron-core's local "
                             "layers) in place of transformer-engine's")
    options = parser.parse_args(argv)
    configs = pretraining_configs(options.checkout)
    refused: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, model_args in tqdm(configs, desc="jobs", unit="job"):
            args = command_line(model_args, Path(scratch))
            if options.local_layers:
                args += ["--transformer-impl", "local"]
            line = verdict(args, options.world_size)
            if line is not None:
                refused[name] = line
    print(f"{len(configs) - len(refused)} of {len(configs)} pre-training jobs pass ReCoVer's "
          f"argument checks ({options.world_size} ranks, a GPU with transformer-engine"
          f"{'; --transformer-impl local' if options.local_layers else ''})")
    named = Counter(m.group(1) if (m := re.search(r"error: (--[\w-]+)", line)) else line
                    for line in refused.values())
    for flag, count in named.most_common():
        print(f"{count:4d}  {flag}")
    if options.verbose:
        for name, line in sorted(refused.items()):
            print(f"{name}: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
