"""Whether torch's error on a checkpoint in torch's format means the file is cut short or damaged.

torch's reader trusts the archive's directory and checks no CRC-32, so a
damaged file fails with whatever error its reader or unpickler meets first: a
file cut short inside its last records gets ``OSError: [Errno 22] Invalid
argument`` (a seek to a negative offset; ``ValueError: negative seek value``
from a ``BytesIO``), and a flipped byte in ``data.pkl`` gets ``Unsupported
operand 151``, with the advice to turn ``weights_only`` off, or ``Trying to
resize storage that is not resizable``. After such a failure ``load()`` has
`_ziparchive` check the archive; `told` says what it found. Where the archive
is whole (and for torch's legacy format, which has no directory), `damaged`
tells from torch's error alone whether it means bad bytes.
"""

from __future__ import annotations

import pickle
import pickletools
import re
import struct

import torch

from ._format import shorten
from ._ziparchive import Damage

__all__ = ["damaged", "told", "torch_said"]

# What torch's readers say about bad bytes in a file of its own format. A RuntimeError
# saying anything else (a device that does not exist, out of memory) is not the file's fault.
_DAMAGED = (
    "PytorchStreamReader",
    "inline_container",
    "unexpected EOF",
    "corrupt",
    "wrong byte size",
    "record size",
    "hasRecord",
    "magic number",
    "protocol version",
    "unsupported pickle protocol",
)


def told(error: BaseException, damage: Damage) -> str:
    """The message's end for a zip archive cut short or damaged, with torch's error in brief."""
    if damage.cut:
        return (
            f" ({torch_said(error)}): it is cut short: {damage.detail}, so its save stopped "
            "part way (a writer killed, a disk full, a copy interrupted). Save it again, or "
            "copy it again from a whole one"
        )
    return (
        f" ({torch_said(error)}): it is damaged: {damage.detail}, so bytes in it changed "
        "after it was saved (a disk, memory or copy error). Copy it again from a good copy, "
        "or save it again"
    )


def torch_said(error: BaseException) -> str:
    r"""Torch's error in a few words, for the message: its type, then its first line.

    Of a ``weights_only`` refusal, the unpickler's own words, not torch's advice.

    Examples:
        >>> torch_said(EOFError()), torch_said(struct.error("unpack requires 8 bytes"))
        ('EOFError: the data ends early', 'struct.error: unpack requires 8 bytes')
        >>> torch_said(pickle.UnpicklingError("Weights only load failed. Re-running ... "
        ...     "WeightsUnpickler error: \n\nUnsupported operand 151\n\nCheck the docs"))
        'UnpicklingError: Unsupported operand 151'
        >>> torch_said(pickle.UnpicklingError("\x1b[1mdo this only if you trust it\x1b[0m."))
        'UnpicklingError: do this only if you trust it.'
    """
    kind = "struct.error" if isinstance(error, struct.error) else type(error).__name__
    text = _ESCAPES.sub("", str(error)).strip()  # torch's bold, unreadable in logs and notebooks
    if _WEIGHTS_ONLY in text:
        text = text.partition(_WEIGHTS_ONLY)[2].strip()
    if text:
        return f"{kind}: {shorten(text.splitlines()[0], 120)}"
    return f"{kind}: the data ends early" if isinstance(error, EOFError) else kind


# Pickle's opcodes, by their byte (as a character), with the protocol that brought each.
_OPCODES = {opcode.code: opcode for opcode in pickletools.opcodes}

# A terminal's escape codes (torch's weights_only refusal sets its warning in bold).
_ESCAPES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

# Where torch's weights_only refusal, after its advice, says what its unpickler met.
_WEIGHTS_ONLY = "WeightsUnpickler error:"


def damaged(error: BaseException, head: bytes | None = None) -> bool:
    r"""Whether torch's error, on a file in torch's format (first bytes ``head``), means bad bytes.

    A ``weights_only`` refusal does only where the opcode it names is none, or one
    newer than the pickle protocol the file declares: what a flipped byte makes.

    Examples:
        >>> refusal = pickle.UnpicklingError("Weights only load failed: Unsupported operand 151")
        >>> damaged(refusal, b"\x80\x02\x8a\x0al"), damaged(refusal, b"\x80\x05\x95")
        (True, False)
    """
    if isinstance(error, pickle.UnpicklingError):
        text = str(error)
        if not text.startswith("Weights only load failed"):
            return True
        found = re.search(r"Unsupported operand (\d+)", text)
        if found is None or head is None:
            return False
        opcode = _OPCODES.get(chr(int(found.group(1))))
        protocol = head[1] if head[:1] == b"\x80" and len(head) > 1 else 1  # PROTO, or text
        return opcode is None or opcode.proto > protocol
    if isinstance(error, MemoryError):
        return False  # the machine's, unless the archive's CRC-32s show damage
    if isinstance(error, (RuntimeError, ValueError)) and not isinstance(
        error, torch.OutOfMemoryError
    ):
        text = str(error)
        return isinstance(error, UnicodeDecodeError) or any(words in text for words in _DAMAGED)
    return True  # KeyError, EOFError, IndexError, struct.error: the unpickler read bad bytes
