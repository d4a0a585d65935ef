"""hf_tev's log lines: printed under hf_tev's own name, at transformers' verbosity.

hf_tev's modules log with `transformers.utils.logging.get_logger(__name__)` (so `warning_once` works) to loggers
under `hf_tev`. That logger takes its level from transformers' library logger (it is its parent), so
`transformers.logging.set_verbosity_error()` and `TRANSFORMERS_VERBOSITY` silence or widen hf_tev's lines as they
do transformers' own; it prints them itself, as `[hf_tev] message` on stderr, and does not pass them on to
transformers' handler (which would print each line again as `[transformers] message`), as transformers' own logger
does not pass its lines on to the root logger. To capture them, add a handler to `logging.getLogger("hf_tev")`.

Plain Python: importing this module does not import transformers (the parent logger is transformers' by name).
"""

from __future__ import annotations

import logging
import os
import sys

LOGGER_NAME = "hf_tev"
PARENT_NAME = "transformers"
FORMAT = f"[{LOGGER_NAME}] %(message)s"
DETAIL_FORMAT = "%(levelname)s [%(name)s:%(lineno)s] %(asctime)s %(message)s"  # as TRANSFORMERS_VERBOSITY=detail


class StderrHandler(logging.StreamHandler):
    """A stream handler that writes to the `sys.stderr` of the moment (a notebook or pytest may replace it after
    hf_tev was imported)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # StreamHandler.__init__ sets it; the property reads sys.stderr instead
        pass


def configure_logging() -> logging.Logger:
    """Put hf_tev's logger under transformers' (its level) with its own handler; idempotent (a reload adds no
    second handler). Returns the `hf_tev` logger."""
    logger = logging.getLogger(LOGGER_NAME)
    logger.parent = logging.getLogger(PARENT_NAME)
    logger.propagate = False
    if not any(type(h).__name__ == StderrHandler.__name__ for h in logger.handlers):
        handler = StderrHandler()
        detail = os.environ.get("TRANSFORMERS_VERBOSITY") == "detail"
        handler.setFormatter(logging.Formatter(DETAIL_FORMAT if detail else FORMAT))
        logger.addHandler(handler)
    return logger
