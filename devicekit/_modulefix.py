"""The fixes `check_module` writes: for each plain attribute, how to register what it holds.

What ``module.to()`` moves in the module under inspection (`Registered`), what
was found in one attribute and where (`Leaf`), and the fix, as code that runs
as written (`Places`): a name it suggests is one ``register_buffer()`` takes
and the module has not got (`_made()`), a container it suggests takes what the
attribute holds (``nn.ModuleDict`` no int key, ``nn.ParameterList`` no module),
and what no registry takes is said so (a tensor used as a dict key).
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from ._census import storage_identity
from ._format import plural, shorten
from ._submodules import named_held, named_submodules

__all__ = ["KEY", "Leaf", "Places", "Registered"]


class Registered:
    """What ``module.to()`` moves in the tree under inspection, by ``id()``.

    Each set is built the first time a plain attribute needs it, so a clean
    module pays for none of them.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module
        self.loose: dict[int, str] = {}
        """The tensors of modules held in plain attributes (registered nowhere) -> name."""

    @functools.cached_property
    def modules(self) -> frozenset[int]:
        return frozenset(id(module) for _, module in named_submodules(self._module))

    @functools.cached_property
    def parameters(self) -> frozenset[int]:
        return frozenset(id(p) for _, p in named_held(self._module, "_parameters"))

    @functools.cached_property
    def shapes(self) -> dict[tuple[tuple[int, ...], torch.dtype], tuple[str, torch.device]]:
        """Each parameter's shape and dtype -> the first one's dotted name and device.

        To name the parameter an old one, left in a plain attribute by a move that
        made new parameters (``to('meta')``, ``to_empty()``), most likely stood for.
        """
        shapes: dict[tuple[tuple[int, ...], torch.dtype], tuple[str, torch.device]] = {}
        for name, parameter in named_held(self._module, "_parameters"):
            shapes.setdefault((tuple(parameter.shape), parameter.dtype), (name, parameter.device))
        return shapes

    @functools.cached_property
    def buffers(self) -> dict[int, str]:
        """``id()`` -> dotted name, for the message."""
        return {id(buffer): name for name, buffer in named_held(self._module, "_buffers")}

    @functools.cached_property
    def memory(self) -> dict[int, str]:
        """Each parameter's and buffer's memory (its storage) -> dotted name."""
        owners: dict[int, str] = {}
        named = list(named_held(self._module, "_parameters", "_buffers"))
        for name, tensor in reversed(named):  # the first name wins, as in named_parameters()
            key = storage_identity(tensor)
            if key is not None:
                owners[key] = name
        return owners


def describe_tensor(attr: str, value: torch.Tensor, places: Places) -> str:
    registered = places.registered  # not a parameter of it (_leaves): moved in place
    buffer = registered.buffers.get(id(value))
    if buffer is not None:
        return (
            f"the buffer {buffer!r} held again as a plain attribute; module.to() replaces "
            f"buffers with moved copies, so this one stays the old {value.device} tensor. "
            "Read the buffer through its module instead (a @property can keep this name)."
        )
    if id(value) in registered.loose:
        return _FOLLOW.format("a plain reference to a tensor", registered.loose[id(value)])
    key = storage_identity(value)
    owner = None if key is None else registered.memory.get(key)
    if owner is not None:  # a view (self.row = self.fc.weight[0]): a buffer would be a copy
        return (
            f"a {value.device} tensor held as a plain attribute that shares its memory with "
            f"{owner!r} (a view or an alias of it); module.to() gives {owner!r} new memory, "
            f"so this one stays the old {value.device} tensor. Compute it from {owner!r} "
            "where it is used, in forward() or a @property."
        )
    name = attr if attr.isidentifier() else _made(attr, places.taken)  # register_buffer's
    if isinstance(value, torch.nn.Parameter):  # object.__setattr__ hid it from the module
        return (
            f"an nn.Parameter on {value.device} held as a plain attribute, not registered; "
            f"module.to() will not move it, and module.parameters() (so the optimizer) and "
            f"state_dict() leave it out. Register it: self.{name} = nn.Parameter(...) (a "
            "plain assignment registers it; object.__setattr__ does not), or "
            f"self.register_parameter({name!r}, ...) in its place."
        )
    return (
        f"a {value.device} tensor held as a plain attribute; module.to() will not move it. "
        f"Use self.register_buffer({name!r}, ...) (or nn.Parameter if it should be trained)."
    )


_FOLLOW = (
    "{} of a module held as a plain attribute, not registered ({!r}), which module.to() does "
    "not move either: register that module instead (its own finding says how); module.to() "
    "then moves its parameters in place, so a reference follows (read a buffer through it)."
)
# What nn.ModuleDict and nn.ParameterDict say of a key they refuse, or break on.
_REFUSED = "its keys must be str, without '.', and not one of its own attribute names like 'keys'"
_OTHER = object()  # a key that is neither a str nor an int


