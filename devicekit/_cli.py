"""The ``devicekit`` command: what torch can use here, and what each GPU is doing.

``devicekit`` prints [`status()`][devicekit.status] (``--json``: its JSON;
``devicekit status`` is the same), ``devicekit watch`` refreshes it until
Ctrl-C, ``devicekit doctor`` diagnoses the environment and ``devicekit bench``
measures it. All but ``bench`` leave CUDA uninitialized. ``--help`` and
``--version`` import nothing heavy (torch takes over a second to import), so
they answer at once.

Exit codes: 0; 1 when ``doctor`` finds an error; 2 for a usage error; 74 when stdout
cannot be written (a full disk); 130 on Ctrl-C (``watch`` stops with 0); 141 when the
reader of a pipe closes it early (``devicekit | head -1``). None of them shows a
traceback: ``main()`` handles them, once, for every command.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import shlex
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from ._clioutput import (
    StdoutError,
    complain,
    escaping_unencodable,
    flush_stdout,
    print_json,
    print_line,
    show,
    silence_stdout,
    stdout,
)
from ._format import close_match
from ._version import __version__

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

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
# A malformed DEVICEKIT_NVML_TIMEOUT: status, watch and doctor show it as a finding.
_TIMEOUT_WARNING = r"DEVICEKIT_NVML_TIMEOUT="
# Exit statuses for what happens to a command line rather than in it (see main()).
_EXIT_CANNOT_WRITE = 74  # sysexits.h EX_IOERR; 1 already means "doctor found an error"
_EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell shows for a command stopped by Ctrl-C
# 128 + SIGPIPE: what a shell shows for cat or grep when `| head` stops reading, so
# scripts that excuse SIGPIPE under `set -o pipefail` excuse us too. Not 1 (Python's
# recipe), which here means "doctor found an error".
_EXIT_PIPE_CLOSED = 141


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan  # told as a non-finite one is, with the range
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(
            f"expected a finite number of seconds, got {text!r}; use -n 1 (the default is 2), "
            f"from {_SHORTEST_INTERVAL:g} to {_LONGEST_INTERVAL:g}"
        )
    if value < _SHORTEST_INTERVAL:
        raise argparse.ArgumentTypeError(
            f"expected at least {_SHORTEST_INTERVAL:g} seconds between refreshes, got {text!r}; "
            f"use -n {_SHORTEST_INTERVAL:g} or more (a refresh reads every GPU: "
            "more often only keeps a CPU core busy)"
        )
    if value > _LONGEST_INTERVAL:  # time.sleep overflows long before inf
        raise argparse.ArgumentTypeError(
            f"expected at most {_LONGEST_INTERVAL:g} seconds (a day) between refreshes, "
            f"got {text!r}; use -n {_LONGEST_INTERVAL:g} or less, or devicekit for one look"
        )
    return value


def _max_time(text: str) -> float:
    """``--max-time``: seconds per number for ``bench``, finite and above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan  # told as a non-finite one is, with the default
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"expected a finite number of seconds above 0, got {text!r}; the default is 0.4"
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
        # isdigit() alone takes "²", which int() then refuses: argparse's "invalid
        # _indices value". Indices are ASCII digits, as nvidia-smi -i reads them.
        if not (entry.isascii() and entry.isdigit()):
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
            guess = _guess(str(value), [str(choice) for choice in action.choices or ()])
            fix = f"see {self.prog} --help" if guess is None else f"did you mean {guess}?"
            raise argparse.ArgumentError(action, f"{error.message}; {fix}") from None

    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        # Where argparse writes --help, --version and errors. Its own drops a failed
        # write (`devicekit --help > /dev/full` printed nothing and exited 0); private,
        # but its signature is unchanged from Python 3.2 to 3.14.
        if not message:
            return
        # argparse passes sys.stdout for --help and --version: None when it is closed
        # (`devicekit --help >&-`); the help went to stderr instead, then a traceback.
        stream = file if file is not None else stdout()
        try:
            stream.write(message)
        except (AttributeError, OSError) as error:  # AttributeError: no stream (pythonw)
            if isinstance(error, OSError) and stream is sys.stdout:
                raise StdoutError(error) from error
            # A failed stderr leaves no one to tell; the exit code (2) still says it.

    def refuse_misplaced(self, argv: list[str]) -> None:
        """Exit 2 for a command's option written before the command (``devicekit -n 2``).

        argparse would take its value for the command: "invalid choice: '2'".
        """
        position = 0
        while position < len(argv):
            word = argv[position]
            if word == "--" or not word.startswith("-") or word == "-":
                return  # the command, or a value: what follows is the command's to read
            name = word.partition("=")[0]
            short = name[:2] if not name.startswith("--") else name  # -n2 is -n with 2
            if name in self.options or short in self.options:  # -i0 carries its value
                position += 2 if word in ("-i", "--id") else 1  # -i's value is the next word
                continue
            owner = next((c for c, sub in self.commands.items() if short in sub.options), None)
            if owner is None:
                return  # unknown everywhere: unrecognized() suggests a spelling
            written = next((w for w in argv[position:] if w in self.commands), None)
            if written is not None and written != owner:
                return  # another command's option: that command's parser says it has none
            fixed = [w for w in argv if w not in self.commands]
            fixed.insert(position, owner)
            self.error(
                f"argument {short}: it is an option of '{self.prog} {owner}', so it goes after "
                f"the command: {self.prog} {shlex.join(fixed)}"
            )

    def unrecognized(self, args: argparse.Namespace, unknown: list[str]) -> NoReturn:
        """Exit 2 for arguments no parser took, suggesting the options they resemble.

        The usage line and the suggestions are the subcommand's, when there is one.
        """
        parser = self.commands.get(getattr(args, "command", None) or "", self)
        if "-i" not in parser.options and any(map(_is_id_option, unknown)):
            parser.error(_no_ids(parser.prog))
        guesses = []
        for word in unknown:
            written = word.partition("=")[0]
            guess = _guess(written, parser.options) if written.startswith("-") else None
            if guess is not None:
                guesses.append((written, guess))
        message = f"unrecognized arguments: {' '.join(unknown)}"
        if len(guesses) == 1:
            message += f" (did you mean {guesses[0][1]}?)"
        elif guesses:
            shown = ", ".join(f"{guess} instead of {written}" for written, guess in guesses)
            message += f" (did you mean {shown}?)"
        parser.error(f"{message}; see {parser.prog} --help")


