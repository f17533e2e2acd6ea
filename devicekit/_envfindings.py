"""Judgements about variables that change how GPU work runs, read from the environment alone.

``doctor`` looks at three that nothing else checks: ``CUDA_LAUNCH_BLOCKING``
(every kernel launch waits for the GPU), the caching allocator's settings in
``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_ALLOC_CONF`` (a typo there fails the
first CUDA allocation, or is silently not what was meant), and
``DEVICEKIT_CLAIMS_DIR``. Each check reads the text of a variable and, for
the claims directory, the file system; none starts CUDA or torch's allocator.

The allocator settings are read here as c10 reads them (``c10/core/
AllocatorConfig`` and ``c10/cuda/CUDAAllocatorConfig``, torch 2.6 to 2.13):
comma-separated ``name:value`` pairs, whitespace dropped, ``[...]`` for a
list. c10 refuses, with an exception at the first CUDA allocation (at the
latest), a name it does not know, a missing colon, a value of the wrong kind
or range, and ``,,``. It silently reads a number's leading digits only
(``max_split_size_mb:100abc`` is 100) and a negative size as no limit. A
test holds this reading to the installed torch's own parser. Names only
newer versions know (``large_segment_size_mb``) pass here, and an older torch
refuses them. On a build without CUDA or ROCm nothing reads these
variables, so the findings there are information only: they matter where
the script will run.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from . import _claimfiles
from ._findings import Finding, Severity, _version
from ._format import close_match, safe_text

__all__ = ["ALLOC_VAR", "CUDA_ALLOC_VAR", "LAUNCH_VAR", "allocator", "claims_dir", "environment"]

LAUNCH_VAR = "CUDA_LAUNCH_BLOCKING"
CUDA_ALLOC_VAR = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_VAR = "PYTORCH_ALLOC_CONF"  # the name torch documents since 2.8

# Each option c10's parsers know (the device-neutral ones and CUDA's), and what it takes.
_OPTIONS = {
    **dict.fromkeys(
        (
            "max_split_size_mb",
            "max_non_split_rounding_mb",
            "large_segment_size_mb",
            "pinned_max_round_threshold_mb",
            "pinned_max_cached_size_mb",
            "pinned_reserve_segment_size_mb",
        ),
        "size",
    ),
    **dict.fromkeys(
        (
            "expandable_segments",
            "pinned_use_background_threads",
            "release_lock_on_cudamalloc",
            "release_lock_on_hipmalloc",
            "pinned_use_cuda_host_register",
            "pinned_use_hip_host_register",
            "graph_capture_record_stream_reuse",
        ),
        "bool",
    ),
    "garbage_collection_threshold": "fraction",
    "roundup_power2_divisions": "divisions",
    "pinned_num_register_threads": "threads",
    "backend": "backend",
}
# The smallest size each accepts, in MiB: the allocator's 20 MiB large-block size, and more.
_SMALLEST = {
    "max_split_size_mb": 20,
    "max_non_split_rounding_mb": 20,
    "large_segment_size_mb": 11,
    "pinned_reserve_segment_size_mb": 1,
}
_BACKENDS = ("native", "cudaMallocAsync", "hipMallocAsync")
_MAX_REGISTER_THREADS = 128
_SIZE_T = 2**64
_INT = re.compile(r"[+-]?[0-9]+")  # what std::stoull reads; the rest is ignored
_FLOAT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")  # std::stod
_EXAMPLE = "expandable_segments:True,max_split_size_mb:512"


@dataclass(frozen=True)
class _Problem:
    """One place where c10 reads a setting differently than written, and what to write."""

    raises: bool  # c10 refuses it (an exception), rather than reading something else
    why: str
    fix: str


def _tokens(value: str) -> list[str]:
    """c10's ConfigTokenizer: ``,``, ``:``, ``[`` and ``]`` are tokens; whitespace is dropped."""
    return [t for t in re.split(r"([,:\[\]])", re.sub(r"\s", "", value)) if t]


