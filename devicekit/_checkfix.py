"""The message `assert_same_device()` raises: each device with its paths, then the fix."""

from __future__ import annotations

from collections.abc import Mapping, Sized
from typing import Any

import torch

from ._format import article, plural
from ._modulecheck import check_module
from ._movecalls import waits_for

__all__ = [
    "ATTRIBUTE",
    "DICT_KEY",
    "KEPT",
    "MOVED",
    "Held",
    "Holder",
    "Path",
    "attribute_fix",
    "inside",
    "mismatch_message",
    "render",
]


_SHOWN_PER_DEVICE = 5  # paths listed per device before "... and N more"
_SHOWN_HOLDERS = 3  # objects to_device() leaves alone named in a fix, per argument

# Where a tensor is: (where its container is, or None for an argument; its suffix there).
# Made into text only for the paths a message shows: a check that passes makes none, and
# a chain 100,000 objects deep costs no 100,000 ever longer strings.
Path = tuple["Path | None", str]
# The outermost object around a tensor that children() does not know, looked inside
# attribute by attribute: its path, its class, and what moves it: MOVED, its own
# .to() (to_device()'s whole say: the fix moves the argument); KEPT, nothing (to_device()
# returns it unchanged); ATTRIBUTE, nothing either: a module's plain attributes, which
# module.to() leaves where they are (the holder is the module); DICT_KEY, nothing: the
# keys of a dict given as it is, whose values to_device() moves, never its keys (the
# holder is the dict).
Holder = tuple[Path, type, str]
MOVED, KEPT, ATTRIBUTE, DICT_KEY = "moved", "kept", "attribute", "dict key"
# A tensor the fix moves apart from its argument: its device, its holder's path, class
# and kind, and the tensor's path.
Held = tuple[torch.device, str, type, str, Path]


def render(path: Path) -> str:
    """A path as text: ``batch['h'][0].x``."""
    suffixes = []
    node: Path | None = path
    while node is not None:
        node, suffix = node
        suffixes.append(suffix)
    return "".join(reversed(suffixes))


def mismatch_message(
    where: dict[torch.device, list[Path]],
    owners: dict[str, set[torch.device]],
    named: dict[str, Any],
    expected: torch.device | None = None,
    *,
    said: str = "device=",
    held: dict[str, list[Held]] | None = None,
    on_meta: dict[str, tuple[list[Path], int]] | None = None,
) -> str:
    # Strays first: the tensors off the expected device, else the smallest groups.
    groups = sorted(where.items(), key=lambda item: (item[0] == expected, len(item[1])))
    found = ", ".join(f"{device} ({_count(paths)})" for device, paths in groups)
    if expected is None:
        lines = [f"expected every tensor on one device, found {len(groups)}: {found}"]
    else:
        lines = [
            f"expected every tensor on {expected} ({said}), found them on "
            f"{plural(len(groups), 'device')}: {found}"
        ]
    for device, paths in groups:
        lines.extend(f"  {render(path)}: {device}" for path in paths[:_SHOWN_PER_DEVICE])
        if len(paths) > _SHOWN_PER_DEVICE:
            lines.append(f"  ... and {len(paths) - _SHOWN_PER_DEVICE} more on {device}")
    lines.extend(_fix(where, owners, named, expected, held=held, on_meta=on_meta))
    return "\n".join(lines)