def _expression(path: str) -> str:
    """A module path as Python reads it: ``model.blocks[0].attn`` for ``blocks.0.attn``.

    An index (a child of ``nn.Sequential`` or ``nn.ModuleList``) is subscripted,
    and so is a name no attribute can have (an ``nn.ModuleDict`` key like ``"a-b"``).
    """
    parts = []
    for part in path.split("."):
        held = _HELD.match(part)  # a module in a plain container: "blocks[0]", written so
        if part.isdigit():
            parts.append(f"[{part}]")
        elif part.isidentifier() or held is not None:
            parts.append(f".{part}")
        else:
            parts.append(f"[{part!r}]")
    return "model" + "".join(parts)


# An attribute and the items it was reached through, as `Leaf.path` writes them.
_HELD = re.compile(r"[A-Za-z_]\w*(\[[^\]]*\])+")


def _made(text: str, taken: set[str]) -> str:
    """A name ``register_buffer()`` takes, made of ``text``: no dot, none ``taken`` already.

    Word characters only (a bracket it takes, but ``self.name`` could not read
    it), with ``_2``, ``_3``... added to a name the module has (an attribute,
    a method) or one suggested before.
    """
    base = re.sub(r"\W+", "_", text).strip("_") or "tensor"
    name, count = base, 1
    while name in taken:
        count += 1
        name = f"{base}_{count}"
    taken.add(name)
    return name