def _is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _number(name: str, text: str, problems: list[_Problem]) -> int | None:
    """The integer c10 reads from ``text``, noting what it drops; None when it raises."""
    match = _INT.match(text)
    if match is None:
        why = f"{name}:{text}: {text!r} is not a whole number"
        problems.append(_Problem(True, why, f"write {name} as a whole number, such as {name}:512"))
        return None
    number = int(match.group())
    if match.end() < len(text):
        problems.append(
            _Problem(
                False,
                f"{name}:{text} is read as {number}: c10 ignores {text[match.end() :]!r}",
                f"write {name}:{number} if that is what you meant",
            )
        )
    if abs(number) >= _SIZE_T:
        problems.append(_Problem(True, f"{name}:{text} is out of range", f"write a smaller {name}"))
        return None
    return number


def _value(name: str, value: str, problems: list[_Problem], *, large_segments: bool) -> None:
    """Check one option's value the way c10 reads it.

    ``large_segments``: ``large_segment_size_mb`` is set too, which lowers the
    smallest ``max_split_size_mb`` c10 takes (torch 2.13), so that is not checked.
    """
    kind = _OPTIONS[name]
    if kind == "bool":
        if value not in ("True", "False"):
            spelled = value.capitalize()
            near = (
                spelled if spelled in ("True", "False") else close_match(spelled, ("True", "False"))
            )
            near = near or "True"
            why = f"{name}:{value}: {value!r} is neither True nor False, which c10 takes spelled so"
            problems.append(_Problem(True, why, f"write {name}:{near}"))
    elif kind == "backend":
        if value not in _BACKENDS:
            near = close_match(value, _BACKENDS) or "native"
            problems.append(
                _Problem(
                    True,
                    f"backend:{value}: c10 knows the allocators {', '.join(_BACKENDS)}",
                    f"write backend:{near}",
                )
            )
    elif kind == "fraction":
        match = _FLOAT.match(value)
        if match is None or not 0 < float(match.group()) < 1:
            why = f"{name}:{value} is not a number between 0 and 1 (both excluded)"
            problems.append(_Problem(True, why, f"write a fraction, such as {name}:0.6"))
        elif match.end() < len(value):
            why = f"{name}:{value} is read as {match.group()}: c10 ignores the rest"
            problems.append(_Problem(False, why, f"write {name}:{match.group()}"))
    else:
        _integer(name, kind, value, problems, large_segments=large_segments)


def _integer(
    name: str, kind: str, value: str, problems: list[_Problem], *, large_segments: bool
) -> None:
    """Check a size in MiB, a count of threads or of divisions."""
    number = _number(name, value, problems)
    if number is None:
        return
    if kind == "threads" and not (_is_power_of_2(number) and number <= _MAX_REGISTER_THREADS):
        why = f"{name}:{number} is not a power of 2 up to {_MAX_REGISTER_THREADS}"
        problems.append(_Problem(True, why, f"write {name}:8"))
    elif kind == "divisions" and not _is_power_of_2(number):
        why = f"{name}:{number} is not a power of 2"
        problems.append(_Problem(True, why, f"write {name}:4, or a list such as [256:4,>:1]"))
    elif number < 0:
        why = f"{name}:{number} is negative, which c10 reads as a huge size: no limit"
        problems.append(_Problem(False, why, f"leave {name} out for no limit"))
    elif number < _SMALLEST.get(name, 0) and not (large_segments and name.startswith("max_")):
        why = f"{name}:{number} is below the smallest it takes, {_SMALLEST[name]}"
        problems.append(_Problem(True, why, f"write {name}:{_SMALLEST[name]} or more"))


