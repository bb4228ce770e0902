"""Python `logging` for every ReCoVer process: one logger per module (`logging.getLogger(__name__)`),
configured once by each entry point (a rank, the launcher, the coordinator, a standby).

A record is one line, `[recover.<module>] rank R: message` (no `rank R:` outside a rank; `warning:`
or `error:` before the message at those levels), written
with one write and flushed: the ranks of a node share the launcher's stdout, and a line written in
pieces could be cut by another rank's. Megatron's own log lines (`iteration N/ M | ...`, `validation
loss ...`) pass `extra=PLAIN` and appear byte for byte as Megatron prints them, for the scripts that
parse them. The metrics JSONL, not this text, is the record that tools and tests read.
"""
from __future__ import annotations

import logging
import sys
import warnings

# The packages whose loggers this configures; anything else (megatron-core, torch) keeps its own.
PACKAGES = ("recover_patches", "megatron.training", "pretrain_gpt_recover", "__main__")
PLAIN = {"plain": True}  # logger.info(line, extra=PLAIN): the line as is, without the prefix
# megatron-core's notes, at import, that transformer-engine and Apex are missing and it falls back
# to torch's kernels: true of every CPU run, four lines per process that imports it
FALLBACK_WARNINGS = ".*(Apex|Transformer Engine).*"
# torch's deprecation of ShardedTensor, which megatron-core's torch_dist format builds on every save
# and load: nothing a user of the format can act on (it names torch's internals)
SHARDED_TENSOR_DEPRECATION = "Please use DTensor instead and we are deprecating ShardedTensor"


def hide_library_notes() -> None:
    """Keep the libraries' notes a user cannot act on out of what they read: megatron-core's
    fallback notes (the launcher's preload of megatron-core printed them once per launch, before
    any rank) and torch's ShardedTensor deprecation on a torch_dist save or load."""
    warnings.filterwarnings("ignore", message=FALLBACK_WARNINGS)
    warnings.filterwarnings("ignore", message=SHARDED_TENSOR_DEPRECATION, category=FutureWarning)


def tag(logger_name: str) -> str:
    """`recover_patches.collectives.membership` -> `recover.membership`; the front-end -> `recover`."""
    if logger_name.startswith("recover_patches."):
        return "recover." + logger_name.rsplit(".", 1)[1]
    return "recover"


class LineFormatter(logging.Formatter):
    def __init__(self, rank: int | None) -> None:
        super().__init__()
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        if getattr(record, "plain", False):
            return text
        who = f" rank {self.rank}:" if self.rank is not None else ""
        level = f" {record.levelname.lower()}:" if record.levelno >= logging.WARNING else ""
        return f"[{tag(record.name)}]{who}{level} {text}"


class _CurrentStream(logging.StreamHandler):
    """Writes to whatever sys.stdout / sys.stderr is now (a test's capture, a redirected stream)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name

    @property
    def stream(self):
        return getattr(sys, self._name)

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; the name decides
        pass


_level = [logging.INFO]  # set_level's choice, kept by later configure calls


def set_level(level: int) -> None:
    """Megatron-LM's --logging-level: the root logger's level, and ReCoVer's loggers' too."""
    _level[0] = level
    logging.getLogger().setLevel(level)
    for package in PACKAGES:
        logging.getLogger(package).setLevel(level)


def configure(rank: int | None = None, stream: str = "stderr", level: int | None = None) -> None:
    """Send this process's records to sys.<stream> with the rank prefix. Ranks use stdout (where
    Megatron prints); the launcher and the coordinator stderr. Calling it again (a forked rank, a
    standby that got its rank) replaces the previous set-up."""
    level = _level[0] if level is None else level
    handler = _CurrentStream(stream)
    handler.setFormatter(LineFormatter(rank))
    for package in PACKAGES:
        logger = logging.getLogger(package)
        logger.handlers[:] = [handler]
        logger.setLevel(level)
        logger.propagate = False
