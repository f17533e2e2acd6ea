"""The ``devicekit`` console script: `_cli.main`, then an exit a late Ctrl-C cannot change."""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import NoReturn

from ._cli import main

__all__ = ["run"]


def run() -> NoReturn:
    """Run ``devicekit`` with this process's arguments and exit with its code.

    Once the output is written, Python still shuts down (torch's and NVML's
    exit hooks, a fraction of a second); a Ctrl-C there killed the process by
    SIGINT, so the shell saw 130 and no word, not the command's own code. It
    now ends the process at once with that code (stdout is flushed already).
    """
    try:
        code: int | str | None = main()
    except SystemExit as done:  # argparse's --help, --version and usage errors
        code = done.code
    status = code if isinstance(code, int) else 0 if code is None else 1  # as sys.exit's
    on_main_thread = threading.current_thread() is threading.main_thread()
    if on_main_thread and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, lambda number, frame: os._exit(status))
    sys.exit(code)
