"""The ``devicekit`` command: what torch can use here, and what each GPU is doing.

``devicekit`` prints [`status()`][devicekit.status] (``--json``: its JSON),
``devicekit watch`` refreshes it until Ctrl-C, ``devicekit doctor`` diagnoses
the environment and ``devicekit bench`` measures it. All but ``bench`` leave
CUDA uninitialized. ``--help`` and ``--version`` import nothing heavy (torch
takes over a second to import), so they answer at once.

Exit codes: 0; 1 when ``doctor`` finds an error; 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:
    from ._status import Status

__all__ = ["main"]

_CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen: a refresh in place on a terminal
_LONGEST_INTERVAL = 86_400.0


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(
            f"expected a finite, positive number of seconds, got {text!r}"
        )
    if value > _LONGEST_INTERVAL:  # time.sleep overflows long before inf
        raise argparse.ArgumentTypeError(
            f"expected at most {_LONGEST_INTERVAL:g} seconds (a day) between refreshes, "
            f"got {text!r}"
        )
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1 refresh, got {text!r}")
    return value


def _indices(text: str) -> list[int]:
    """``"0,2"`` -> ``[0, 2]``: torch indices, as ``nvidia-smi -i`` takes them."""
    indices = []
    for part in text.split(","):
        entry = part.strip().removeprefix("cuda:")
        if not entry.isdigit():
            raise argparse.ArgumentTypeError(
                f"expected GPU indices separated by commas, such as 0,2; got {text!r}"
            )
        indices.append(int(entry))
    return indices


def _shared_options(
    parser: argparse.ArgumentParser, *, top: bool, ids: bool = True, json_help: str = ""
) -> None:
    """--json and -i, accepted before or after a subcommand (and honoured either way)."""
    # Below a subcommand the default is SUPPRESS, so that not repeating an option
    # there keeps the value given before it.
    default: Any = argparse.SUPPRESS
    parser.add_argument(
        "--json",
        action="store_true",
        default=False if top else default,
        help=json_help or "print JSON instead of text",
    )
    if ids:  # doctor and bench look at the whole machine: they do not offer -i at all
        parser.add_argument(
            "-i",
            "--id",
            type=_indices,
            default=None if top else default,
            metavar="IDS",
            help="only these GPUs, by torch index: 0 or 0,2",
        )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="devicekit",
        description="Show what torch can use here and what each GPU is doing, "
        "without initializing CUDA.",
        epilog="Exit codes: 0 ok, 1 doctor found an error, 2 usage error.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"devicekit {__version__}")
    _shared_options(parser, top=True)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    watch = commands.add_parser(
        "watch",
        help="refresh the status until Ctrl-C",
        description="Print the status every few seconds until Ctrl-C, with the time of each "
        "refresh. On a terminal the screen is redrawn in place; piped, refreshes are "
        "separated by a line (with --json, one JSON document per line).",
    )
    watch.add_argument(
        "-n",
        "--interval",
        type=_seconds,
        default=2.0,
        metavar="SECONDS",
        help="seconds between refreshes (default: 2)",
    )
    watch.add_argument(
        "--count", type=_count, default=None, metavar="N", help="stop after N refreshes"
    )
    _shared_options(watch, top=False, json_help="print one JSON document per line")
    doctor = commands.add_parser(
        "doctor",
        help="diagnose slow or broken GPU work; exit 1 on errors",
        description="Check what makes GPU work slow or broken here (the torch build against "
        "the driver, CUDA_VISIBLE_DEVICES, busy or throttled GPUs, persistence mode, "
        "fork safety, low memory), each finding with a fix. Exits 1 when one is an error.",
    )
    _shared_options(doctor, top=False, ids=False)
    bench = commands.add_parser(
        "bench",
        help="measure CPU vs GPU speed, bandwidth, latencies",
        description="Measure matrix multiplication rates (TFLOP/s) on the CPU and each GPU, "
        "host-device copy bandwidth (GB/s) and launch and synchronize latencies (µs). "
        "Takes well under 30 seconds; starts CUDA.",
    )
    _shared_options(bench, top=False, ids=False)
    return parser


def _print_json(document: Any, *, lines: bool = False) -> None:
    print(json.dumps(document, indent=None if lines else 2), flush=True)


def _snapshot(parser: argparse.ArgumentParser, ids: list[int] | None) -> Status:
    from ._status import status  # noqa: PLC0415 - torch loads only when a command runs

    current = status()
    if ids is None:
        return current
    try:
        return current.select(ids)
    except KeyError as error:
        parser.error(f"argument -i/--id: {error.args[0]}")  # exits with 2
        raise  # pragma: no cover - parser.error does not return


def _watch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    on_terminal = sys.stdout.isatty() and not args.json
    shown = 0
    try:
        while args.count is None or shown < args.count:
            current = _snapshot(parser, args.id)
            if args.json:
                _print_json(current.to_dict(), lines=True)
            else:
                if on_terminal:
                    sys.stdout.write(_CLEAR)
                elif shown:
                    print()  # piped: a blank line between refreshes
                header = f"devicekit watch, {current.time_text}, every {args.interval:g} s"
                print(f"{header}\n{'=' * len(header)}\n{current}", flush=True)
            shown += 1
            if args.count is None or shown < args.count:
                time.sleep(args.interval)
    except KeyboardInterrupt:  # the way to stop watching: not an error
        if not args.json:
            print()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``devicekit`` command line and return its exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    # torch without numpy warns when it is imported; this is devicekit's own process.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    if args.command == "watch":
        return _watch(parser, args)
    if args.command in ("doctor", "bench"):
        if args.id is not None:
            parser.error(f"argument -i/--id: {args.command} does not take GPU indices")
        if args.command == "doctor":
            from ._doctor import doctor  # noqa: PLC0415 - see _snapshot

            diagnosis = doctor()
            _show(diagnosis, json_form=args.json)
            return diagnosis.exit_code
        from ._bench import bench  # noqa: PLC0415 - see _snapshot

        _show(bench(), json_form=args.json)
        return 0
    _show(_snapshot(parser, args.id), json_form=args.json)
    return 0


def _show(result: Any, *, json_form: bool) -> None:
    if json_form:
        _print_json(result.to_dict())
    else:
        print(result)