def _guess(word: str, known: list[str]) -> str | None:
    """The known word ``word`` most likely misspells: ``--json`` for ``--JSON`` or ``--jsn``.

    difflib compares letters as written, so a word in the wrong case matched
    nothing (``--JSON``) while one with a letter missing did.
    """
    lower = {k.lower(): k for k in known}
    exact = lower.get(word.lower())
    if exact is not None and exact != word:
        return exact
    guess = close_match(word.lower(), list(lower))
    return None if guess is None else lower[guess]


def _is_id_option(word: str) -> bool:
    """``-i 0``, ``-i0``, ``--id 0``, ``--id=0``: the words of an -i given where none is taken."""
    return word in ("-i", "--id") or word.startswith(("-i", "--id="))


def _no_ids(prog: str) -> str:
    return f"argument -i/--id: {prog} does not take GPU indices (it covers every GPU); drop -i"


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
        epilog="Exit codes: 0 ok, 1 doctor found an error, 2 usage error, 74 stdout cannot be "
        "written, 130 interrupted (Ctrl-C; watch, which runs until Ctrl-C, stops with 0), "
        "141 the pipe was closed (| head).",
    )
    parser.add_argument("-V", "--version", action="version", version=f"devicekit {__version__}")
    _shared_options(parser, top=True)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    # What plain `devicekit` prints, by the name the docs give it (dk.status()): the
    # name users try first, which argparse refused as "invalid choice".
    status = commands.add_parser(
        "status",
        help="print the status (what plain `devicekit` prints)",
        description="Print what torch can use here and what each GPU is doing, without "
        "initializing CUDA: the same as plain `devicekit`.",
    )
    _shared_options(status, top=False)
    watch = commands.add_parser(
        "watch",
        help="refresh the status until Ctrl-C (which exits 0)",
        description="Print the status every few seconds until Ctrl-C, with the time of each "
        "refresh. On a terminal the screen is redrawn in place; piped, refreshes are "
        "separated by a line (with --json, one JSON document per line). Ctrl-C is how it "
        "ends, so it exits 0, not 130.",
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
        "host-device copy bandwidth (GB/s) and launch and synchronize latencies (ms, µs). "
        "Takes well under 30 seconds; starts CUDA.",
    )
    bench.add_argument(
        "--max-time",
        type=_max_time,
        default=None,
        metavar="SECONDS",
        help="seconds to measure each number for (default: 0.4); a note's "
        "'allow max_time of at least ...' means this",
    )
    _shared_options(bench, top=False, ids=False)
    claims = commands.add_parser(
        "claims",
        help="show which processes hold GPU claims (pick_gpu(claim=True), claim_gpu)",
        description="List the GPU claims held now in the claims directory "
        "(DEVICEKIT_CLAIMS_DIR, else /tmp/devicekit-<uid>), from the kernel's lock table: "
        "each GPU, and the pid and name of the process that holds it. Creates and locks "
        "nothing.",
    )
    _shared_options(claims, top=False, ids=False)
    parser.commands = {"status": status, "watch": watch, "doctor": doctor, "bench": bench}
    parser.commands["claims"] = claims
    return parser


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