def _fix(
    where: Mapping[torch.device, Sized],
    owners: dict[str, set[torch.device]],
    named: dict[str, Any],
    expected: torch.device | None = None,
    *,
    held: dict[str, list[Held]] | None = None,
    on_meta: dict[str, tuple[list[Path], int]] | None = None,
) -> list[str]:
    """What to run: every argument that is not all on the target, moved there.

    ``owners`` has each argument's devices but for its tensors in ``held``:
    those inside an object ``to_device()`` returns unchanged, which only the
    user can move (or make again) where they belong.

    ``on_meta`` has, for each argument, the paths of those of its tensors
    (``owners``') that are on meta, and how many it has in all. A module with
    others beside them (loaded in part under ``init_empty_weights`` or
    ``low_cpu_mem_usage``) is told to give its meta tensors values, not to run
    ``to_empty()``, which would discard the values of all the others (the
    trained weights). Where it is not given, every such tensor is on meta.
    """
    if expected is not None:
        target = expected  # the caller said where: even meta (a model built without weights)
    else:
        # The target is where the work should run: the accelerator that holds the most,
        # else the CPU. Never meta: its tensors hold no values, so nothing can run there.
        accelerators = [device for device in where if device.type not in ("cpu", "meta")]
        target = max(
            accelerators, key=lambda device: len(where[device]), default=torch.device("cpu")
        )
    stuck = target.type != "meta"  # meta tensors cannot be copied anywhere else: no data
    steps = []
    partly = False  # a module with values beside its meta tensors: to_empty() would lose them
    for name, obj in named.items():
        devices = owners.get(name, set())
        moved = not devices <= {target}  # a step below moves the argument
        steps.extend(_held_steps(name, (held or {}).get(name, []), target, named, moved=moved))
        if not moved:
            continue
        empty = stuck and torch.device("meta") in devices
        if isinstance(obj, torch.nn.Module):
            metas, count = (on_meta or {}).get(name, ([], 0))
            if empty and 0 < len(metas) < count:
                partly = True
                steps.append(_partly_meta_step(name, metas, count, devices, target))
            elif empty:
                steps.append(f"{name}.to_empty(device='{target}'), then load its weights")
            else:
                steps.append(f"{name}.to('{target}')")
        elif empty:
            steps.append(f"make {name} again on {target} (its meta tensors hold no values to copy)")
        else:
            steps.append(f"{name} = dk.to_device({name}, '{target}')")
    fix = [f"Fix: move everything to {target}: {'; '.join(steps)}."]
    if stuck and torch.device("meta") in where:
        fix.append(
            "Tensors on meta hold no values (shapes only): make them on a real device, or "
            + (
                "load values into a model's with load_state_dict(..., assign=True); "
                "to_empty() discards the values of every tensor of a model, so it is for one "
                "whose every tensor is on meta."
                if partly
                else "materialize a model with to_empty() and load its weights."
            )
        )
    return fix


def _partly_meta_step(
    name: str, metas: list[Path], count: int, devices: set[torch.device], target: torch.device
) -> str:
    """The step for module ``name``, which holds values beside its ``metas`` on meta.

    ``to_empty()`` would make every one of its ``count`` tensors anew, with no
    values: the trained ones too. Those on meta are given values instead,
    from a state dict (``assign=True`` puts them in place of the meta ones);
    then, where the others are not all on ``target``, the module is moved.
    """
    shown = ", ".join(render(path) for path in metas[:_SHOWN_PER_DEVICE])
    more = f" and {len(metas) - _SHOWN_PER_DEVICE} more" if len(metas) > _SHOWN_PER_DEVICE else ""
    others = count - len(metas)
    then = "" if devices - {torch.device("meta")} <= {target} else f", then {name}.to('{target}')"
    them = "it" if len(metas) == 1 else "them"
    return (
        f"load values into {name}'s {plural(len(metas), 'tensor')} on meta ({shown}{more}): "
        f"{name}.load_state_dict(state_dict, strict=False, assign=True) with a state dict "
        f"holding {them} on {target} (the checkpoint's, for a model loaded in part under "
        "init_empty_weights or low_cpu_mem_usage), or make again a submodule whose tensors "
        f"are all on meta{then}; not {name}.to_empty(), which would discard the values of its "
        f"other {plural(others, 'tensor')}"
    )