def _divisions(items: list[str], problems: list[_Problem]) -> None:
    """Check ``roundup_power2_divisions:[interval:divisions,...,>:divisions]``."""
    name = "roundup_power2_divisions"
    fix = f"write pairs of powers of 2, such as {name}:[256:4,512:2,>:1]"
    pairs = "".join(items).split(",")
    if pairs[-1] == "":  # "[]" and a trailing comma are fine
        pairs.pop()
    for pair in pairs:
        interval, colon, divisions = pair.partition(":")
        if not colon or not interval or not divisions or ":" in divisions:
            problems.append(_Problem(True, f"{name} has {pair!r} where a pair belongs", fix))
            return
        number = _number(name, divisions, problems)
        if number is not None and number and not _is_power_of_2(number):
            problems.append(_Problem(True, f"{name} divides into {number}, not a power of 2", fix))
            return
        if interval != ">":
            size = _number(name, interval, problems)
            if size is not None and not _is_power_of_2(size):
                problems.append(_Problem(True, f"{name} interval {size} is not a power of 2", fix))
                return


def _name_problem(tokens: list[str], i: int) -> _Problem | None:
    """What c10 refuses about the option named at ``tokens[i]`` and its colon, if anything."""
    name, pairs = tokens[i], f"write name:value pairs, such as {_EXAMPLE}"
    if name in ",:[]":
        return _Problem(True, f"{name!r} stands where an option's name belongs", pairs)
    key, equals, after = name.partition("=")
    if equals and key in _OPTIONS:
        return _Problem(True, f"{name!r} has '=' where c10 takes ':'", f"write {key}:{after}")
    near = name.lower() if name.lower() in _OPTIONS else close_match(name, _OPTIONS)
    unknown = "" if name in _OPTIONS else f", and c10 knows no option {name!r}"
    hint = f" (did you mean {near}?)" if unknown and near else ""
    if tokens[i + 1 : i + 2] != [":"]:
        return _Problem(True, f"{name!r} has no ':' and value{unknown}{hint}", pairs)
    if unknown:
        fix = f"write {near} instead of {name}" if near else f"remove {name}"
        return _Problem(True, f"{name!r} is not an option c10 knows{hint}", fix)
    if i + 2 >= len(tokens) or tokens[i + 2] in ",:]":
        return _Problem(True, f"{name} has no value after its ':'", pairs)
    return None


def _problems(value: str) -> list[_Problem]:
    """Where c10 reads an allocator setting differently than written, up to the first refusal."""
    tokens = _tokens(value)
    problems: list[_Problem] = []
    seen: set[str] = set()
    i = 0
    while i < len(tokens) and not any(p.raises for p in problems):
        name = tokens[i]
        refused = _name_problem(tokens, i)
        if refused is not None:
            problems.append(refused)
            break
        if name in seen:
            why = f"{name} is given twice; c10 keeps the last"
            problems.append(_Problem(False, why, f"give {name} once"))
        seen.add(name)
        i += 2
        if tokens[i] == "[":
            end = tokens.index("]", i) if "]" in tokens[i:] else len(tokens)
            if name != "roundup_power2_divisions" or end == len(tokens):
                why = f"{name} has a list where one value belongs, or a list without its ']'"
                problems.append(_Problem(True, why, f"write {name}:<value>"))
                break
            _divisions(tokens[i + 1 : end], problems)
            i = end
        else:
            _value(name, tokens[i], problems, large_segments="large_segment_size_mb" in tokens)
        if i + 1 < len(tokens) and tokens[i + 1] != ",":
            why = f"{tokens[i + 1]!r} follows {name}'s value where a comma belongs"
            problems.append(_Problem(True, why, "separate the options with commas, not spaces"))
        i += 2
    if "cudaMallocAsync" in tokens and seen & {"max_split_size_mb", "roundup_power2_divisions"}:
        why = "backend:cudaMallocAsync ignores max_split_size_mb and roundup_power2_divisions"
        problems.append(_Problem(False, why, "drop those options, or the backend option"))
    return problems