class Places:
    """The fix for one plain attribute, from where each tensor and module lies in it."""

    def __init__(
        self,
        attr: str,
        value: object,
        taken: set[str],
        registered: Registered,
        *,
        where: str | None = None,
        owner: str = "the module",
    ) -> None:
        self.attr, self.value, self.taken, self.registered = attr, value, taken, registered
        self.where = attr if where is None else where  # the path from the checked module
        self.owner = owner  # the class whose instance holds the attribute
        kind = type(value).__name__
        self.a_kind = f"{'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind}"

    def describe(self, modules: list[Leaf], tensors: list[Leaf]) -> str:
        if isinstance(self.value, torch.Tensor):
            return describe_tensor(self.attr, self.value, self)
        if isinstance(self.value, torch.nn.Module):  # set with object.__setattr__
            # Module.__setattr__ registers a module and drops the plain attribute of
            # that name, so assigning the attribute to itself registers it at once.
            return (
                f"a {type(self.value).__name__} module held as a plain attribute, not "
                "registered (set with object.__setattr__ or through __dict__); module.to() "
                f"will not move it. Register it: in {self.owner}.__init__ assign it the usual "
                f"way, self.{self.attr} = ..., or on this model now: "
                f"{_expression(self.where)} = {_expression(self.where)}."
            )
        keys = [leaf for leaf in (*modules, *tensors) if leaf.in_key]
        kept = [leaf for leaf in modules if not leaf.in_key]
        owned = [leaf for leaf in tensors if not leaf.in_key and self._owner(leaf)]
        plain = [leaf for leaf in tensors if not leaf.in_key and not self._owner(leaf)]
        held, lost = _held(tensors)
        if modules:
            text = (
                f"{self.a_kind} holding {plural(len(modules), 'module')} as a plain attribute; "
                "module.to() will not move them and their parameters are not registered."
                + (f" {self._modules_fix(kept)}" if kept else "")
                + (f" It holds {held} besides{lost}." if tensors else "")
            )
        else:
            text = f"{self.a_kind} of {held} held as a plain attribute; module.to() will not "
            text += f"move them{lost}."
        whole = len(modules) + len(tensors)
        if keys:
            text += f" {self._keys_fix(keys, whole)}"
        if plain:
            fix = self._tensors_fix(plain, alone=not kept)
            text += f" For the others, {fix[0].lower()}{fix[1:]}" if keys or owned else f" {fix}"
        if owned:
            text += f" {self._owned_fix(owned, whole)}"
        stale = [leaf for leaf in plain if isinstance(leaf.value, torch.nn.Parameter)]
        if stale:
            text += self._stale_note(stale)
        return text

    def _stale_note(self, stale: list[Leaf]) -> str:
        """Where ``stale``'s nn.Parameters, none of them the module's, may come from; or "".

        Never registered, or the module's own before a move that made new
        parameters and left these in the attribute (``to('meta')``,
        ``to_empty()``, ``load_state_dict(assign=True)``): then registering
        them would train copies the forward never reads, and the fix is to make
        the attribute again from the module's parameters. Said only where the
        module has a parameter of the first one's shape and dtype, which it may
        have stood for; else it was never registered, and the fix says so.
        """
        first = stale[0]
        twin = self.registered.shapes.get((tuple(first.value.shape), first.value.dtype))
        if twin is None:  # no parameter of the module it could have stood for: never registered
            return ""
        one = len(stale) == 1
        it, was, its = (
            ("it", "it was", "its module") if one else ("they", "they were", "their modules")
        )
        return (
            f" {it.capitalize()} {'is' if one else 'are'} not among the module's parameters: "
            f"either {was} never registered (then the fix above), or {it} "
            f"{'is' if one else 'are'} left from before a move that made new parameters "
            "(.to('meta'), .to_empty(), load_state_dict(..., assign=True); the module's "
            f"{twin[0]!r} has the shape and dtype of {self.attr}{first.path}, and is on "
            f"{twin[1]}): then make {self.attr} again from the module's parameters after moving "
            f"it, or read {it} through {its} where used."
        )

    def _modules_fix(self, modules: list[Leaf]) -> str:
        shape, bad = _shape(modules), self._refused_key(modules)
        keyed = "" if bad is None else f" with str keys (it refuses {bad}: {_REFUSED})"
        if shape == "flat":
            return f"Use nn.Module{'Dict' if isinstance(self.value, Mapping) else 'List'}{keyed}."
        if shape == "nested":
            return (
                f"Use nn.ModuleDict{keyed} for each dict in it and nn.ModuleList for each list, "
                "nested in the same shape (they are modules, so they nest)."
            )
        return (
            "Register each one with self.add_module(name, module), e.g. "
            f"self.add_module({self._name(modules[0])!r}, ...)."
        )

    def _tensors_fix(self, tensors: list[Leaf], *, alone: bool) -> str:
        trained = sum(isinstance(leaf.value, torch.nn.Parameter) for leaf in tensors)
        every = trained == len(tensors)
        container = "nn.ParameterDict" if isinstance(self.value, Mapping) else "nn.ParameterList"
        call = "parameter" if isinstance(tensors[0].value, torch.nn.Parameter) else "buffer"
        example = f"self.register_{call}({self._name(tensors[0])!r}, ...)"
        if trained and not every:
            example += (
                ", with self.register_parameter() for an nn.Parameter and "
                "self.register_buffer() for the others"
            )
        shape = _shape(tensors)
        if shape != "flat" or not alone:
            inside = "nested containers" if shape == "nested" else self.a_kind
            return (
                "nn.ParameterDict and nn.ParameterList register only the tensors directly "
                f"in them, not those inside {inside}"
                if alone
                else "nn.ModuleList and nn.ModuleDict hold modules only"
            ) + f": register each tensor under a name made from its place, e.g. {example}."
        bad = self._refused_key(tensors)
        if bad is not None:
            return (
                f"Use {container} with str keys{'' if every else ' for trainable tensors'} (it "
                f"refuses {bad}: {_REFUSED}), or register each one, e.g. {example}."
            )
        if every:
            return f"Use {container} to register them."
        how = (
            ": self.register_parameter() for an nn.Parameter, self.register_buffer() for the others"
            if trained
            else " with self.register_buffer()"
        )
        return f"Use {container} for trainable tensors, or register each one{how}."

    def _keys_fix(self, keys: list[Leaf], whole: int) -> str:
        first, name = keys[0].value, self._name(keys[0])
        subject = _subject(len(keys), whole, "a dict's key (or in one)", "dicts' keys")
        if isinstance(first, (torch.nn.Module, torch.nn.Parameter)):
            call = "add_module" if isinstance(first, torch.nn.Module) else "register_parameter"
            return (
                f"{subject}: register each where it is made, e.g. self.{call}({name!r}, ...); "
                "module.to() moves a registered one in place, so the key follows."
            )
        return (
            f"{subject}, and no registry takes a tensor as a key (nn.ParameterDict's keys are "
            "str; module.to() replaces a buffer, so a key would stay the old tensor): key the "
            f"dict by str or int instead, and register each such tensor, e.g. "
            f"self.register_buffer({name!r}, ...)."
        )

    def _owned_fix(self, owned: list[Leaf], whole: int) -> str:
        buffers = [self.registered.buffers.get(id(leaf.value)) for leaf in owned]
        name = next((name for name in buffers if name), None)
        if name is None:  # tensors of modules registered nowhere
            subject = _subject(len(owned), whole, "a tensor", "tensors")
            return _FOLLOW.format(subject, self.registered.loose[id(owned[0].value)])
        return (
            f"{_subject(len(owned), whole, 'a buffer', 'buffers')} of the model ({name!r}): "
            "module.to() replaces buffers with moved copies, so a reference keeps the old "
            "tensor. Read each through its module instead."
        )

    def _owner(self, leaf: Leaf) -> bool:
        """Whether ``leaf`` is a buffer of the model, or a tensor of a loose module."""
        return id(leaf.value) in self.registered.buffers or id(leaf.value) in self.registered.loose

    def _refused_key(self, leaves: list[Leaf]) -> str | None:
        """The first key on the way to ``leaves`` that a module or parameter dict refuses."""
        for found in leaves:
            step: Leaf = found
            while step.up is not None:
                if step.path[len(step.up.path)] == "[" and isinstance(step.up.value, Mapping):
                    key, text = _key(step.path[len(step.up.path) :])
                    if _refused(key):
                        return text
                step = step.up
        return None

    def _name(self, leaf: Leaf) -> str:
        """A name made from the attribute and ``leaf``'s place in it, for register_buffer()."""
        parts = []
        while leaf.up is not None:
            container, suffix = leaf.up.value, leaf.path[len(leaf.up.path) :]
            if leaf.in_key and not leaf.up.in_key:  # a dict's n-th key
                parts.append(f"key_{_position(container, leaf.value, key=True)}")
            elif suffix[0] == "[" and isinstance(container, Mapping):
                key, _ = _key(suffix)
                parts.append(str(_position(container, leaf.value) if key is _OTHER else key))
            else:
                parts.append(suffix)
            leaf = leaf.up
        words = (re.sub(r"\W+", "_", part).strip("_") for part in (self.attr, *reversed(parts)))
        return _made("_".join(word for word in words if word), self.taken)