def _held_steps(
    name: str,
    held: list[Held],
    target: torch.device,
    named: dict[str, Any],
    *,
    moved: bool = False,
) -> list[str]:
    """The steps for the strays of ``name`` that moving ``name`` would leave where they are.

    In objects ``to_device()`` returns unchanged, and in a module's plain
    attributes (``moved``: a step of the fix moves ``name`` besides).
    """
    objects: dict[str, tuple[type, str, list[torch.device], list[Path]]] = {}
    for device, holder, cls, kind, path in held:
        if device != target:
            _, _, devices, paths = objects.setdefault(holder, (cls, kind, [], []))
            devices.append(device)
            paths.append(path)
    steps = []
    for holder, (cls, kind, devices, paths) in list(objects.items())[:_SHOWN_HOLDERS]:
        more = f" and {len(paths) - 1} more" if len(paths) > 1 else ""
        class_name = cls.__name__  # not `name`: that is the argument's, for the last step
        remade = target.type != "meta" and torch.device("meta") in devices
        future = waits_for(cls) if kind == KEPT else None
        if future is not None:  # done, it holds its value (a Future's _result): get that
            shown, get = future
            steps.append(
                f"get the value of {holder} ({get}) and "
                f"{f'make it again on {target}' if remade else 'move that'} (it is "
                f"{article(shown)} {shown}, which stands for a value made elsewhere: "
                "dk.to_device() returns it unchanged)"
            )
        elif kind == ATTRIBUTE:
            then = "" if moved else f", then move {holder} to {target}"
            module = named.get(name) if holder == name else None
            steps.append(
                f"for the tensors {holder} holds as plain attributes ({render(paths[0])}{more}), "
                f"which {holder}.to() does not move: "
                f"{attribute_fix(holder, module, inside(holder, paths))}{then}"
            )
        elif kind == DICT_KEY:
            steps.append(
                f"make {holder} again with its tensor keys {'made anew on' if remade else 'on'} "
                f"{target} ({render(paths[0])}{more}), since dk.to_device() moves its "
                "values, never its keys"
                + (", and meta tensors hold no values to copy" if remade else "")
            )
        elif remade:
            steps.append(
                f"make {holder} again on {target} (it is {article(class_name)} {class_name}, which "
                "dk.to_device() returns unchanged, and its meta tensors hold no values to copy)"
            )
        else:
            steps.append(
                f"move the tensors in {holder} ({render(paths[0])}{more}) to {target} yourself, "
                f"or make it there (it is {article(class_name)} {class_name}, which "
                "dk.to_device() returns unchanged)"
            )
    if len(objects) > _SHOWN_HOLDERS:
        steps.append(f"the same for {len(objects) - _SHOWN_HOLDERS} more objects in {name}")
    return steps


def _count(paths: Sized) -> str:
    return "1 tensor" if len(paths) == 1 else f"{len(paths)} tensors"


_FINDINGS_SHOWN = 2  # check_module's findings quoted in one fix


def attribute_fix(holder: str, module: object, strays: list[str]) -> str:
    """How to fix what ``holder`` keeps as plain attributes at ``strays``, as one step.

    ``strays`` are paths inside the module (``blocks[0].weight``).

    ``module`` is the module ``holder`` names, where known: then the fix is
    `check_module`'s own for those attributes (``nn.ModuleList`` for modules
    kept in a list, never a buffer for each of their parameters). Where it
    has none (a tensor inside an object of another class, which it does not
    look in), or ``module`` is unknown, the general fix.
    """
    found: list[str] = []
    if isinstance(module, torch.nn.Module):
        try:
            findings = check_module(module)
        except RuntimeError:  # another thread kept changing an attribute: the general fix
            findings = []
        for finding in findings:
            at = finding.split(": ", 1)[0]
            if any(s == at or s.startswith((f"{at}.", f"{at}[")) for s in strays):
                found.append(finding)
    if found:
        quoted = "; ".join(f'"{finding}"' for finding in found[:_FINDINGS_SHOWN])
        more = len(found) - _FINDINGS_SHOWN
        them = "it" if len(strays) == 1 else "them"
        return f"fix {them} as dk.check_module({holder}) says: {quoted}" + (
            f" (and {more} more)" if more > 0 else ""
        )
    return (
        "keep each in a module, registered (self.register_buffer(), a module in "
        "nn.ModuleList or nn.ModuleDict), not in a plain container or another object, which "
        "module.to() does not look in; or move it where the forward uses it"
    )


def inside(holder: str, paths: list[Path]) -> list[str]:
    """``paths`` (each under ``holder``) as paths inside it: ``blocks[0].weight``."""
    return [render(path)[len(holder) :].lstrip(".") for path in paths]
