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
from typing import TYPE_CHECKING, Any, NoReturn

from ._format import close_match
from ._version import __version__

if TYPE_CHECKING:
    from ._status import Status

__all__ = ["main"]

_CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen: a refresh in place on a terminal
_LONGEST_INTERVAL = 86_400.0
# procps watch's floor too. Each refresh reads every GPU and takes a CPU core for a
# moment; shorter intervals only keep that core busy (1e-9 was accepted and spun).
_SHORTEST_INTERVAL = 0.1
# torch warns on import when numpy is absent (numpy is not a dependency): two lines of
# noise on every run. Hidden inside this command only, never in a caller's process.
_NUMPY_WARNING = r"Failed to initialize NumPy: No module named 'numpy'"


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds, got {text!r}")
    if value < _SHORTEST_INTERVAL:
        raise argparse.ArgumentTypeError(
            f"expected at least {_SHORTEST_INTERVAL:g} seconds between refreshes, got {text!r}; "
            f"use -n {_SHORTEST_INTERVAL:g} or more (a refresh reads every GPU: "
            "more often only keeps a CPU core busy)"
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


class _Parser(argparse.ArgumentParser):
    """argparse with a "did you mean ...?" for a mistyped subcommand or option.

    Python 3.14's ``suggest_on_error`` does the subcommand only, and we support
    3.10. The exit code (2) and the usage line stay argparse's own.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.options: list[str] = []  # every option string, as they are added (-h, --help first)
        self.commands: dict[str, _Parser] = {}
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        """Add an argument as argparse does, and note its option strings for suggestions."""
        action = super().add_argument(*args, **kwargs)
        self.options.extend(action.option_strings)
        return action

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        # The one place argparse checks a choice (a subcommand); private, but its
        # signature is unchanged from Python 3.2 to 3.14.
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as error:
            guess = close_match(str(value), [str(choice) for choice in action.choices or ()])
            if guess is None:
                raise
            raise argparse.ArgumentError(
                action, f"{error.message}; did you mean {guess}?"
            ) from None

    def unrecognized(self, args: argparse.Namespace, unknown: list[str]) -> NoReturn:
        """Exit 2 for arguments no parser took, suggesting the options they resemble.

        The usage line and the suggestions are the subcommand's, when there is one.
        """
        parser = self.commands.get(getattr(args, "command", None) or "", self)
        guesses = []
        for word in unknown:
            written = word.partition("=")[0]
            guess = close_match(written, parser.options) if written.startswith("-") else None
            if guess is not None:
                guesses.append((written, guess))
        message = f"unrecognized arguments: {' '.join(unknown)}"
        if len(guesses) == 1:
            message += f" (did you mean {guesses[0][1]}?)"
        elif guesses:
            shown = ", ".join(f"{guess} instead of {written}" for written, guess in guesses)
            message += f" (did you mean {shown}?)"
        parser.error(message)


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


def _parser() -> _Parser:
    parser = _Parser(
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
        help=f"seconds between refreshes (default: 2; at least {_SHORTEST_INTERVAL:g})",
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
    parser.commands = {"watch": watch, "doctor": doctor, "bench": bench}
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
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.unrecognized(args, unknown)  # exits with 2
    # Each command imports torch; filters set here are undone when it returns (tests and
    # other callers of main() in their own process keep theirs).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NUMPY_WARNING, category=UserWarning)
        return _run(parser, args)


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
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
