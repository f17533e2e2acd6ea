"""Judgements about this machine, each written once, for ``status``, ``doctor`` and the CLI.

A judgement is a function of plain facts (a variable's value, a GPU
snapshot, the torch build) that returns a [`Finding`][devicekit.Finding], or None when there
is nothing to say. [`Status`][devicekit.Status] shows the ones about what this
process can use; [`doctor()`][devicekit.doctor] adds the ones about speed
(those of one GPU are in `_gpufindings`).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

from ._format import (
    UNKNOWN,
    html_table,
    plural,
    safe_text,
)
from ._gpuinfo import GPUInfo
from ._nvmlstart import DEFAULT_TIMEOUT, NVML_SILENT, TIMEOUT_VAR, timeout_seconds
from ._shortrepr import got, short_repr
from ._visible import (
    ASCII_INT,
    ENV_VAR,
    LEADING_INT,
    UUID_PREFIXES,
    comma_fix,
    misreading,
    parse_visible_devices,
    read_as,
    why_number,
)
from ._visiblearg import Unplaced, unplaced

__all__ = [
    "NO_STATUS",
    "NVML_FIX",
    "SEVERITIES",
    "Finding",
    "Severity",
    "bad_nvml_timeout",
    "cuda_reading",
    "device_order",
    "driver_too_old",
    "models",
    "names_no_gpu",
    "no_gpu",
    "no_gpu_reason",
    "nvml_cannot_read",
    "nvml_describes",
    "torch_cannot_use_gpus",
    "unchecked",
    "unplaced_entry",
    "visibility",
]

Severity = Literal["error", "warning", "info"]
SEVERITIES: tuple[Severity, ...] = get_args(Severity)


@dataclass(frozen=True)
class Finding:
    """One thing devicekit found about this machine.

    Attributes:
        severity: ``"error"`` (GPU work will fail or cannot use the GPU),
            ``"warning"`` (it will be slow or fragile) or ``"info"``.
        title: One line.
        detail: What was seen.
        fix: What to do about it.
    """

    severity: Severity
    title: str
    detail: str
    fix: str

    def __post_init__(self) -> None:
        for name in ("severity", "title", "detail", "fix"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"Finding({name}=...) must be a string, got {got(value)}")
        if self.severity not in SEVERITIES:
            raise ValueError(
                f"Finding(severity={self.severity!r}): expected one of "
                f"{', '.join(map(repr, SEVERITIES))}: 'error' where GPU work fails, "
                "'warning' where it is slow or fragile, 'info' otherwise"
            )

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.title}: {self.detail}. Fix: {self.fix}."

    def _repr_html_(self) -> str:
        return html_table(
            [(self.severity, f"{self.title}\n{self.detail}", self.fix)],
            header=("severity", "finding", "fix"),
        )


def visibility(raw: str | None, gpus_on_machine: int) -> Finding | None:
    """``CUDA_VISIBLE_DEVICES`` hides every GPU, or CUDA reads it differently than written.

    Examples:
        >>> print(visibility("0,0", 2))
        CUDA_VISIBLE_DEVICES hides every GPU: CUDA_VISIBLE_DEVICES='0,0' hides all 2 GPUs from \