def _reads(torch_version: str, environ: Mapping[str, str]) -> str | None:
    """The allocator variable this torch reads, of those set; None when it reads none."""
    if _version(torch_version) < (2, 8):  # 2.8 added PYTORCH_ALLOC_CONF
        order: tuple[str, ...] = (CUDA_ALLOC_VAR,)
    elif _version(torch_version) < (2, 12):  # it came first, the old name warned "deprecated"
        order = (ALLOC_VAR, CUDA_ALLOC_VAR)
    else:  # the old name first again (measured on 2.13), even when set to ""
        order = (CUDA_ALLOC_VAR, ALLOC_VAR)
    return next((name for name in order if name in environ), None)


def allocator(environ: Mapping[str, str], torch_version: str, gpu_build: bool) -> list[Finding]:
    """``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_ALLOC_CONF`` that c10 refuses or misreads.

    Examples:
        >>> (f,) = allocator({"PYTORCH_ALLOC_CONF": "expandable_segments:Tru"}, "2.13.0", True)
        >>> f.severity, f.fix
        ('error', 'write expandable_segments:True')
    """
    reads = _reads(torch_version, environ)
    cap: Severity = "warning" if gpu_build else "info"
    findings = []
    for name in (CUDA_ALLOC_VAR, ALLOC_VAR):
        value = environ.get(name)
        other = environ.get(ALLOC_VAR if name == CUDA_ALLOC_VAR else CUDA_ALLOC_VAR)
        if value is None or (value == other and name != reads):  # the same text: say it once
            continue
        problems = _problems(value)
        if not problems:
            continue
        refused = any(p.raises for p in problems)
        if not gpu_build:
            effect = "this torch build has no CUDA, so nothing reads it here; a CUDA build "
            effect += "raises on it at its first CUDA allocation" if refused else "misreads it"
        elif reads is None:
            effect = f"torch {torch_version} does not read {name}, but torch 2.8 and later do"
        elif name != reads:
            effect = f"torch {torch_version} reads {reads} instead, but another version may not"
        elif refused:
            effect = "torch raises on it when its allocator first reads it, at the latest at the "
            effect += "first CUDA allocation"
        else:
            effect = "torch reads it without a word"
        title = "has a setting torch refuses" if refused else "is read differently than written"
        findings.append(
            Finding(
                "error" if refused and gpu_build and name == reads else cap,
                f"{name} {title}",
                f"{name}={safe_text(repr(value))}: "
                + "; ".join(safe_text(p.why) for p in problems)
                + f"; {effect}",
                "; ".join(dict.fromkeys(safe_text(p.fix) for p in problems)),
            )
        )
    return findings + _which_variable(environ, torch_version, reads, cap)


def _which_variable(
    environ: Mapping[str, str], torch_version: str, reads: str | None, cap: Severity
) -> list[Finding]:
    """Both names set to different settings, or the new name on a torch that ignores it."""
    cuda, unified = environ.get(CUDA_ALLOC_VAR), environ.get(ALLOC_VAR)
    if unified is None or cuda == unified:
        return []
    if cuda is None and reads is None:
        return [
            Finding(
                cap,
                f"torch {torch_version} does not read {ALLOC_VAR}",
                f"torch reads {ALLOC_VAR} from version 2.8 on; this one reads only "
                f"{CUDA_ALLOC_VAR}, so {ALLOC_VAR}={safe_text(repr(unified))} changes nothing",
                f"set {CUDA_ALLOC_VAR} instead, or upgrade torch",
            )
        ]
    if cuda is None:
        return []
    ignored = ALLOC_VAR if reads == CUDA_ALLOC_VAR else CUDA_ALLOC_VAR
    return [
        Finding(
            cap,
            f"{CUDA_ALLOC_VAR} and {ALLOC_VAR} are both set, to different settings",
            f"torch {torch_version} reads only {reads} and ignores {ignored} entirely (torch 2.8 "
            f"to 2.11 read {ALLOC_VAR} first, 2.12 and later {CUDA_ALLOC_VAR}, even when empty)",
            f"put every setting in one of them and unset the other (unset {ignored})",
        )
    ]