def _watch(parser: _Parser, args: argparse.Namespace) -> int:
    on_terminal = stdout().isatty() and not args.json
    shown = 0
    try:
        _load_torch()
        while args.count is None or shown < args.count:
            current = _snapshot(parser.commands["watch"], args.id)
            if args.json:
                print_json(current.to_dict(), lines=True)
            else:
                # Piped, a blank line between refreshes instead of clearing.
                start = _CLEAR if on_terminal else "\n" if shown else ""
                header = f"devicekit watch, {current.time_text}, every {args.interval:g} s"
                print_line(f"{start}{header}\n{'=' * len(header)}\n{current}")
            shown += 1
            if args.count is None or shown < args.count:
                time.sleep(args.interval)
    except KeyboardInterrupt:  # the way to stop watching: not an error
        if not args.json:
            print_line()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    r"""Run the ``devicekit`` command line and return its exit code.

    What a command line meets from outside is handled here, once for every command,
    and none of it shows a traceback: Ctrl-C returns 130 with "devicekit: interrupted"
    on stderr; a reader that closes the pipe early returns 141 quietly; a stdout that
    cannot be written (a full disk) returns 74 with one line on stderr naming the
    error. In those two cases stdout is then pointed at the null device, also in a
    caller's own process: its unwritten bytes would fail again when Python exits.
    Characters stdout or stderr cannot encode (an ASCII locale) are written as
    backslash escapes, such as ``\xb5`` for µ.
    """
    with escaping_unencodable(sys.stdout), escaping_unencodable(sys.stderr):
        try:
            try:
                return _main(argv)
            finally:
                # argparse's --help and --version are still buffered (and argparse
                # ignores write errors): flushed here, a failure is ours to report.
                flush_stdout()
        except KeyboardInterrupt:
            complain("interrupted")
            return _EXIT_INTERRUPTED
        except StdoutError as failure:
            silence_stdout()
            if isinstance(failure.error, BrokenPipeError):
                # The reader has what it wanted (| head): not worth a word.
                return _EXIT_PIPE_CLOSED
            complain(f"cannot write to stdout: {failure.error}")
            return _EXIT_CANNOT_WRITE


def _main(argv: Sequence[str] | None) -> int:
    parser = _parser()
    parser.refuse_misplaced(list(sys.argv[1:] if argv is None else argv))
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.unrecognized(args, unknown)  # exits with 2
    # Each command imports torch; filters set here are undone when it returns (tests and
    # other callers of main() in their own process keep theirs).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NUMPY_WARNING, category=UserWarning)
        if args.command != "bench":  # the others print the same as a finding, with its fix
            warnings.filterwarnings("ignore", message=_TIMEOUT_WARNING, category=RuntimeWarning)
        return _run(parser, args)


def _run(parser: _Parser, args: argparse.Namespace) -> int:
    if args.command == "watch":
        return _watch(parser, args)  # it loads torch in its own Ctrl-C handling
    _load_torch()
    if args.command in ("doctor", "bench", "claims"):
        if args.id is not None:  # given before the subcommand: `devicekit -i 0 doctor`
            command = parser.commands[args.command]
            command.error(_no_ids(command.prog))
        if args.command == "doctor":
            from ._doctor import doctor  # noqa: PLC0415 - see _snapshot

            diagnosis = doctor()
            show(diagnosis, json_form=args.json)
            return diagnosis.exit_code
        if args.command == "claims":
            from ._claimlist import claims_report  # noqa: PLC0415 - see _snapshot

            try:
                report = claims_report()
            except ValueError as error:  # DEVICEKIT_CLAIMS_DIR is a relative path
                parser.commands["claims"].error(str(error))
            show(report, json_form=args.json)
            return 0
        from ._bench import bench  # noqa: PLC0415 - see _snapshot

        max_time = {} if args.max_time is None else {"max_time": args.max_time}
        show(bench(**max_time), json_form=args.json)
        return 0
    # `devicekit` or `devicekit status`: an -i error shows the usage of the one typed.
    shown = parser.commands.get(args.command or "", parser)
    show(_snapshot(shown, args.id), json_form=args.json)
    return 0


def _load_torch() -> None:
    """Import torch (with the status, which every command uses), holding Ctrl-C till done.

    torch's import swallows a KeyboardInterrupt raised inside it: its C++ part imports
    numpy and turns any failure into a warning. Interrupted there, the command ran on
    to the end and exited 0, or failed with numpy's "ImportError: cannot load module
    more than once per process" (4 of 60 tries of Ctrl-C during startup). So a Ctrl-C in
    the import is held and raised when it returns, about a second later at worst.
    """
    with _ctrl_c_held():
        from . import _status  # noqa: F401, PLC0415 - see _snapshot


@contextlib.contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """Hold a Ctrl-C that arrives during the block, and raise it once the block is done."""
    previous = signal.getsignal(signal.SIGINT)
    on_main_thread = threading.current_thread() is threading.main_thread()
    # Ignored (a background job) or a caller's own handler: theirs to keep. And only
    # the main thread may set a handler.
    if previous is not signal.default_int_handler or not on_main_thread:
        yield
        return
    held: list[int] = []
    signal.signal(signal.SIGINT, lambda number, _: held.append(number))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt
