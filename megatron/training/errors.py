"""User mistakes: one exception shape (flag, what is wrong, how to fix it) for every front-end
module, so the entry point turns any of them into one stderr line and exit status 2."""

from __future__ import annotations

EXIT_USER_ERROR = 2  # a user error: one line naming the flag and the fix, nothing written
EXIT_RESTART = 3  # the job cannot go on in place: restart from a checkpoint


class UserError(Exception):
    """A user error: which flag, what is wrong, and how to fix it."""

    def __init__(self, flag: str, message: str, fix: str) -> None:
        self.flag = flag
        self.message = message.rstrip(". ")
        self.fix = fix.rstrip(". ")
        super().__init__(f"{self.flag}: {self.message}. Fix: {self.fix}")


class ArgumentError(UserError):
    """A user error in the flags.

    Kept separate from argparse.ArgumentError on purpose: argparse swallows its own type and turns it
    into a usage dump, while ours must reach `parse_and_validate` to become one clean stderr line.
    """
