#!/usr/bin/env python
"""Megatron's `tools/preprocess_data.py` command line; the code is `megatron.training.tools.preprocess`
(installed as `recover-preprocess`). Run `python scripts/preprocess_data.py --help` for the flags."""
import sys

from megatron.training.tools.preprocess import main

if __name__ == "__main__":
    sys.exit(main())
