"""The one exception type for user mistakes on the command line."""

from __future__ import annotations


class ArgumentError(Exception):
    """A user error in the flags: which flag, what is wrong, and how to fix it.

    Kept separate from argparse.ArgumentError on purpose: argparse swallows its own type and turns it
    into a usage dump, while ours must reach `parse_and_validate` to become one clean stderr line.
    """

    def __init__(self, flag: str, message: str, fix: str) -> None:
        self.flag = flag
        self.message = message.rstrip(". ")
        self.fix = fix.rstrip(". ")
        super().__init__(f"{self.flag}: {self.message}. Fix: {self.fix}")