def launch_blocking(raw: str | None, gpu_build: bool) -> Finding | None:
    """``CUDA_LAUNCH_BLOCKING=1``: every kernel launch waits for the kernel to finish.

    Examples:
        >>> launch_blocking("1", True).severity, launch_blocking("0", True)
        ('warning', None)
    """
    if raw is None or raw.strip() in ("", "0"):
        return None
    if raw.strip() != "1":
        return Finding(
            "info",
            f"{LAUNCH_VAR} is neither 0 nor 1",
            f"{LAUNCH_VAR}={safe_text(repr(raw))}: CUDA documents only 0 and 1, and torch reads "
            "only those (it ignores this value, with a warning)",
            f"set {LAUNCH_VAR}=1 to debug a CUDA error, else unset it",
        )
    where = "" if gpu_build else "; this torch build has no CUDA, so it matters only elsewhere"
    return Finding(
        "warning" if gpu_build else "info",
        f"{LAUNCH_VAR}=1: every kernel launch waits for the GPU",
        "each launch returns only once its kernel has finished, so the CPU cannot queue work "
        f"ahead of the GPU: timings and throughput are slower than without it{where}",
        f"fine for debugging (a CUDA error then points at the line that caused it); unset "
        f"{LAUNCH_VAR} otherwise",
    )


def claims_dir(raw: str | None) -> Finding | None:
    """``DEVICEKIT_CLAIMS_DIR`` that ``claim=True`` would refuse, or that splits jobs apart.

    A relative path names a different directory for each working directory, so
    jobs started from different folders would not see each other's claims;
    ``claims_directory()`` refuses it, as it refuses a directory that is not
    the user's own or that others can write to. Nothing is created here.

    Examples:
        >>> print(claims_dir("claims").title)
        DEVICEKIT_CLAIMS_DIR is a relative path
    """
    name = _claimfiles.DIR_VAR
    if not raw or _claimfiles.fcntl is None:  # empty is unset; no flock, no claims at all
        return None
    path = Path(os.path.expanduser(raw))
    shown = f"{name}={safe_text(repr(raw))}"
    fix = (
        f"set {name} to an absolute path of a directory of your own on a local disk, the same "
        f"for every job that shares these GPUs, or unset it for /tmp/devicekit-{os.getuid()}"
    )
    if not path.is_absolute():
        try:
            here = f" (here {safe_text(str(Path.cwd() / path))})"
        except OSError:  # the working directory was deleted
            here = ""
        why = (
            f"{shown} names a different directory for each working directory{here}, so jobs "
            "started from different folders do not see each other's claims; "
            "pick_gpu(claim=True) refuses it"
        )
        return Finding("warning", f"{name} is a relative path", why, fix)
    problem = _unusable(path)
    if problem is None:
        return None
    return Finding(
        "warning",
        f"{name} cannot hold GPU claims",
        f"{shown}: {problem}, so pick_gpu(claim=True) fails",
        fix,
    )


def _unusable(path: Path) -> str | None:
    """Why ``claims_directory()`` would refuse or fail to create ``path``; None if neither."""
    try:
        info = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        parent = next(p for p in path.parents if os.path.lexists(p))
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            return f"it does not exist, and cannot be created in {safe_text(str(parent))}"
        return None
    except OSError as error:
        return f"it cannot be looked at ({error.strerror or error})"
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        return f"it is {_claimfiles._describe(info)}, not a directory of this user's"
    if stat.S_IMODE(info.st_mode) & 0o022:
        return f"other users can write to it (mode {stat.S_IMODE(info.st_mode):o})"
    if not os.access(path, os.W_OK | os.X_OK):
        return "this user cannot create files in it"
    return None


def environment(environ: Mapping[str, str], torch_version: str, gpu_build: bool) -> list[Finding]:
    """Every finding of this module, for ``doctor``."""
    blocking = launch_blocking(environ.get(LAUNCH_VAR), gpu_build)
    claims = claims_dir(environ.get(_claimfiles.DIR_VAR))
    return [
        *(f for f in (blocking, claims) if f is not None),
        *allocator(environ, torch_version, gpu_build),
    ]