this process: 0 is listed twice, and any duplicate makes CUDA hide every GPU. Fix: list each \
GPU once, such as CUDA_VISIBLE_DEVICES=0.
    """
    if raw is None:
        return None
    wrong = misreading(raw)
    if wrong is None:
        return None
    if parse_visible_devices(raw) == []:
        if gpus_on_machine > 1:
            hidden = f"all {gpus_on_machine} GPUs"
        else:
            hidden = "the machine's one GPU" if gpus_on_machine else "every GPU"
        return Finding(
            "error" if gpus_on_machine else "info",
            f"{ENV_VAR} hides every GPU",
            f"{ENV_VAR}={raw!r} hides {hidden} from this process: {wrong.why}",
            wrong.fix,
        )
    why = wrong.why
    if not raw.lstrip().startswith(("GPU-", "MIG-")):
        # _visible's "'0\n1' is read as 0" repeats, for one entry, the reading it should
        # explain: say instead what ends the number, and what CUDA drops.
        for entry in (entry.strip() for entry in raw.split(",")):
            if (match := ASCII_INT.match(entry)) and str(int(match.group())) != entry:
                note = f"{short_repr(entry)} is read as {int(match.group())}"
                why = why.replace(note, why_number(entry, int(match.group())))
    reading, cuda = read_as(raw), ",".join(map(str, cuda_reading(raw)))
    if cuda != reading:  # "٣": torch reads 3, CUDA no index
        reading = f"{reading!r} by torch, and by CUDA as {repr(cuda) if cuda else 'no GPU'}"
    else:
        reading = repr(reading)
    return Finding(
        "warning",
        f"{ENV_VAR} is read differently than it is written",
        f"{ENV_VAR}={raw!r} is read as {reading}: {why}",
        comma_fix(raw) or wrong.fix,
    )


def cuda_reading(
    raw: str, placed: int = 0, uuids: Sequence[str | None] = (), gpus_on_machine: int = 0
) -> list[int | str]:
    """The entries CUDA takes from ``raw``: what it reads, up to one that names no GPU here.

    torch reads ``"٣"`` as 3 (`parse_visible_devices`, what ``cuda:N`` means
    before CUDA starts); CUDA reads the digits 0-9 only, and stops at such an
    entry, as `visibility` says. Where NVML lists the GPUs (the arguments
    after ``raw``, as `names_no_gpu` takes them), CUDA stops too at an entry
    that names none of them, or several, and takes nothing after a duplicate.

    Examples:
        >>> cuda_reading("0,٣,1"), cuda_reading("٣"), cuda_reading("1a,0"), cuda_reading("1,5", 1, [], 3)
        ([0], [], [1, 0], [1])
    """  # noqa: E501 - the expected output is one line
    entries = raw.split(",")
    found = unplaced_entry(raw, placed, uuids, gpus_on_machine)
    if not raw.startswith(UUID_PREFIXES):
        for position, entry in enumerate(entries):
            match = LEADING_INT.match(entry.strip())
            if match is not None and not match.group().isascii():
                entries = entries[:position]
                break
    read = parse_visible_devices(",".join(entries)) or []
    return read if found is None else read[: found.used]


def unplaced_entry(
    raw: str | None, placed: int, uuids: Sequence[str | None], gpus_on_machine: int
) -> Unplaced | None:
    """The first entry of ``raw`` that CUDA cannot place here, where devicekit placed fewer GPUs.

    The arguments are `names_no_gpu`'s. None where NVML counts no GPU (or is
    not there): unknown is not wrong.
    """
    entries = None if raw is None else parse_visible_devices(raw)
    if not entries or not gpus_on_machine or placed >= len(entries):
        return None
    return unplaced(entries, gpus_on_machine, uuids)


ORDER_VAR = "CUDA_DEVICE_ORDER"
ORDERS = ("FASTEST_FIRST", "PCI_BUS_ID")  # the two values CUDA documents, spelled exactly


def device_order(raw: str | None) -> Finding | None:
    """``CUDA_DEVICE_ORDER`` is set to neither of the two values CUDA documents.

    A misspelled order (``pci_bus_id``, ``PCI_BUS_ID `` with a space) was
    silently not the order asked for: devicekit, like the documentation,
    honours the exact ``PCI_BUS_ID`` only, so ``cuda:N`` named another GPU
    than the user meant, without a word.

    Examples:
        >>> print(device_order("pci_bus_id").fix)
        set CUDA_DEVICE_ORDER=PCI_BUS_ID (nvidia-smi's order) or unset it (FASTEST_FIRST)
        >>> device_order("PCI_BUS_ID") is None, device_order("") is None
        (True, True)
    """
    if not raw or raw in ORDERS:  # empty reads as unset, as `export CUDA_DEVICE_ORDER=` means
        return None
    return Finding(
        "warning",
        f"{ORDER_VAR} is neither FASTEST_FIRST nor PCI_BUS_ID",
        f"{ORDER_VAR}={safe_text(repr(raw))} is not one of the two values CUDA documents, "
        "FASTEST_FIRST (the default) and PCI_BUS_ID, so cuda:N may not be the GPU meant",
        f"set {ORDER_VAR}=PCI_BUS_ID (nvidia-smi's order) or unset it (FASTEST_FIRST)",
    )


def names_no_gpu(
    raw: str | None, placed: int, uuids: Sequence[str | None], gpus_on_machine: int
) -> Finding | None:
    """An entry of ``CUDA_VISIBLE_DEVICES`` names no GPU here, several, or one named before.

    The entries before it are all this process gets: an error where that is
    none (a duplicate hides every GPU), else a warning. In the words
    `visible_devices()` refuses such an entry with.

    Args:
        raw: The variable as written, or None when unset.
        placed: How many GPUs devicekit places through it (`_gpus.visible_gpus`).
        uuids: The UUID of each GPU NVML lists, None where NVML cannot read it.
        gpus_on_machine: How many GPUs NVML counts (lost ones too); 0 without NVML,
            where nothing is judged (unknown is not wrong).

    Without it, ``CUDA_VISIBLE_DEVICES=5`` on a two-GPU machine read "no driver,
    or no device ... otherwise install the driver", with the driver right there;
    ``GPU-BBBB`` for ``GPU-bbbb...`` did still, and ``1,5`` got no word while the
    job ran on one GPU of the two it listed.

    Examples:
        >>> print(names_no_gpu("5", 0, [], 2).title)
        No GPU: CUDA_VISIBLE_DEVICES names a GPU this machine does not have
        >>> print(names_no_gpu("1,5", 1, [], 3).detail)
        entry 5 in CUDA_VISIBLE_DEVICES='1,5': this machine has 3 GPUs (0 to 2), and CUDA stops \
reading at the first entry it cannot use and ignores the rest; this process sees 1 GPU of the 2 \
listed (cuda:0)
    """
    found = unplaced_entry(raw, placed, uuids, gpus_on_machine)
    if found is None:
        return None
    if found.used:
        entries = parse_visible_devices(raw) or []
        last = "" if found.used == 1 else f" to cuda:{found.used - 1}"
        sees = f"{plural(found.used, 'GPU')} of the {len(entries)} listed (cuda:0{last})"
        severity: Severity = "warning"
        title = f"Fewer GPUs than listed: {ENV_VAR} {found.title}"
    else:
        sees, severity, title = "no GPU", "error", f"No GPU: {ENV_VAR} {found.title}"
    return Finding(
        severity,
        title,
        safe_text(f"{found.subject} in {ENV_VAR}={raw!r}{found.why}; this process sees {sees}"),
        f"{found.fix}, or unset {ENV_VAR}",
    )


def no_gpu(accelerator: str | None, visible: int, nvml_error: str | None) -> Finding | None:
    """Why this process has no accelerator, when it has none."""
    if visible:
        return None
    if accelerator is None:
        return Finding(
            "info",
            "No GPU: this is a CPU-only torch build",
            "dk.try_gpu() returns cpu",
            "install a CUDA or ROCm build of torch to use a GPU",
        )
    if parse_visible_devices() == []:
        return Finding(
            "info",
            f"No GPU: {ENV_VAR} hides every GPU",
            "dk.try_gpu() returns cpu",
            f"unset {ENV_VAR} to see every GPU",
        )
    why = nvml_error or "no driver, or no device"
    return Finding(
        "info",
        f"No GPU: torch is built for {accelerator} but sees no device",
        f"{why}; dk.try_gpu() returns cpu",
        "nothing to fix if that is intended; otherwise install the driver",
    )


NVML_FIX = "fix NVML (nvidia-smi says what fails)"
NO_STATUS = f", so none has a status: {NVML_FIX}"  # follows nvml_cannot_read() where no pick is


def nvml_cannot_read(torch_sees: int, nvml_error: str) -> str:
    """GPUs that torch sees but NVML cannot read, as the start of an error clause.

    Without NVML these GPUs have no status and cannot be ranked, but they are
    there: "no GPU ... install the driver" would send the reader the wrong way.

    Examples:
        >>> nvml_cannot_read(2, "NVML failed to start")
        'torch sees 2 GPUs but NVML cannot read them (NVML failed to start)'
    """
    them = "it" if torch_sees == 1 else "them"
    return f"torch sees {plural(torch_sees, 'GPU')} but NVML cannot read {them} ({nvml_error})"


def nvml_describes(torch_sees: int, names: Iterable[str]) -> str:
    """GPUs torch sees that NVML describes only some of (``names``), as the start of a clause.

    Examples:
        >>> nvml_describes(2, ["cuda:0"]), nvml_describes(2, [])
        ('torch sees 2 GPUs, NVML describes only cuda:0', 'torch sees 2 GPUs, NVML describes none of them')
    """  # noqa: E501 - the expected output is one line
    described = ", ".join(names)
    return (
        f"torch sees {plural(torch_sees, 'GPU')}, NVML describes "
        f"{f'only {described}' if described else 'none of them'}"
    )


def no_gpu_reason(
    accelerator: str | None,
    nvml_error: str | None,
    unusable: int = 0,
    *,
    listed: Finding | None = None,
) -> str:
    """Why this process has no GPU, and the fix, as one clause for an error message.

    Args:
        accelerator: The torch build's accelerator type, or None.
        nvml_error: Why NVML cannot be queried, or None.
        unusable: How many NVIDIA GPUs NVML sees that torch cannot use because
            the build has no CUDA; when any, that is the reason.
        listed: `names_no_gpu`'s finding, where it has one: an error (the
            first entry of ``CUDA_VISIBLE_DEVICES`` names no GPU here) is the
            reason, not "install the driver", with the driver right there.

    Examples:
        >>> no_gpu_reason(None, "libnvidia-ml.so.1 was not found")
        'this is a CPU-only torch build; install a CUDA or ROCm build of torch to use a GPU'
        >>> no_gpu_reason(None, None, unusable=2)
        "this torch build has no CUDA, so it cannot use the machine's 2 NVIDIA GPUs; install a \
CUDA build of torch (pytorch.org/get-started/locally)"
        >>> print(no_gpu_reason("cuda", None, listed=names_no_gpu("5", 0, [], 2)))
        ... # doctest: +ELLIPSIS
        CUDA_VISIBLE_DEVICES names a GPU this machine does not have (entry 5 in ...); ...
    """
    if unusable:
        # A CPU build on a GPU machine: "no GPU" would hide that the GPUs are right there.
        return (
            f"this torch build has no CUDA, so it cannot use the machine's "
            f"{plural(unusable, 'NVIDIA GPU')}; install a CUDA build of torch "
            "(pytorch.org/get-started/locally)"
        )
    if listed is not None and listed.severity == "error":
        return f"{listed.title.removeprefix('No GPU: ')} ({listed.detail}); {listed.fix}"
    finding = no_gpu(accelerator, 0, nvml_error)
    assert finding is not None  # no visible device always has a reason
    reason = finding.title.removeprefix("No GPU: ")
    if accelerator is not None and parse_visible_devices() != []:
        reason += f" ({nvml_error or 'no driver, or no device'})"
    return f"{reason}; {finding.fix}"


def models(names: Iterable[str | None]) -> str:
    """Each GPU model with its count, in the order first seen: ``"1x NVIDIA H100, 1x T4"``.

    Examples:
        >>> models(["NVIDIA H100", "T4", "NVIDIA H100", None])
        '2x NVIDIA H100, 1x T4, 1x ?'
    """
    counts = collections.Counter(safe_text(name or UNKNOWN) for name in names)
    return ", ".join(f"{count}x {name}" for name, count in counts.items())


def torch_cannot_use_gpus(
    torch_version: str, cpu_build: bool, gpus: list[GPUInfo], driver: str | None, cuda: str | None
) -> Finding | None:
    """A CPU build of torch on a machine with NVIDIA GPUs."""
    if not (cpu_build and gpus):
        return None
    return Finding(
        "error",
        "torch is a CPU build, but this machine has NVIDIA GPUs",
        f"{plural(len(gpus), 'GPU')} ({models(info.name for info in gpus)}), driver "
        f"{driver or UNKNOWN}; torch {torch_version} cannot use them",
        f"install a CUDA build of torch for CUDA {cuda or 'your driver version'} or older "
        "(pytorch.org/get-started/locally)",
    )


def driver_too_old(
    torch_version: str, built_for: str | None, supported: str | None, driver: str | None
) -> Finding | None:
    """The driver supports an older CUDA than torch was built for."""
    if not (built_for and supported) or _version(built_for) <= _version(supported):
        return None
    return Finding(
        "error",
        f"torch needs CUDA {built_for}, the driver supports only CUDA {supported}",
        f"driver {driver} is older than torch {torch_version} needs",
        f"update the NVIDIA driver, or install a torch build for CUDA {supported} or older",
    )


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())


# --- what doctor could not look at ---------------------------------------------------------


def bad_nvml_timeout(raw: str | None) -> Finding | None:
    """``$DEVICEKIT_NVML_TIMEOUT`` is no number of seconds, so devicekit waits the default.

    Args:
        raw: The variable as written, or None when unset.

    Examples:
        >>> print(bad_nvml_timeout("1min").fix)
        set DEVICEKIT_NVML_TIMEOUT to seconds above 0, such as 60, or inf for no bound, or \
