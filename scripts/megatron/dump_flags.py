"""Write the facts file of Megatron-LM's GPT flags: every option of its current parser with its
dest, default, value count and argument group, and the commit it was read from.

    python scripts/megatron/dump_flags.py /path/to/Megatron-LM > megatron/training/arguments/refused/megatron_lm_flags.json

It imports Megatron-LM's own `megatron.training.arguments` from that checkout (its megatron.core
too) and asks its parser, so nothing is transcribed by hand. Kernels that need triton are stubbed
(they are imported, never run); Python 3.11 lacks typing.override, taken from typing_extensions.
"""
from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import subprocess
import sys
import typing
from pathlib import Path
from unittest import mock

import typing_extensions

SOURCE = ("NVIDIA/Megatron-LM megatron/training/arguments.py (add_megatron_arguments) and "
          "megatron/post_training/arguments.py (add_modelopt_args, which pretrain_gpt.py adds "
          "where NVIDIA ModelOpt is installed)")
# Modules that import triton at their top; the parser never calls into them.
_TRITON_KERNELS = ("megatron.core.transformer.moe.ops.paged_stash", "megatron.core.ssm.ops")


class _KernelStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.startswith(_TRITON_KERNELS):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = mock.MagicMock(name=spec.name)
        module.__path__, module.__spec__ = [], spec
        return module

    def exec_module(self, module):
        pass


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)


def megatron_parser(checkout: Path) -> argparse.ArgumentParser:
    sys.meta_path.insert(0, _KernelStub())
    typing.override = typing_extensions.override  # type: ignore[attr-defined]
    sys.path.insert(0, str(checkout))
    sys.argv = ["pretrain_gpt.py"]
    from megatron.training.arguments import add_megatron_arguments  # the checkout's
    from megatron.post_training.arguments import add_modelopt_args
    # pretrain_gpt.py passes add_modelopt_args as its extra_args_provider where ModelOpt is
    # installed, so published GPT recipes use its flags (examples/gptoss/02_train.sh)
    return add_modelopt_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))


def main() -> None:
    checkout = Path(sys.argv[1]).resolve()
    commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], check=True,
                            capture_output=True, text=True).stdout.strip()
    parser = megatron_parser(checkout)
    group_of = {id(a): g.title for g in parser._action_groups for a in g._group_actions}
    # nargs as argparse holds it: 0 for switches, None for one value, "?", "*", "+" or a count
    flags = [{"flags": a.option_strings, "dest": a.dest, "default": _jsonable(a.default),
              "nargs": a.nargs, "group": group_of.get(id(a))}
             for a in parser._actions if a.option_strings and a.dest != "help"]
    # one flag per line, so that a refresh reads as a diff of flags
    rows = ",\n".join(json.dumps(row) for row in flags)
    sys.stdout.write(f'{{"source": {json.dumps(SOURCE)},\n "commit": "{commit}",\n'
                     f' "flags": [\n{rows}\n]}}\n')

if __name__ == "__main__":
    main()