def _refused(key: object) -> bool:
    """Whether ``nn.ModuleDict`` or ``nn.ParameterDict`` refuses ``key`` (or breaks on it)."""
    return not isinstance(key, str) or not key or "." in key or key in _dict_names()


@functools.cache
def _dict_names() -> frozenset[str]:  # what they have: a key so named is refused
    return frozenset(dir(torch.nn.ModuleDict())) | frozenset(dir(torch.nn.ParameterDict()))


def _key(suffix: str) -> tuple[object, str]:
    """The key a path's step into a dict names: a str or int (else `_OTHER`), and as written.

    Read back from the path, which names a str or int by its repr
    (`key_text()`), with ``ast.literal_eval``: reading the dict again cost its
    length per tensor in it (a vocabulary's 150,000 entries).
    """
    text = suffix[1:-1]
    if text[:1] in ("'", '"') or text.lstrip("-")[:1].isdigit():
        try:
            key = ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):  # another repr
            key = _OTHER
        if type(key) in (str, int):
            return key, text
    return _OTHER, shorten(" ".join(text.split()), 60)


def _position(container: Mapping[Any, Any], obj: object, *, key: bool = False) -> int:
    """Which of ``container``'s keys (or values) ``obj`` is, counting from 0."""
    found: Iterable[Any]
    if isinstance(container, dict):  # a subclass's too, as its base stores them
        found = dict.keys(container) if key else dict.values(container)
    else:
        found = container.keys() if key else container.values()
    return next((n for n, each in enumerate(found) if each is obj), 0)


def _subject(count: int, whole: int, one: str, many: str) -> str:
    if count == whole:
        return f"It is {one}" if count == 1 else f"They are {many}"
    return f"{count} of them {'is' if count == 1 else 'are'} {one if count == 1 else many}"


def _held(tensors: list[Leaf]) -> tuple[str, str]:
    """``2 tensors on cpu``, and what module.parameters() leaves out of them."""
    devices = ", ".join(sorted({str(leaf.value.device) for leaf in tensors}))
    trained = sum(isinstance(leaf.value, torch.nn.Parameter) for leaf in tensors)
    every = trained == len(tensors)
    lost = ""
    if trained:
        them = "them" if every else f"its {plural(trained, 'nn.Parameter')}"
        lost = f", and module.parameters() (so the optimizer) and state_dict() leave {them} out"
    return f"{plural(len(tensors), 'nn.Parameter' if every else 'tensor')} on {devices}", lost


def _shape(leaves: Sequence[Leaf]) -> str:
    """How deep the leaves sit in their container.

    ``"flat"``: each is an item of the container itself (what nn.ParameterDict,
    nn.ParameterList, nn.ModuleDict and nn.ModuleList hold); ``"nested"``: items
    of items; ``"other"``: some are attributes (a dataclass's fields) or set members.
    """
    if not all(leaf.items_only for leaf in leaves):
        return "other"
    return "flat" if all(leaf.depth == 1 for leaf in leaves) else "nested"


class Leaf(NamedTuple):
    """A tensor or module found in a plain attribute, and where."""

    path: str
    """Its path in the attribute (``['a'][0]``)."""
    value: Any
    depth: int
    """How many containers down: 1 for an item of the attribute itself."""
    items_only: bool
    """Whether every step down was to an item (``[key]``), none to an attribute or set member."""
    up: Leaf | None
    """Where its container was found: None for the attribute itself."""
    in_key: bool
    """Whether it is a dict's key, or inside one (a tuple used as a key)."""


KEY = "[key "  # how a path names a dict's key itself (bulk_children(), _elements())