unset it for the default, 30
        >>> bad_nvml_timeout("60") is None, bad_nvml_timeout(None) is None
        (True, True)
    """
    text = (raw or "").strip()
    if not text or timeout_seconds(text) is not None:
        return None
    return Finding(
        "warning",
        f"{TIMEOUT_VAR} is not a number of seconds above 0",
        f"{TIMEOUT_VAR}={safe_text(repr(raw))}: devicekit waits the default {DEFAULT_TIMEOUT:g} s "
        "instead for NVML to start or to read a GPU",
        f"set {TIMEOUT_VAR} to seconds above 0, such as 60, or inf for no bound, or unset it for "
        f"the default, {DEFAULT_TIMEOUT:g}",
    )


def unchecked(nvml_error: str | None, devices: int) -> Finding | None:
    """NVML cannot read the ``devices`` CUDA GPUs torch sees, so doctor cannot check them.

    Without this, ``doctor`` said "nothing wrong found" about GPUs it never looked at.
    An error where NVML is blocked in the driver (a wedged GPU: a fault, as a
    GPU that stops answering later is); else information (no driver, by choice).

    Examples:
        >>> print(unchecked("the NVIDIA driver is not loaded", 1).title)
        GPUs not checked: NVML is unavailable
        >>> unchecked("NVML did not answer in 30 s: nvmlInit is blocked ...", 2).severity
        'error'
        >>> unchecked(None, 1) is None
        True
    """
    if nvml_error is None or not devices:
        return None
    return Finding(
        "error" if nvml_error.startswith(NVML_SILENT) else "info",
        "GPUs not checked: NVML is unavailable",
        f"{safe_text(nvml_error)}; without NVML, doctor cannot check the {plural(devices, 'GPU')} "
        "torch sees for other processes, held clocks, heat, persistence mode or free memory",
        "make NVML available as the reason says, then run devicekit doctor again",
    )
