from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import re
import sys
import threading
import warnings
import weakref
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit import _checkfix, _checkwalk, _look, _lookbulk, _mover

from .conftest import run_python

META = torch.device("meta")
CUDA0, CUDA1, CPU = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")


def test_returns_the_common_device() -> None:
    model = torch.nn.Linear(2, 2)
    assert dk.assert_same_device(model, {"x": [torch.ones(1)]}, y=torch.ones(1)) == torch.device(
        "cpu"
    )
    assert dk.assert_same_device(torch.ones(1, device="meta")) == META


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")
@pytest.mark.parametrize("typed", [False, True], ids=["untyped", "typed"])
def test_a_storage_is_checked_as_to_device_moves_it(typed: bool) -> None:
    # to_device() moves a storage, but assert_same_device() passed one it never
    # looked at: beside a meta tensor, and alone ("found no tensor").
    tensor = torch.randn(3)
    storage = tensor.storage() if typed else tensor.untyped_storage()
    meta = torch.zeros(1, device="meta")
    with pytest.raises(dk.DeviceMismatchError, match=r"s: cpu"):
        dk.assert_same_device(s=storage, m=meta)
    with pytest.raises(dk.DeviceMismatchError, match=r"arg0\['s'\]: cpu"):
        dk.assert_same_device({"s": storage}, device="meta")
    assert dk.assert_same_device([storage, tensor]) == torch.device("cpu")


def test_mismatch_lists_each_device_with_its_paths() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2)).to("meta")
    batch = {"input": torch.ones(2, device="meta"), "labels": torch.ones(1)}
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.assert_same_device(model=model, batch=batch)
    assert str(info.value) == (
        "expected every tensor on one device, found 2: cpu (1 tensor), meta (3 tensors)\n"
        "  batch['labels']: cpu\n"
        "  model.0.weight: meta\n"
        "  model.0.bias: meta\n"
        "  batch['input']: meta\n"
        "Fix: move everything to cpu: model.to_empty(device='cpu'), then load its weights; "
        "make batch again on cpu (its meta tensors hold no values to copy).\n"
        "Tensors on meta hold no values (shapes only): make them on a real device, or "
        "materialize a model with to_empty() and load its weights."
    )


def test_the_fix_never_copies_out_of_meta() -> None:
    # What the old fix said to run fails: a meta tensor has no data to copy.
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        dk.to_device({"x": torch.ones(1, device="meta")}, "cpu")
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.assert_same_device(x=torch.ones(1), batch={"x": torch.ones(1, device="meta")})
    assert (
        "Fix: move everything to cpu: make batch again on cpu (its meta tensors hold no values "
        in str(info.value)
    )
    assert "dk.to_device(batch" not in str(info.value)


def test_a_misspelled_device_keyword_is_refused_not_checked_as_an_object() -> None:
    # Before, devce="cpu" was one more object to check, holding no tensor: the device
    # meant went unchecked and the meta tensor passed.
    meta = torch.ones(1, device="meta")
    for keywords in [{"devce": "cpu"}, {"Device": 0}, {"devices": "cuda:0"}]:
        ((name, value),) = keywords.items()
        with pytest.raises(
            TypeError,
            match=rf"^assert_same_device\(\) got {name}={value!r}, which holds no tensor to "
            rf"check: .* given as device=; write device={value!r}$",
        ):
            dk.assert_same_device(meta, **keywords)
    with pytest.raises(TypeError, match=r"got arg1=device\(type='cpu'\), .* write device='cpu'$"):
        dk.assert_same_device(meta, torch.device("cpu"))  # a device holds no tensor either
    # A keyword that only starts like it, or a string under another name, is an object.
    assert dk.assert_same_device(meta, device_name="cpu", label="cpu") == meta.device


def test_a_keyword_named_like_a_positional_argument_is_refused() -> None:
    # Before, the keyword replaced the positional tensor, and the stray on meta went unchecked.
    with pytest.raises(
        TypeError,
        match=r"^assert_same_device\(\) got arg0 twice: as positional argument 0 \(which it "
        r"names arg0\) and as a keyword; give the keyword argument another name$",
    ):
        dk.assert_same_device(torch.ones(1, device="meta"), arg0=torch.ones(1))
    assert dk.assert_same_device(torch.ones(1), arg1=torch.ones(1)) == CPU  # no clash


def test_positional_arguments_are_named_arg0_arg1() -> None:
    with pytest.raises(dk.DeviceMismatchError, match=r"  arg1\[0\]: meta\n  arg0: cpu"):
        dk.assert_same_device(torch.ones(1), [torch.ones(1, device="meta")], torch.ones(1))


def test_buffers_namedtuple_fields_and_dataclass_fields_are_named() -> None:
    @dataclasses.dataclass
    class Inputs:
        ids: torch.Tensor

    model = torch.nn.BatchNorm1d(2)  # running_mean and friends are buffers
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.assert_same_device(model=model, inputs=Inputs(torch.ones(1, device="meta")))
    message = str(info.value)
    assert "  inputs.ids: meta\n" in message
    assert "model.running_mean: cpu" in message


def test_deques_and_user_lists_are_looked_inside_as_to_device_moves_them() -> None:
    stray = torch.ones(1, device="meta")
    for holder in (collections.deque([stray]), collections.UserList([stray])):
        with pytest.raises(dk.DeviceMismatchError, match=r"  held\[0\]: meta\n"):
            dk.assert_same_device(x=torch.ones(1), held=holder)
    # Byte buffers are data, not containers of tensors.
    assert dk.assert_same_device(torch.ones(1), bytearray(b"ab")) == torch.device("cpu")


def test_many_paths_are_shortened() -> None:
    weights = {f"w{index}": torch.ones(1) for index in range(12)}
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.assert_same_device(weights=weights, stray=torch.ones(1, device="meta"))
    lines = str(info.value).splitlines()
    assert lines[1] == "  stray: meta"
    assert lines[2:7] == [f"  weights['w{index}']: cpu" for index in range(5)]
    assert lines[7] == "  ... and 7 more on cpu"
    assert lines[8] == (
        "Fix: move everything to cpu: make stray again on cpu (its meta tensors hold no values "
        "to copy)."
    )


def _fix_for(where: dict[torch.device, int], owners: dict[str, set[torch.device]]) -> str:
    """The fix line for a made-up mismatch: CUDA tensors cannot be made without a GPU."""
    named = {name: torch.nn.Linear(1, 1) if name == "model" else {} for name in owners}
    paths = {device: [f"t{index}" for index in range(count)] for device, count in where.items()}
    return _checkfix._fix(paths, owners, named)[0]


def test_the_fix_moves_work_to_the_accelerator_even_when_most_tensors_are_on_the_cpu() -> None:
    # A model never moved (many CPU parameters) and a batch already on the GPU: move the model.
    fix = _fix_for({CPU: 200, CUDA0: 2}, {"model": {CPU}, "batch": {CUDA0}})
    assert fix == "Fix: move everything to cuda:0: model.to('cuda:0')."
    # The classic: the batch stayed on the CPU.
    fix = _fix_for({CPU: 2, CUDA0: 200}, {"model": {CUDA0}, "batch": {CPU}})
    assert fix == "Fix: move everything to cuda:0: batch = dk.to_device(batch, 'cuda:0')."
    # Two GPUs: the one that holds the most.
    fix = _fix_for({CUDA1: 3, CUDA0: 9}, {"model": {CUDA0}, "batch": {CUDA0, CUDA1}})
    assert fix == "Fix: move everything to cuda:0: batch = dk.to_device(batch, 'cuda:0')."
    # Meta is never the target, even where it holds the most.
    fix = _fix_for({META: 50, CUDA0: 1}, {"model": {META}, "batch": {CUDA0}})
    assert fix == (
        "Fix: move everything to cuda:0: model.to_empty(device='cuda:0'), then load its weights."
    )


def test_a_mismatch_is_a_runtime_error() -> None:
    with pytest.raises(RuntimeError, match="found 2"):
        dk.assert_same_device(torch.ones(1), torch.ones(1, device="meta"))


def test_no_tensor_at_all() -> None:
    with pytest.raises(ValueError, match=r"found no tensor in arg0, labels; pass the tensors"):
        dk.assert_same_device([1, 2], labels="x")


def test_a_structure_that_contains_itself_is_looked_at_once() -> None:
    # It raised "batch[1] contains itself", with no fix; a look needs no copy, so no refusal.
    looped: list[Any] = [torch.ones(1)]
    looped.append(looped)
    assert dk.assert_same_device(batch=looped) == CPU
    looped.append(torch.ones(1, device="meta"))
    with pytest.raises(dk.DeviceMismatchError, match=r"  batch\[2\]: meta\n"):
        dk.assert_same_device(batch=looped)

    @dataclasses.dataclass
    class Node:
        x: torch.Tensor
        parent: object = None

    node = Node(torch.ones(1))
    node.parent = node  # a back-reference
    assert dk.assert_same_device(node) == CPU
    child = Node(torch.ones(1, device="meta"), parent=node)
    node.children = [child]  # type: ignore[attr-defined]
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.assert_same_device(node)
    assert "  arg0.children[0].x: meta\n" in str(info.value)
    assert "  arg0.x: cpu\n" in str(info.value)


def test_device_is_the_expected_device_not_an_object_to_check() -> None:
    # It was read as one more named object, holding no tensor: this never failed.
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.assert_same_device(torch.ones(1), device="meta")
    assert str(info.value) == (
        "expected every tensor on meta (device='meta'), found them on 1 device: cpu (1 tensor)\n"
        "  arg0: cpu\n"
        "Fix: move everything to meta: arg0 = dk.to_device(arg0, 'meta')."
    )
    assert dk.assert_same_device(torch.ones(1), batch=[torch.ones(1)], device="cpu:0") == CPU
    assert dk.assert_same_device(torch.ones(1, device="meta"), device=torch.device("meta")) == META


def test_tensors_off_the_expected_device_are_listed_first() -> None:
    model = torch.nn.Linear(1, 1)
    batch = {"x": torch.ones(1, device="meta"), "y": torch.ones(1, device="meta")}
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.assert_same_device(model=model, batch=batch, device=torch.device("meta"))
    assert str(info.value) == (
        "expected every tensor on meta (device=), found them on 2 devices: cpu (2 tensors), "
        "meta (2 tensors)\n"
        "  model.weight: cpu\n  model.bias: cpu\n  batch['x']: meta\n  batch['y']: meta\n"
        "Fix: move everything to meta: model.to('meta')."  # meta is where the caller wants it
    )
    with pytest.raises(dk.DeviceMismatchError, match=r"make batch again on cpu \(its meta"):
        dk.assert_same_device(model=model, batch=batch, device="cpu")


def test_device_is_read_as_every_device_argument_is() -> None:
    with pytest.raises(ValueError, match=r"device='CPU' is not a device torch knows; write 'cpu'"):
        dk.assert_same_device(torch.ones(1), device="CPU")
    with pytest.raises(TypeError, match=r"device must be a torch.device, .* got a tensor"):
        dk.assert_same_device(torch.ones(1), device=torch.tensor(0))  # type: ignore[arg-type]


def test_an_expected_cuda_device_does_not_start_cuda() -> None:
    # "cuda" is the current device, cuda:0 until CUDA starts: no need to start it to know.
    result = run_python(
        """
        import json, torch
        import devicekit as dk
        from devicekit._visible import cuda_started
        try:
            dk.assert_same_device(torch.ones(1), device="cuda")
            error = None
        except (dk.DeviceMismatchError, dk.DeviceNotFoundError) as raised:
            error = str(raised).splitlines()[0]
        print(json.dumps({"error": error, "torch": torch.cuda.is_initialized(),
                          "started": cuda_started()}))
        """
    )
    assert result["error"] is not None
    if torch.cuda.is_available():
        assert result["error"].startswith("expected every tensor on cuda:0 (device='cuda')")
    assert (result["torch"], result["started"]) == (False, None)


def test_an_iterator_argument_is_refused_not_consumed() -> None:
    items = (t for t in [torch.ones(1, device="meta")])
    with pytest.raises(
        TypeError,
        match=r"cannot check arg1, a generator, without consuming it: checking its tensors "
        r"would use it up \(to_device\(\) returns it unchanged and not consumed for the same "
        r"reason\)\. Pass a list of its items, list\(\.\.\.\)",
    ):
        dk.assert_same_device(torch.ones(1), items)
    assert len(list(items)) == 1  # still whole
    with pytest.raises(TypeError, match=r"cannot check batch, a list_iterator, without"):
        dk.assert_same_device(batch=iter([torch.ones(1)]))


def test_a_dict_view_argument_is_refused() -> None:
    batch = {"a": torch.ones(1), "b": torch.ones(1, device="meta")}
    with pytest.raises(
        TypeError,
        match=r"cannot check arg0, a dict_values view: a dict view is not walked \(to_device\(\) "
        r"refuses one holding a tensor off its target, for the same reason: it shows its "
        r"dict\)\. Pass the dict itself, or list\(\.\.\.\) of the view\.",
    ):
        dk.assert_same_device(batch.values())
    for view in (batch.keys(), batch.items(), collections.OrderedDict(batch).values()):
        with pytest.raises(TypeError, match=r"cannot check inputs, a \w+ view"):
            dk.assert_same_device(inputs=view)
    assert dk.assert_same_device(list(batch.values())[:1]) == CPU  # what the message suggests


def test_a_structure_deeper_than_the_recursion_limit_is_checked() -> None:
    # It raised RecursionError ("nests containers deeper than Python's recursion limit").
    deep: Any = torch.ones(1, device="meta")
    for _ in range(3000):
        deep = [deep]
    assert dk.assert_same_device(deep, torch.ones(1, device="meta")) == META
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.assert_same_device(deep, torch.ones(1))
    assert f"  arg0{'[0]' * 3000}: meta\n" in str(info.value)


class Leaky(torch.nn.Module):
    """Every classic way of keeping tensors where Module.to() cannot see them."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.scale = torch.ones(1)
        self.masks = [torch.ones(2), torch.zeros(2)]
        self.tables = {"a": torch.ones(1, requires_grad=True)}
        self.heads = [torch.nn.Linear(2, 1)]
        self.register_buffer("ok_buffer", torch.ones(1))
        self.ok_parameter = torch.nn.Parameter(torch.ones(1))
        self.ok_list = torch.nn.ModuleList([torch.nn.Linear(1, 1)])
        self.name = "not a tensor"
        self.sizes = [1, 2, 3]


def test_check_module_reports_each_attribute_that_stays_behind() -> None:
    model = torch.nn.Sequential(Leaky())
    model[0].linear.cache = torch.zeros(1)  # type: ignore[assignment]
    assert dk.check_module(model) == [
        "0.scale: a cpu tensor held as a plain attribute; module.to() will not move it. "
        "Use self.register_buffer('scale', ...) (or nn.Parameter if it should be trained).",
        "0.masks: a list of 2 tensors on cpu held as a plain attribute; module.to() will not "
        "move them. Use nn.ParameterList for trainable tensors, or register each one with "
        "self.register_buffer().",
        "0.tables: a dict of 1 tensor on cpu held as a plain attribute; module.to() will not "
        "move them. Use nn.ParameterDict for trainable tensors, or register each one with "
        "self.register_buffer().",
        "0.heads: a list holding 1 module as a plain attribute; module.to() will not move "
        "them and their parameters are not registered. Use nn.ModuleList.",
        "0.linear.cache: a cpu tensor held as a plain attribute; module.to() will not move it. "
        "Use self.register_buffer('cache', ...) (or nn.Parameter if it should be trained).",
    ]


def test_check_module_findings_are_true() -> None:
    # Each reported attribute really does stay behind after .to().
    model = Leaky().to("meta")
    assert model.linear.weight.device == META
    assert model.scale.device.type == "cpu"
    assert model.masks[0].device.type == "cpu"
    assert model.heads[0].weight.device.type == "cpu"
    reported = {finding.split(":")[0] for finding in dk.check_module(model)}
    assert reported == {"scale", "masks", "tables", "heads"}


class _Stateful(torch.nn.Module):
    """Keeps its state as plain attributes and moves them itself, as torchmetrics' Metric."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.total = torch.zeros(1)
        self.defaults = {"total": torch.zeros(1)}

    def _apply(self, fn: Any, recurse: bool = True) -> _Stateful:
        super()._apply(fn, recurse)
        self.total = fn(self.total)
        self.defaults = {name: fn(value) for name, value in self.defaults.items()}
        return self


class _LeakyLSTM(torch.nn.LSTM):
    def __init__(self) -> None:
        super().__init__(2, 2)
        self.cache = torch.zeros(1)


def test_check_module_claims_nothing_of_a_module_that_moves_itself_with_its_own_apply() -> None:
    # Before: torchmetrics' MulticlassAccuracy got 5 findings ("acc.tp ... module.to()
    # will not move it") that were false: its _apply moves its states.
    model = torch.nn.Sequential(_Stateful(), torch.nn.Linear(2, 2))
    model[1].scale = torch.ones(1)  # a plain module's attribute: still reported
    assert [finding.split(":")[0] for finding in dk.check_module(model)] == ["1.scale"]
    moved = model.to("meta")
    assert moved[0].total.device == META  # the claim not made would have been false
    assert moved[0].defaults["total"].device == META
    # torch's own _apply (RNNBase's) moves no plain attribute: still reported.
    assert [f.split(":")[0] for f in dk.check_module(_LeakyLSTM())] == ["cache"]


class _Logged(torch.nn.Module):
    """An _apply of its own that moves nothing more than Module's does."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = torch.zeros(1)
        self.calls = 0

    def _apply(self, fn: Any, recurse: bool = True) -> _Logged:
        self.calls += 1
        return super()._apply(fn, recurse)  # type: ignore[no-any-return]


def test_check_module_still_reports_what_an_own_apply_leaves_behind() -> None:
    # A review found the first version claiming nothing of any module with its own
    # _apply: one that only calls Module's left `pos` behind, unreported. Its _apply
    # is called once, with a function that moves nothing, to see what it reaches.
    model = _Logged()
    assert [finding.split(":")[0] for finding in dk.check_module(model)] == ["pos"]
    assert model.calls == 1
    assert model.pos.device.type == "cpu"
    assert model.to("meta").pos.device.type == "cpu"  # the finding is true


def test_check_module_is_empty_for_a_clean_module() -> None:
    assert (
        dk.check_module(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))) == []
    )


def test_check_module_and_data_parallel_need_a_module() -> None:
    with pytest.raises(TypeError, match=r"check_module\(module\) needs a torch.nn.Module, got 4"):
        dk.check_module(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"data_parallel\(module\) needs a torch.nn.Module, got 4"):
        dk.data_parallel(42)  # type: ignore[arg-type]


@pytest.mark.parametrize("call", [dk.check_module, dk.data_parallel])
def test_a_module_class_or_a_tensor_gets_the_fix(call: Any) -> None:
    # Before: "needs a torch.nn.Module, got type" (and "got Tensor"), with no fix.
    name = call.__name__
    with pytest.raises(
        TypeError,
        match=rf"got the class Linear itself; make one and pass it: "
        rf"{name}\(Linear\(\.\.\.\)\)$",
    ):
        call(torch.nn.Linear)
    with pytest.raises(TypeError, match=rf"got a tensor; pass the model that uses it: {name}\("):
        call(torch.ones(1))


@pytest.mark.parametrize("call", [dk.check_module, dk.data_parallel])
def test_a_list_or_dict_of_modules_gets_one_call_each(call: Any) -> None:
    # Before: "got [Linear(...), Linear(...)] of type list; pass the model", which it was.
    name, linear = call.__name__, torch.nn.Linear(2, 2)
    with pytest.raises(
        TypeError,
        match=rf"got a list of 2 modules; pass one at a time: "
        rf"\[{name}\(each\) for each in models\]$",
    ):
        call([linear, linear])
    with pytest.raises(TypeError, match=r"got a dict of 1 module; .* in models\.values\(\)\]$"):
        call({"encoder": linear})
    with pytest.raises(TypeError, match=rf"of type list; pass the model: {name}\(model\)$"):
        call([linear, 1])  # not only modules: no such advice


class Grouped(torch.nn.Module):
    """Plain references to state the module registers anyway, and one to a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)
        self.norm = torch.nn.BatchNorm1d(2)
        self.decay = [self.fc.weight]  # parameter groups, made once
        self.layers = {"fc": self.fc}  # a registered module, looked up by name
        object.__setattr__(self.fc, "owner", self)  # a back-reference, kept unregistered
        self.stats = self.norm.running_mean  # a buffer under a second name


def test_check_module_does_not_report_what_module_to_moves_in_place() -> None:
    model = Grouped()
    assert dk.check_module(model) == [
        "stats: the buffer 'norm.running_mean' held again as a plain attribute; module.to() "
        "replaces buffers with moved copies, so this one stays the old cpu tensor. Read the "
        "buffer through its module instead (a @property can keep this name)."
    ]
    # Both claims are true: the references that were not reported follow, the one that was stays.
    model.double()
    assert model.decay[0] is model.fc.weight
    assert model.decay[0].dtype == torch.float64
    assert model.layers["fc"].weight.dtype == torch.float64
    assert model.norm.running_mean.dtype == torch.float64
    assert model.stats.dtype == torch.float32


class Views(torch.nn.Module):
    """Plain attributes that share memory with a parameter or a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)
        self.register_buffer("table", torch.zeros(4))
        self.row = self.fc.weight[0]  # a view
        self.bias_now = self.fc.bias.detach()  # an alias: the same memory, no autograd link
        self.head = self.table[:2]  # a view of a buffer
        self.own = torch.ones(2)  # its own memory


def test_check_module_names_the_parameter_a_plain_tensor_views() -> None:
    # register_buffer would be the wrong advice: a buffer is a copy, stale as the weight trains.
    def about(name: str, owner: str) -> str:
        return (
            f"{name}: a cpu tensor held as a plain attribute that shares its memory with "
            f"{owner!r} (a view or an alias of it); module.to() gives {owner!r} new memory, so "
            f"this one stays the old cpu tensor. Compute it from {owner!r} where it is used, in "
            "forward() or a @property."
        )

    findings = dk.check_module(Views())
    assert findings == [
        about("row", "fc.weight"),
        about("bias_now", "fc.bias"),
        about("head", "table"),
        "own: a cpu tensor held as a plain attribute; module.to() will not move it. Use "
        "self.register_buffer('own', ...) (or nn.Parameter if it should be trained).",
    ]
    model = Views()
    model.double()  # what the findings claim: the views keep the old memory
    assert model.row.dtype == torch.float32
    assert model.row.untyped_storage().data_ptr() != model.fc.weight.untyped_storage().data_ptr()


def test_check_module_reads_past_a_lazy_module_s_uninitialized_parameters() -> None:
    # Their storage raises ValueError: asking for it made check_module fail on any model
    # with a lazy layer and a plain tensor attribute.
    class Lazy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.LazyLinear(3)
            self.scale = torch.ones(2)

    assert dk.check_module(Lazy()) == [
        "scale: a cpu tensor held as a plain attribute; module.to() will not move it. Use "
        "self.register_buffer('scale', ...) (or nn.Parameter if it should be trained)."
    ]


def test_check_module_reports_a_module_kept_out_of_the_registry() -> None:
    model = torch.nn.Linear(2, 2)
    object.__setattr__(model, "helper", torch.nn.Linear(1, 1))  # as some wrappers do
    assert dk.check_module(model) == [
        "helper: a Linear module held as a plain attribute, not registered (set with "
        "object.__setattr__ or through __dict__); module.to() will not move it. Register it: "
        "in Linear.__init__ assign it the usual way, self.helper = ..., or on this model now: "
        "model.helper = model.helper."
    ]
    model.to("meta")
    assert model.helper.weight.device == CPU  # type: ignore[union-attr]


def test_check_module_gives_a_hidden_module_a_fix_that_runs() -> None:
    """The fix for a module set with object.__setattr__ deep inside is a line that works."""
    model = torch.nn.Sequential(torch.nn.ModuleDict({"a-b": torch.nn.Linear(2, 2)}))
    object.__setattr__(model[0]["a-b"], "teacher", torch.nn.Linear(1, 1))
    (finding,) = dk.check_module(model)
    assert finding.startswith("0.a-b.teacher: ")
    assert "in Linear.__init__ assign it the usual way, self.teacher = ..." in finding
    line = finding.rsplit("on this model now: ", 1)[1].rstrip(".")
    assert line == "model[0]['a-b'].teacher = model[0]['a-b'].teacher"
    exec(line, {"model": model})  # the fix, pasted
    assert dk.check_module(model) == []
    model.to("meta")
    assert model[0]["a-b"].teacher.weight.device.type == "meta"


def test_check_module_reports_what_hidden_modules_hide_in_the_same_pass() -> None:
    # Before, a module hidden inside a hidden module (or a plain list's module) was found
    # only once the outer one was fixed: one more run of check_module per level.
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            object.__setattr__(self, "teacher", torch.nn.Linear(1, 1))

    model = torch.nn.Linear(2, 2)
    object.__setattr__(model, "hidden", torch.nn.ModuleList([Block()]))
    model.extra = [Block()]  # a plain list: module.to() moves neither Block
    findings = dk.check_module(model)
    assert [finding.split(": ", 1)[0] for finding in findings] == [
        "hidden",
        "extra",
        "hidden.0.teacher",
        "extra[0].teacher",
    ]
    lines = [f.rsplit("on this model now: ", 1)[1].rstrip(".") for f in findings[2:]]
    assert lines == [
        "model.hidden[0].teacher = model.hidden[0].teacher",
        "model.extra[0].teacher = model.extra[0].teacher",
    ]
    for line in lines:
        exec(line, {"model": model})  # the fixes, pasted
    model.hidden = model.hidden
    assert [finding.split(": ", 1)[0] for finding in dk.check_module(model)] == ["extra"]


def test_check_module_ignores_weights_a_pre_hook_recomputes() -> None:
    prune = pytest.importorskip("torch.nn.utils.prune")
    pruned = torch.nn.Linear(2, 2)
    prune.l1_unstructured(pruned, "weight", amount=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # both are deprecated, and still used
        normed = torch.nn.utils.weight_norm(torch.nn.Linear(2, 2))
    spectral = torch.nn.utils.spectral_norm(torch.nn.Linear(2, 2))
    for model in (pruned, normed, spectral):
        assert "weight" in vars(model)  # a plain tensor attribute...
        assert dk.check_module(model) == []
        model.to("meta")
        model(torch.ones(1, 2, device="meta"))
        assert model.weight.device == META  # ...that the next call makes again on the device


def test_check_module_looks_inside_a_plain_attribute_that_contains_itself() -> None:
    model = torch.nn.Linear(1, 1)
    registry: dict[str, Any] = {"masks": [torch.ones(1), torch.ones(1, device="meta")]}
    registry["self"] = registry
    model.registry = registry  # type: ignore[assignment]
    assert dk.check_module(model) == [
        "registry: a dict of 2 tensors on cpu, meta held as a plain attribute; module.to() will "
        "not move them. nn.ParameterDict and nn.ParameterList register only the tensors "
        "directly in them, not those inside nested containers: register each tensor under a "
        "name made from its place, e.g. self.register_buffer('registry_masks_0', ...)."
    ]


def test_check_module_on_lazy_tied_and_none_state() -> None:
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(4, 2)
            self.head = torch.nn.Linear(2, 4, bias=False)
            self.head.weight = self.embed.weight  # tied
            self.lazy = torch.nn.LazyLinear(3)
            self.register_buffer("absent", None)
            self.register_parameter("unused", None)

    model = Model()
    assert dk.check_module(model) == []
    assert dk.assert_same_device(model=model) == CPU


def test_attributes_that_are_not_fields_are_looked_inside_as_to_device_moves_them() -> None:
    @dataclasses.dataclass
    class Inputs:
        ids: torch.Tensor

        def __post_init__(self) -> None:
            self.mask = torch.ones(1)  # on the CPU, whatever ids is on
            self._extra = [torch.ones(1)]

    inputs = Inputs(torch.ones(1, device="meta"))
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.assert_same_device(inputs=inputs)
    assert "  inputs.mask: cpu\n  inputs._extra[0]: cpu\n" in str(info.value)
    assert dk.assert_same_device(dk.to_device(inputs, META)) == META

    class Model(torch.nn.Linear):
        def __init__(self) -> None:
            super().__init__(1, 1)
            self.example = inputs  # a plain attribute: module.to() moves none of it

    assert dk.check_module(Model()) == [
        "example: an Inputs of 3 tensors on cpu, meta held as a plain attribute; module.to() "
        "will not move them. nn.ParameterDict and nn.ParameterList register only the tensors "
        "directly in them, not those inside an Inputs: register each tensor under a name made "
        "from its place, e.g. self.register_buffer('example_ids', ...)."
    ]


class Lengths(dict[str, Any]):
    """A batch that was given an attribute besides its items."""


class Mirrored(dict[str, Any]):
    """Like easydict: every item is an attribute too."""

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        object.__setattr__(self, key, value)


def test_attributes_of_container_subclasses_are_looked_inside_as_to_device_moves_them() -> None:
    batch = Lengths(ids=torch.ones(1, device="meta"))
    batch.lengths = torch.ones(1)  # type: ignore[attr-defined]  # on the CPU, whatever ids is on
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.assert_same_device(batch=batch)
    assert "  batch.lengths: cpu\n" in str(info.value)
    assert dk.assert_same_device(dk.to_device(batch, META)) == META

    class Model(torch.nn.Linear):
        def __init__(self) -> None:
            super().__init__(1, 1)
            self.example = Lengths()  # no items: the tensor is only in its attribute
            self.example.lengths = torch.ones(1)  # type: ignore[attr-defined]

    assert dk.check_module(Model()) == [
        "example: a Lengths of 1 tensor on cpu held as a plain attribute; module.to() will not "
        "move them. nn.ParameterDict and nn.ParameterList register only the tensors directly "
        "in them, not those inside a Lengths: register each tensor under a name made from its "
        "place, e.g. self.register_buffer('example_lengths', ...)."
    ]


def test_an_attribute_that_mirrors_an_item_is_named_once() -> None:
    mirrored = Mirrored()
    mirrored["x"] = torch.ones(1)
    mirrored["y"] = torch.ones(1, device="meta")
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.assert_same_device(batch=mirrored)
    assert str(info.value).startswith(
        "expected every tensor on one device, found 2: cpu (1 tensor), meta (1 tensor)\n"
        "  batch['x']: cpu\n  batch['y']: meta\n"
    )


class Holder:
    """A class of its own: to_device() returns it unchanged, the check looks inside."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


class Slotted:
    __slots__ = ("__secret", "unset", "x")

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self.__secret = [x]


def test_tensors_inside_any_object_are_checked() -> None:
    # It returned cpu: the Holder was not looked inside, so the stray on meta went unseen.
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.assert_same_device(Holder(torch.ones(1, device="meta")), torch.ones(1))
    assert str(info.value).startswith(
        "expected every tensor on one device, found 2: meta (1 tensor), cpu (1 tensor)\n"
        "  arg0.x: meta\n  arg1: cpu\n"
        "Fix: move everything to cpu: make arg0 again on cpu (it is a Holder, which "
        "dk.to_device() returns unchanged, and its meta tensors hold no values to copy).\n"
    )
    # Slots (a private one under its mangled name), inside containers and records.
    stray = torch.ones(1, device="meta")
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.assert_same_device(batch={"h": [Slotted(stray)]}, x=torch.ones(1))
    assert "  batch['h'][0]._Slotted__secret[0]: meta\n  batch['h'][0].x: meta\n" in str(info.value)
    # The fix says who moves them: to_device() leaves a Holder as it is.
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.assert_same_device({"h": Holder(torch.ones(1)), "y": torch.ones(1)}, device="meta")
    assert str(info.value).endswith(
        "Fix: move everything to meta: move the tensors in arg0['h'] (arg0['h'].x) to meta "
        "yourself, or make it there (it is a Holder, which dk.to_device() returns unchanged); "
        "arg0 = dk.to_device(arg0, 'meta')."
    )
    _mover.looks_left.pop(Holder, None)  # warned once per class: as if never moved
    with pytest.warns(RuntimeWarning, match=r"returned a .*Holder as it is"):
        assert dk.to_device(Holder(torch.ones(1)), META).x.device == CPU  # what the fix says


def test_the_fix_for_many_holders_names_the_argument_they_are_in() -> None:
    # a0740e5 named the holder's class `name` inside the loop, over the argument's:
    # "the same for 2 more objects in Holder".
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.assert_same_device(batch=[Holder(torch.ones(1)) for _ in range(5)], device="meta")
    assert str(info.value).endswith(
        "(it is a Holder, which dk.to_device() returns unchanged); "
        "the same for 2 more objects in batch."
    )


def test_a_done_future_is_told_to_be_waited_for_not_made_again() -> None:
    # Before: "make arg0['b'] again on cpu (it is a Future, ...)": the tensor is its
    # value, which future.result() gets, as to_device's own warning says.
    done: concurrent.futures.Future[dict[str, torch.Tensor]] = concurrent.futures.Future()
    done.set_result({"x": torch.ones(2)})
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.assert_same_device({"a": torch.ones(1, device="meta"), "b": done}, device="meta")
    assert "  arg0['b']._result['x']: cpu\n" in str(info.value)
    assert str(info.value).endswith(
        "Fix: move everything to meta: get the value of arg0['b'] (future.result()) and move "
        "that (it is a concurrent.futures.Future, which stands for a value made elsewhere: "
        "dk.to_device() returns it unchanged)."
    )
    shapes_only: concurrent.futures.Future[torch.Tensor] = concurrent.futures.Future()
    shapes_only.set_result(torch.ones(2, device="meta"))  # no values to move: made again
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.assert_same_device({"a": torch.ones(1), "b": shapes_only}, device="cpu")
    assert "get the value of arg0['b'] (future.result()) and make it again on cpu (" in str(
        info.value
    )
    _mover.looks_left.pop(concurrent.futures.Future, None)  # warned once per class
    with pytest.warns(RuntimeWarning, match=r"Get the value first \(future\.result\(\)\)"):
        assert dk.to_device(done, META) is done  # what the fix says


def test_an_object_with_a_to_method_is_left_to_to_device_in_the_fix() -> None:
    class Movable(Holder):
        def to(self, device: torch.device) -> Movable:
            return Movable(self.x.to(device))

    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.assert_same_device(Movable(torch.ones(1)), device="meta")
    assert str(info.value).endswith(
        "Fix: move everything to meta: arg0 = dk.to_device(arg0, 'meta')."
    )
    assert dk.assert_same_device(dk.to_device(Movable(torch.ones(1)), META)) == META


def test_looking_inside_an_object_runs_none_of_its_code() -> None:
    class Guarded:
        def __init__(self) -> None:
            self.x = torch.ones(1)

        @property
        def y(self) -> torch.Tensor:
            raise AssertionError("a property was read")

        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"__getattr__({name!r}) was called")

    assert dk.assert_same_device(Guarded(), torch.ones(1)) == CPU
    # A weak proxy holds nothing of its own; a dead one raises ReferenceError at any question.
    gone = Holder(torch.ones(1, device="meta"))
    holder = Holder(torch.ones(1))
    holder.proxy = weakref.proxy(gone)  # type: ignore[attr-defined]
    del gone
    assert dk.assert_same_device(holder) == CPU


def test_classes_modules_and_functions_are_not_looked_inside() -> None:
    class WithClassTensor:
        table = torch.ones(1, device="meta")  # a class attribute: the class's, not the object's

    holder = Holder(torch.ones(1))
    holder.kind = WithClassTensor  # type: ignore[attr-defined]
    holder.lib = torch  # type: ignore[attr-defined]
    holder.fn = lambda: torch.ones(1, device="meta")  # type: ignore[attr-defined]
    assert dk.assert_same_device(holder) == CPU
    # Given as an argument, one is refused: its tensors would go unchecked without a word.
    for thing, kind in ((WithClassTensor, "class"), (torch, "module"), (print, "function")):
        with pytest.raises(TypeError, match=rf"cannot check arg1, a {kind} \(\w+"):
            dk.assert_same_device(torch.ones(1), thing)


def test_plain_values_and_objects_without_tensors_still_pass() -> None:
    assert dk.assert_same_device(torch.ones(1), step=3, name="x", none=None) == CPU
    assert dk.assert_same_device(torch.ones(1), Holder(None)) == CPU  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"found no tensor in arg0, step; pass the tensors"):
        dk.assert_same_device(Holder(None), step=3)  # type: ignore[arg-type]


def test_a_transformers_cache_is_looked_inside() -> None:
    transformers = pytest.importorskip("transformers")
    cache = transformers.DynamicCache()
    cache.update(torch.ones(1, 1, 2, 4, device="meta"), torch.ones(1, 1, 2, 4, device="meta"), 0)
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.assert_same_device(past_key_values=cache, x=torch.ones(1))
    assert str(info.value).startswith(
        "expected every tensor on one device, found 2: cpu (1 tensor), meta (2 tensors)\n"
        "  x: cpu\n"
        "  past_key_values.layers[0].keys: meta\n"
        "  past_key_values.layers[0].values: meta\n"
        "Fix: move everything to cpu: make past_key_values again on cpu (it is a DynamicCache"
    )
    assert dk.assert_same_device(cache, torch.ones(1, device="meta")) == META


def test_a_moved_packed_sequence_passes() -> None:
    # batch_sizes stays on the CPU on purpose: this failed, with a fix to move all to the CPU.
    packed = torch.nn.utils.rnn.pack_sequence([torch.ones(3), torch.ones(2)], enforce_sorted=False)
    moved = packed.to("meta")
    assert moved.batch_sizes.device == CPU  # torch's own doing
    assert dk.assert_same_device(moved, x=torch.ones(1, device="meta")) == META
    # The indices follow data, and are checked.
    stray = moved._replace(sorted_indices=packed.sorted_indices)
    with pytest.raises(dk.DeviceMismatchError, match=r"  arg0.sorted_indices: cpu\n"):
        dk.assert_same_device(stray)


def test_check_module_advises_registering_a_hidden_parameter() -> None:
    class Hidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            object.__setattr__(self, "p", torch.nn.Parameter(torch.ones(2)))
            self.extra = {"w": torch.nn.Parameter(torch.ones(1))}

    assert dk.check_module(Hidden()) == [
        "p: an nn.Parameter on cpu held as a plain attribute, not registered; module.to() will "
        "not move it, and module.parameters() (so the optimizer) and state_dict() leave it out. "
        "Register it: self.p = nn.Parameter(...) (a plain assignment registers it; "
        "object.__setattr__ does not), or self.register_parameter('p', ...) in its place.",
        "extra: a dict of 1 nn.Parameter on cpu held as a plain attribute; module.to() will not "
        "move them, and module.parameters() (so the optimizer) and state_dict() leave them out. "
        "Use nn.ParameterDict to register them.",
    ]
    # The advice works: each way leaves nothing to report.
    for register in (
        lambda m: setattr(m, "p", m.p),
        lambda m: (delattr(m, "p"), m.register_parameter("p", torch.nn.Parameter(torch.ones(2)))),
    ):
        model = Hidden()
        register(model)
        model.extra = torch.nn.ParameterDict(model.extra)
        assert dk.check_module(model) == []
        assert {name for name, _ in model.named_parameters()} == {"p", "extra.w"}


def test_check_module_does_not_advise_parameter_containers_for_nested_ones() -> None:
    class Nested(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.nested = {"a": [{"b": torch.ones(1)}]}
            self.mixed = [torch.nn.Parameter(torch.ones(1)), torch.ones(1)]
            self.heads = {"enc": [torch.nn.Linear(1, 1)]}

    assert dk.check_module(Nested()) == [
        "nested: a dict of 1 tensor on cpu held as a plain attribute; module.to() will not move "
        "them. nn.ParameterDict and nn.ParameterList register only the tensors directly in "
        "them, not those inside nested containers: register each tensor under a name made from "
        "its place, e.g. self.register_buffer('nested_a_0_b', ...).",
        "mixed: a list of 2 tensors on cpu held as a plain attribute; module.to() will not move "
        "them, and module.parameters() (so the optimizer) and state_dict() leave its 1 "
        "nn.Parameter out. Use nn.ParameterList for trainable tensors, or register each one: "
        "self.register_parameter() for an nn.Parameter, self.register_buffer() for the others.",
        "heads: a dict holding 1 module as a plain attribute; module.to() will not move them "
        "and their parameters are not registered. Use nn.ModuleDict for each dict in it and "
        "nn.ModuleList for each list, nested in the same shape (they are modules, so they nest).",
    ]
    # What the advice says holds: a ParameterDict registers none of the nested tensor...
    model = torch.nn.Module()
    model.nested = torch.nn.ParameterDict({"a": [{"b": torch.ones(1)}]})
    assert list(model.state_dict()) == []
    assert dk.check_module(model)[0].startswith("nested.a: a list of 1 tensor on cpu held as")
    # ...and module containers nest.
    model = torch.nn.Module()
    model.heads = torch.nn.ModuleDict({"enc": torch.nn.ModuleList([torch.nn.Linear(1, 1)])})
    assert dk.check_module(model) == []
    assert "heads.enc.0.weight" in dict(model.named_parameters())


_NOT_A_KEY = (
    "no registry takes a tensor as a key (nn.ParameterDict's keys are str; module.to() replaces "
    "a buffer, so a key would stay the old tensor): key the dict by str or int instead, and "
    "register each such tensor, e.g. self.register_buffer("
)
_DICT_KEYS = "its keys must be str, without '.', and not one of its own attribute names like 'keys'"


def test_check_module_says_a_tensor_used_as_a_dict_key_cannot_be_registered_as_one() -> None:
    # It said "Use nn.ParameterDict", which refuses a tensor key, and missed a UserDict's keys.
    class Keyed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table: Any = {torch.ones(1): "a"}
            self.pairs: Any = {torch.ones(1): torch.zeros(2)}
            self.heads: Any = {torch.nn.Linear(1, 1): "encoder"}
            self.user: Any = collections.UserDict({torch.ones(1): "a"})

    model = Keyed()
    assert dk.check_module(model) == [
        "table: a dict of 1 tensor on cpu held as a plain attribute; module.to() will not move "
        f"them. It is a dict's key (or in one), and {_NOT_A_KEY}'table_key_0', ...).",
        "pairs: a dict of 2 tensors on cpu held as a plain attribute; module.to() will not move "
        f"them. 1 of them is a dict's key (or in one), and {_NOT_A_KEY}'pairs_key_0', ...). For "
        "the others, use nn.ParameterDict with str keys for trainable tensors (it refuses "
        f"tensor(..., device='cpu', size=(1,)): {_DICT_KEYS}), or register each one, e.g. "
        "self.register_buffer('pairs_0', ...).",
        "heads: a dict holding 1 module as a plain attribute; module.to() will not move them and "
        "their parameters are not registered. It is a dict's key (or in one): register each "
        "where it is made, e.g. self.add_module('heads_key_0', ...); module.to() moves a "
        "registered one in place, so the key follows.",
        "user: an UserDict of 1 tensor on cpu held as a plain attribute; module.to() will not "
        f"move them. It is a dict's key (or in one), and {_NOT_A_KEY}'user_key_0', ...).",
    ]
    with pytest.raises(TypeError, match="cannot be used as a key as it is not a string"):
        torch.nn.ParameterDict({torch.ones(1): torch.nn.Parameter(torch.ones(1))})
    # The advice, followed as written, leaves nothing behind.
    (key,) = model.table
    model.register_buffer("table_key_0", key)
    model.table = {0: "a"}
    ((key, value),) = model.pairs.items()
    model.register_buffer("pairs_key_0", key)
    model.register_buffer("pairs_0", value)
    model.pairs = {0: "pairs_0"}
    (head,) = model.heads
    model.add_module("heads_key_0", head)  # the dict may keep it as a key: it is moved in place
    (key,) = model.user
    model.register_buffer("user_key_0", key)
    model.user = collections.UserDict({0: "a"})
    assert dk.check_module(model) == []
    model.to("meta")
    assert next(iter(model.heads)).weight.device == META


def test_check_module_advises_module_and_parameter_dicts_only_for_keys_they_take() -> None:
    # It said "Use nn.ModuleDict" for int keys, which nn.ModuleDict refuses.
    class Keys(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.by_step: Any = {0: torch.nn.Linear(1, 1), 1: torch.nn.Linear(1, 1)}
            self.named: Any = {"keys": torch.nn.Linear(1, 1)}
            self.nested: Any = {"enc": {0: torch.nn.Linear(1, 1)}}
            self.scales: Any = {"layer.0": torch.ones(1)}
            self.good: Any = {"a": torch.nn.Linear(1, 1)}

    modules = (
        "a dict holding {} as a plain attribute; module.to() will not move them and their "
        "parameters are not registered. Use nn.ModuleDict"
    )
    assert dk.check_module(Keys()) == [
        "by_step: " + modules.format("2 modules") + f" with str keys (it refuses 0: {_DICT_KEYS}).",
        "named: "
        + modules.format("1 module")
        + f" with str keys (it refuses 'keys': {_DICT_KEYS}).",
        "nested: " + modules.format("1 module") + f" with str keys (it refuses 0: {_DICT_KEYS}) "
        "for each dict in it and nn.ModuleList for each list, nested in the same shape (they are "
        "modules, so they nest).",
        "scales: a dict of 1 tensor on cpu held as a plain attribute; module.to() will not move "
        "them. Use nn.ParameterDict with str keys for trainable tensors (it refuses 'layer.0': "
        f"{_DICT_KEYS}), or register each one, e.g. self.register_buffer('scales_layer_0', ...).",
        "good: " + modules.format("1 module") + ".",
    ]
    # What it says is refused is, and what it suggests is taken.
    with pytest.raises(TypeError, match="module name should be a string"):
        torch.nn.ModuleDict({0: torch.nn.Linear(1, 1)})  # type: ignore[dict-item]
    with pytest.raises(KeyError, match="attribute 'keys' already exists"):
        torch.nn.ModuleDict({"keys": torch.nn.Linear(1, 1)})
    with pytest.raises(KeyError, match=r"contain \"\.\""):
        torch.nn.ParameterDict({"layer.0": torch.nn.Parameter(torch.ones(1))})
    model = Keys()
    model.by_step = torch.nn.ModuleDict({str(k): v for k, v in model.by_step.items()})
    model.named = torch.nn.ModuleDict({"keys_": model.named["keys"]})
    model.nested = torch.nn.ModuleDict({"enc": torch.nn.ModuleDict({"0": torch.nn.Linear(1, 1)})})
    model.register_buffer("scales_layer_0", model.scales.pop("layer.0"))
    model.good = torch.nn.ModuleDict(model.good)
    assert dk.check_module(model) == []


def test_check_module_says_to_register_a_loose_module_not_its_parameters() -> None:
    # A reference to a parameter of a module kept in a list was told "Use nn.ParameterList"
    # (or register_parameter); one to a registered buffer, register_buffer (a second copy);
    # a tensor beside a module in one list went unmentioned, and nn.ModuleList refuses it.
    class Loose(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.BatchNorm1d(2)
            self.blocks: Any = [torch.nn.Linear(2, 2)]
            self.decay: Any = [self.blocks[0].weight]
            object.__setattr__(self, "bias", self.blocks[0].bias)
            self.stats: Any = [self.norm.running_mean]
            self.mixed: Any = [torch.nn.Linear(1, 1), torch.ones(1)]

    follow = (
        "of a module held as a plain attribute, not registered ('blocks[0].{}'), which "
        "module.to() does not move either: register that module instead (its own finding says "
        "how); module.to() then moves its parameters in place, so a reference follows (read a "
        "buffer through it)."
    )
    assert dk.check_module(Loose()) == [
        "blocks: a list holding 1 module as a plain attribute; module.to() will not move them "
        "and their parameters are not registered. Use nn.ModuleList.",
        "decay: a list of 1 nn.Parameter on cpu held as a plain attribute; module.to() will not "
        "move them, and module.parameters() (so the optimizer) and state_dict() leave them out. "
        "It is a tensor " + follow.format("weight"),
        "bias: a plain reference to a tensor " + follow.format("bias"),
        "stats: a list of 1 tensor on cpu held as a plain attribute; module.to() will not move "
        "them. It is a buffer of the model ('norm.running_mean'): module.to() replaces buffers "
        "with moved copies, so a reference keeps the old tensor. Read each through its module "
        "instead.",
        "mixed: a list holding 1 module as a plain attribute; module.to() will not move them and "
        "their parameters are not registered. Use nn.ModuleList. It holds 1 tensor on cpu "
        "besides. nn.ModuleList and nn.ModuleDict hold modules only: register each tensor under "
        "a name made from its place, e.g. self.register_buffer('mixed_1', ...).",
    ]
    with pytest.raises(TypeError, match="is not a Module subclass"):
        torch.nn.ModuleList(Loose().mixed)
    # Registering the module is the whole fix: the references to its parameters follow.
    model = Loose()
    model.blocks = torch.nn.ModuleList(model.blocks)
    model.register_buffer("mixed_1", model.mixed.pop())
    model.mixed = torch.nn.ModuleList(model.mixed)
    del model.stats
    assert dk.check_module(model) == []
    model.double()
    assert model.decay[0].dtype == model.bias.dtype == torch.float64
    assert len(list(model.parameters())) == 6  # each once: none registered a second time


def test_check_module_suggests_names_register_buffer_takes() -> None:
    # It suggested 'layer.0' (register_buffer refuses a dot) and names the module had already.
    class Named(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            setattr(self, "layer.0", torch.ones(1))  # a name with a dot
            self.masks: Any = {"a": {"b": torch.ones(1)}}
            self.masks_a_b = 3
            self.a: Any = {"b_c": [torch.ones(1)]}
            self.a_b: Any = {"c": [torch.ones(1)]}

    nested = (
        "a dict of 1 tensor on cpu held as a plain attribute; module.to() will not move them. "
        "nn.ParameterDict and nn.ParameterList register only the tensors directly in them, not "
        "those inside nested containers: register each tensor under a name made from its place, "
        "e.g. self.register_buffer({!r}, ...)."
    )
    model = Named()
    assert dk.check_module(model) == [
        "layer.0: a cpu tensor held as a plain attribute; module.to() will not move it. Use "
        "self.register_buffer('layer_0', ...) (or nn.Parameter if it should be trained).",
        "masks: " + nested.format("masks_a_b_2"),
        "a: " + nested.format("a_b_c_0"),
        "a_b: " + nested.format("a_b_c_0_2"),  # not the name the finding above suggests
    ]
    with pytest.raises(KeyError, match=r"contain \"\.\""):
        model.register_buffer("layer.0", torch.ones(1))
    with pytest.raises(KeyError, match="already exists"):
        model.register_buffer("masks_a_b", torch.ones(1))
    for name in ("layer_0", "masks_a_b_2", "a_b_c_0", "a_b_c_0_2"):
        model.register_buffer(name, torch.ones(1))  # each is taken, as written


class Link:
    """A plain object in a chain: to_device() returns it unchanged, the check looks inside."""

    def __init__(self, x: torch.Tensor, next: Link | None = None) -> None:
        self.x = x
        self.next = next


def test_a_chain_of_objects_deeper_than_the_recursion_limit_is_checked() -> None:
    # It raised RecursionError, saying the batch "nests containers" too deep.
    chain = Link(torch.ones(1, device="meta"))
    for _ in range(4999):
        chain = Link(torch.ones(1), chain)
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.assert_same_device(batch=chain)
    message = str(info.value)
    assert message.startswith(
        "expected every tensor on one device, found 2: meta (1 tensor), cpu (4999 tensors)\n"
        f"  batch{'.next' * 4999}.x: meta\n"
        "  batch.x: cpu\n  batch.next.x: cpu\n"
    )
    assert "make batch again on cpu (it is a Link" in message


def test_an_object_holding_too_much_to_look_through_is_refused_not_passed() -> None:
    # It walked all of it (0.55 s for a holder of a 2M-item list) and vouched for all of it.
    # Objects, not plain values: those are passed over in bulk (tested below).
    holder = Holder(torch.ones(1))
    holder.dataset = [object() for _ in range(200_000)]  # type: ignore[attr-defined]
    with pytest.raises(
        ValueError,
        match=r"^assert_same_device\(\) cannot check batch: batch\['h'\] is a Holder, which it "
        r"looks inside attribute by attribute, and it holds more than 100,000 objects .*"
        r"Pass the tensors to check themselves, or a dict or list of them, instead of "
        r"batch\['h'\]\.$",
    ):
        dk.assert_same_device(batch={"h": holder}, x=torch.ones(1))


def test_the_look_is_bounded_inside_objects_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_checkwalk, "_LOOK_BUDGET", 50)
    # The containers given are checked whole, however large: the stray is the 200th tensor.
    batch = {"x": [torch.ones(1) for _ in range(199)] + [torch.ones(1, device="meta")]}
    with pytest.raises(dk.DeviceMismatchError, match=r"  batch\['x'\]\[199\]: meta\n"):
        dk.assert_same_device(batch=batch)
    with pytest.raises(ValueError, match=r"arg0 is a Holder, .* more than 50 objects"):
        dk.assert_same_device(Holder(batch["x"]))  # type: ignore[arg-type]
    assert dk.assert_same_device(Holder(batch["x"][:40])) == CPU  # type: ignore[arg-type]


def test_looking_inside_an_object_never_reads_a_property_named_dict() -> None:
    # object.__getattribute__(obj, "__dict__") ran it, and its error escaped.
    class Guarded(Holder):
        @property  # type: ignore[override]
        def __dict__(self) -> dict[str, Any]:  # type: ignore[override]
            raise AssertionError("a property named __dict__ ran")

    with pytest.warns(RuntimeWarning, match=r"arg0 \(a Guarded: its __dict__ is a property"):
        assert dk.assert_same_device(Guarded(torch.ones(1)), torch.ones(1)) == CPU
    assert _look.object_attributes(Guarded(torch.ones(1))) == []
    gone = Holder(torch.ones(1))
    proxy = weakref.proxy(gone)
    del gone
    assert _look.object_attributes(proxy) == []


def test_names_left_out_do_not_use_up_the_look_budget() -> None:
    # limit was applied before __names__ and unset slots were left out: the budget left
    # for inner was used up by its __m0__..., nothing was counted and t was never seen.
    class Inner:
        def __init__(self) -> None:
            for i in range(12):
                setattr(self, f"__m{i}__", i)
            self.t = torch.ones(1, device="meta")

    class Outer:
        def __init__(self, items: list[object]) -> None:
            self.items = items
            self.inner = Inner()

    for items in ([], [object()] * 99_990):  # objects: plain values are read in bulk
        with pytest.raises(dk.DeviceMismatchError, match=r"arg0\.inner\.t"):
            dk.assert_same_device(Outer(items), x=torch.ones(1))
    assert [name for name, _ in _look.object_attributes(Inner(), limit=1)] == [".t"]

    class Slots:
        __slots__ = ("a", "b", "c")

    slots = Slots()
    slots.c = 3
    assert _look.object_attributes(slots, limit=1) == [(".c", 3)]


def test_attributes_another_thread_changes_are_never_read_in_part() -> None:
    # The __dict__ was read in a Python loop: a change midway raised RuntimeError, which
    # was swallowed, and the part read so far (without t) passed for the whole.
    class Many:
        pass

    obj = Many()
    for i in range(2_000):
        setattr(obj, f"a{i}", i)
    obj.t = torch.ones(1)
    stop = threading.Event()

    def write() -> None:
        while not stop.is_set():
            for i in range(10):
                setattr(obj, f"extra{i}", i)
            for i in range(10):
                delattr(obj, f"extra{i}")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    writer = threading.Thread(target=write)
    writer.start()
    try:
        partial = 0
        for _ in range(300):
            try:
                names = [name for name, _ in _look.object_attributes(obj)]
            except RuntimeError:  # changed twice while read: an error, never a part
                continue
            partial += ".t" not in names
    finally:
        stop.set()
        writer.join(timeout=60)
        sys.setswitchinterval(interval)
    assert partial == 0


def test_a_dict_changed_while_read_is_read_again_then_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tries: list[int] = []

    def changes(times: int) -> Any:
        def read(container: dict[str, int]) -> Any:
            tries.append(1)
            if len(tries) <= times:
                raise RuntimeError("dictionary changed size during iteration")
            return dict.items(container)

        return read

    assert _look.snapshot(changes(1), {"a": 1}, None) == (("a", 1),)
    tries.clear()
    with pytest.raises(_look.Changed, match="another thread changed a dict"):
        _look.snapshot(changes(2), {"a": 1}, None)
    assert len(tries) == 2

    def always(read: Any, container: Any, limit: int | None) -> tuple[Any, ...]:
        raise _look.Changed("another thread changed a dict while it was read, twice")

    monkeypatch.setattr(_look, "snapshot", always)
    with pytest.raises(
        RuntimeError, match=r"cannot check batch\['h'\]: another thread changed the attributes"
    ):
        dk.assert_same_device(batch={"h": Holder(torch.ones(1))})


class Tokenizer:
    """A stand-in for a slow tokenizer: large plain data, no tensor."""

    def __init__(self, size: int) -> None:
        self.vocab = collections.OrderedDict((f"w{i}", i) for i in range(size))
        self.ids_to_tokens = {i: token for token, i in self.vocab.items()}
        self.merges = [(f"w{i}", f"w{i + 1}") for i in range(size)]
        self.special = {"pad": ["<pad>", 0], "eos": ["</s>", 1]}
        self.stream = (i for i in range(3))  # a generator: never advanced


def test_plain_data_inside_an_object_is_read_in_bulk_not_refused() -> None:
    # A tokenizer-sized vocabulary (150,000 str -> int) or a dataset's labels was a
    # ValueError: "holds more than 100,000 objects", though no tensor was there.
    np = pytest.importorskip("numpy")
    tok = Tokenizer(150_000)
    labels = Holder(torch.ones(1))
    labels.targets = [float(i % 10) for i in range(300_000)]  # type: ignore[attr-defined]
    labels.array = np.zeros(3)  # type: ignore[attr-defined]
    labels.scalars = [np.float32(i) for i in range(120_000)]  # type: ignore[attr-defined]
    labels.token_ids = {"input_ids": [[1, 2, 3]] * 50_000}  # type: ignore[attr-defined]
    assert dk.assert_same_device(tok=tok, labels=labels, x=torch.ones(1)) == CPU
    assert next(tok.stream) == 0
    # It still looks: a tensor among the plain values, or in a container among them.
    tok.vocab["stray"] = torch.ones(1, device="meta")  # type: ignore[assignment]
    tok.special["eos"].append(torch.ones(1, device="meta"))
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.assert_same_device(tok=tok, x=torch.ones(1))
    assert "  tok.vocab['stray']: meta\n  tok.special['eos'][2]: meta\n" in str(info.value)
    # Among 150,000 pairs, one holding a tensor: each pair is then read one by one.
    tok.merges[149_999] = (torch.ones(1),)  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"tok is a Tokenizer, .* more than 100,000 objects"):
        dk.assert_same_device(tok=tok)


def test_the_bulk_read_is_bounded_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_checkwalk, "_BULK_BUDGET", 1_000)
    holder = Holder(torch.ones(1))
    holder.labels = {"train": list(range(600)), "test": list(range(600))}  # type: ignore[attr-defined]
    with pytest.raises(
        ValueError,
        match=r"^assert_same_device\(\) cannot check arg0: arg0 is a Holder, which it looks "
        r"inside attribute by attribute, and it holds more than 1,000 values in its lists, "
        r"dicts, tuples and sets \(counting what they hold in turn",
    ):
        dk.assert_same_device(holder)
    # The containers given are checked whole, however large.
    assert dk.assert_same_device(holder.labels, torch.ones(1)) == CPU  # type: ignore[attr-defined]


def test_a_container_changed_while_read_in_bulk_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    snapshot = _lookbulk.snapshot

    def changed(read: Any, container: Any, limit: int | None) -> tuple[Any, ...]:
        if read is dict.values:
            raise _look.Changed("another thread changed a dict while it was read, twice")
        return snapshot(read, container, limit)

    monkeypatch.setattr(_lookbulk, "snapshot", changed)
    holder = Holder(torch.ones(1))
    holder.vocab = {"a": 1}  # type: ignore[attr-defined]
    with pytest.raises(
        RuntimeError, match=r"cannot check arg0\.vocab: another thread changed a dict while"
    ):
        dk.assert_same_device(holder)


def test_only_builtin_containers_that_read_as_their_base_are_read_in_bulk() -> None:
    class Vocab(dict):  # type: ignore[type-arg]
        pass

    class Lazy(list):  # type: ignore[type-arg]
        def __iter__(self) -> Any:  # its own code: what to_device() and the walk read
            yield torch.ones(1, device="meta")

    pair = collections.namedtuple("pair", "a b")
    assert _lookbulk.bulk_look(Vocab(a=1, b=[2.0, "c"]), 10) == (6, True)  # keys count too
    assert _lookbulk.bulk_look(torch.Size([2, 3]), 10) == (2, True)
    assert _lookbulk.bulk_look(Lazy([1]), 10) is None
    assert _lookbulk.bulk_look(pair(1, 2), 10) is None
    assert _lookbulk.bulk_look(Holder(torch.ones(1)), 10) is None
    # Not all plain: its own values alone count, the walk counts the rest as it reads them.
    assert _lookbulk.bulk_look([[1], [object()]], 10) == (2, False)
    assert _lookbulk.bulk_look([[[[[1]]]]], 10) == (1, False)  # deeper than it reads in bulk
    assert _lookbulk.bulk_look(list(range(11)), 10) == (11, False)  # over the budget: not read
    holder = Holder(torch.ones(1))
    holder.lazy = Lazy([1])  # type: ignore[attr-defined]
    with pytest.raises(dk.DeviceMismatchError, match=r"arg0\.lazy\[0\]: meta"):
        dk.assert_same_device(holder)
    vocab = Vocab(a=1)
    vocab.embedding = torch.ones(1, device="meta")  # type: ignore[attr-defined]
    with pytest.raises(dk.DeviceMismatchError, match=r"arg0\.x\.embedding: meta"):
        dk.assert_same_device(Holder(vocab), torch.ones(1))  # type: ignore[arg-type]


def test_containers_whose_instances_take_attributes_are_not_read_in_bulk_below() -> None:
    # An OrderedDict has a __dict__: nested below a container read in bulk, only its
    # values were read, and a tensor set as its attribute passed unchecked.
    candidates: tuple[type[Any], ...] = (
        list,
        tuple,
        dict,
        set,
        frozenset,
        collections.deque,
        collections.defaultdict,
        collections.OrderedDict,
        collections.Counter,
    )
    for cls in candidates:
        instance: Any = cls()
        try:
            instance.t = torch.ones(1, device="meta")
        except AttributeError:  # no __dict__: nothing but its items to look at
            continue
        assert id(cls) not in _lookbulk._SEQUENCE_IDS | _lookbulk._MAPPING_IDS, cls
        for payload, path in (
            ([instance], "arg0.x[0].t"),
            ({"k": instance}, "arg0.x['k'].t"),
            ({"k": [instance]}, "arg0.x['k'][0].t"),
        ):
            with pytest.raises(dk.DeviceMismatchError, match=re.escape(f"  {path}: meta")):
                dk.assert_same_device(Holder(payload), torch.ones(1))  # type: ignore[arg-type]


def test_a_container_referred_to_many_times_is_read_and_counted_once() -> None:
    # [[0] * 1000] * 10_000 counted ten million values, one list's thousand read again
    # for each reference, and was refused (it passed before the bulk read).
    assert _lookbulk.bulk_look([[0] * 1000] * 10_000, 20_000) == (11_000, True)
    row = list(range(100))
    table = {"a": row, "b": row}
    assert _lookbulk.bulk_look([table] * 3, 1_000) == (3 + 4 + 100, True)
    assert dk.assert_same_device(Holder([[0] * 1000] * 10_000), torch.ones(1)) == CPU  # type: ignore[arg-type]


def test_a_numpy_array_of_objects_is_looked_inside() -> None:
    # Arrays were plain by their class: dtype=object (or a record with an object field)
    # held a tensor that passed unchecked.
    np = pytest.importorskip("numpy")
    meta = torch.ones(1, device="meta")
    objects = np.empty((2, 2), dtype=object)
    objects[1, 0] = meta
    records = np.empty(2, dtype=[("n", float), ("t", object)])
    records[1]["t"] = meta
    for payload, path in (
        ([objects], "arg0.x[0].flat[2]"),
        ({"k": objects}, "arg0.x['k'].flat[2]"),
        ([records[1]], "arg0.x[0]['t']"),
        ([records], "arg0.x[0].flat[1]['t']"),
    ):
        with pytest.raises(dk.DeviceMismatchError, match=re.escape(f"  {path}: meta")):
            dk.assert_same_device(Holder(payload), torch.ones(1))  # type: ignore[arg-type]
    # Given as an argument, or as an attribute, too; the fix says to move it yourself.
    with pytest.raises(dk.DeviceMismatchError, match=r"  arg0\.flat\[2\]: meta") as info:
        dk.assert_same_device(objects, torch.ones(1))
    assert "it is an ndarray, which dk.to_device() returns unchanged" in str(info.value)
    with pytest.raises(dk.DeviceMismatchError, match=r"  arg0\.x\.flat\[2\]: meta"):
        dk.assert_same_device(Holder(objects), torch.ones(1))
    # Arrays of numbers, and of objects that hold no tensor, still pass. An array of
    # objects is read as a list is: its plain values (200,000 labels) in bulk, which
    # were refused as "more than 100,000 objects"; objects are counted one by one.
    objects[1, 0] = "s"
    numbers = [np.zeros(3)] * 1000 + [np.float32(1)]
    holder = Holder([numbers, objects, records[0]])  # type: ignore[arg-type]
    assert dk.assert_same_device(holder, torch.ones(1)) == CPU
    assert _lookbulk.bulk_look(numbers, 10_000) == (1001, True)
    assert _lookbulk.bulk_look([objects], 10_000) == (1, False)
    labels = np.full(200_000, "s", dtype=object)
    assert dk.assert_same_device(Holder(labels), {"labels": labels}, torch.ones(1)) == CPU
    many = np.array([object() for _ in range(200_000)], dtype=object)
    with pytest.raises(ValueError, match=r"more than 100,000 objects"):
        dk.assert_same_device(Holder(many), torch.ones(1))
    with pytest.raises(ValueError, match=r"more than 100,000 objects") as refused:
        dk.assert_same_device({"x": many}, torch.ones(1))
    # Said as an array, not as an object looked inside attribute by attribute.
    said = "arg0['x'] is an ndarray whose elements of dtype=object it looks at one by one"
    assert said in str(refused.value)


def test_a_numpy_array_of_too_many_labels_is_refused_as_an_array(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    np = pytest.importorskip("numpy")
    monkeypatch.setattr(_checkwalk, "_BULK_BUDGET", 1_000)
    with pytest.raises(ValueError, match=r"arg0\.x is an ndarray of dtype=object whose ") as info:
        dk.assert_same_device(Holder(np.full(5_000, "s", dtype=object)), torch.ones(1))
    assert "elements are more than 1,000" in str(info.value)
    assert "attribute by attribute" not in str(info.value)  # an array has no attributes read


def test_dict_keys_inside_an_object_are_checked() -> None:
    # A tensor used as a dict key passed unchecked, while set members were checked.
    meta = torch.ones(1, device="meta")
    for payload, path in (
        ({meta: 1}, "arg0.x[key tensor(...,"),
        ([{meta: 1}], "arg0.x[0][key tensor(...,"),
        ({"a": {(1, meta): 1}}, "arg0.x['a'][key (1, tensor(...,"),
    ):
        with pytest.raises(dk.DeviceMismatchError, match=re.escape(f"  {path}")):
            dk.assert_same_device(Holder(payload), torch.ones(1))  # type: ignore[arg-type]
    # Plain keys, tuples of them included, are read in bulk with the values.
    assert _lookbulk.bulk_look({(1, "a"): [2], 3: 4}, 100) == (4 + 2 + 1, True)
    assert _lookbulk.bulk_look({object(): 1}, 100) == (2, False)


class _Positions(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.pos = torch.randn(16, 4)  # a plain attribute: Module.to() leaves it behind


def test_a_module_s_plain_tensor_attributes_are_checked() -> None:
    # They were never read: only parameters and buffers were, and the forward then failed
    # with no word from the check. A stray there alone is named in a warning (a module may
    # keep a copy elsewhere on purpose, as transformers' rotary embeddings do), and the
    # check passes; with any other stray, it is in the error.
    model = _Positions().to("meta")
    ids = torch.zeros(2, dtype=torch.long, device="meta")
    with pytest.warns(RuntimeWarning, match=r"every tensor is on meta but for what model holds"):
        assert dk.assert_same_device(model=model, ids=ids) == torch.device("meta")
    with pytest.raises(dk.DeviceMismatchError) as raised:
        dk.assert_same_device(model=model, ids=torch.zeros(2), device="meta")
    assert "  model.pos: cpu\n" in str(raised.value)
    model = torch.nn.Sequential(_Positions(), torch.nn.Linear(4, 4))
    model[0].cache = {"keys": [torch.ones(1, device="meta")], "vocab": {"a": 1}}
    with pytest.warns(RuntimeWarning) as told:
        assert dk.assert_same_device(model=model, device="cpu") == torch.device("cpu")
    said = str(told[0].message)
    assert "(model.0.cache['keys'][0]: meta), which model.to() does not move" in said
    # check_module's own fix, quoted (it named check_module, which the user had to run)
    (fix,) = [f for f in dk.check_module(model) if f.startswith("0.cache:")]
    assert f'fix it as dk.check_module(model) says: "{fix}"' in said
    assert told[0].filename == __file__  # the caller's line
    with pytest.raises(dk.DeviceMismatchError) as raised:
        dk.assert_same_device(model=model, x=torch.ones(1, device="meta"))
    message = str(raised.value)
    assert "  model.0.cache['keys'][0]: meta\n" in message
    assert (
        "for the tensors model holds as plain attributes (model.0.cache['keys'][0]), which "
        f'model.to() does not move: fix it as dk.check_module(model) says: "{fix}", then move '
        "model to cpu" in message
    )


class _Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)
        self.blocks = [torch.nn.Linear(2, 2)]  # not registered: module.to() leaves it


class _Helper:
    def __init__(self) -> None:
        self.table = torch.ones(1)


class _Helped(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)
        self.helper = _Helper()  # an object check_module does not look in


def test_the_fix_for_a_plain_attribute_stray_is_the_one_that_works() -> None:
    # Before: "register it with self.register_buffer() ... (dk.check_module(model) names the
    # fix for each)" for the parameters of modules kept in a list (the fix is nn.ModuleList,
    # never a buffer each), and for a tensor in another object, where check_module says nothing.
    model = _Blocks().to("meta")
    with pytest.warns(RuntimeWarning) as told:
        dk.assert_same_device(model=model)
    said = str(told[0].message)
    assert "register_buffer" not in said
    assert 'says: "blocks: a list holding 1 module' in said
    assert "Use nn.ModuleList." in said
    model = _Helped().to("meta")
    assert dk.check_module(model) == []
    with pytest.warns(RuntimeWarning) as told:
        dk.assert_same_device(model=model)
    said = str(told[0].message)
    assert "check_module" not in said  # it names no fix there
    assert "keep each in a module, registered (self.register_buffer()" in said


def test_what_module_to_moves_or_remakes_is_not_a_plain_attribute_stray() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        normed = torch.nn.utils.weight_norm(torch.nn.Linear(2, 2))  # weight: a plain attribute
    model = torch.nn.Sequential(normed).to("meta")  # weight stays, made again at each call
    assert dk.assert_same_device(model=model) == torch.device("meta")
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.groups = [model[0].weight]  # moved in place with the parameter: listed once
    object.__setattr__(model, "back", model[0])  # a back-reference: moved with the model
    with pytest.raises(dk.DeviceMismatchError, match=r"found 2: meta \(1 tensor\), cpu \(2 "):
        dk.assert_same_device(model=model, x=torch.ones(1, device="meta"))


def test_a_module_s_plain_attributes_are_read_within_a_bound_of_their_own() -> None:
    # A stray there only warns, so past the bound the rest is left unread, not refused:
    # a model keeping its loss history made every step's check slower, then a ValueError.
    model = torch.nn.Linear(2, 2).to("meta")
    model.stray = torch.ones(1)  # type: ignore[assignment]
    model.losses = [torch.tensor(float(step)) for step in range(_checkwalk._ATTRIBUTE_BUDGET * 3)]
    model.rows = [object() for _ in range(_checkwalk._LOOK_BUDGET + 1)]
    with pytest.warns(RuntimeWarning, match=r"\(model\.stray: cpu, model\.losses\[0\]: cpu"):
        assert dk.assert_same_device(model=model) == torch.device("meta")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # told once for this model, not at every step
        for _ in range(3):
            model.losses.append(torch.tensor(0.0))
            assert dk.assert_same_device(model=model) == torch.device("meta")
    plain_only = torch.nn.Module()  # nothing else to judge it by: its attributes decide
    plain_only.pos = torch.ones(1)  # type: ignore[assignment]
    with pytest.raises(dk.DeviceMismatchError, match=r"  plain_only\.pos: cpu"):
        dk.assert_same_device(plain_only=plain_only, x=torch.ones(1, device="meta"))


def test_check_module_reads_plain_data_in_bulk(monkeypatch: pytest.MonkeyPatch) -> None:
    # It read each of a vocabulary's entries in Python: 150,000 took 650 ms.
    from devicekit import _modulecheck, _tree

    calls = []
    for module in (_tree, _modulecheck):
        read = getattr(module, "iter_children", None)
        if read is not None:
            monkeypatch.setattr(
                module, "iter_children", lambda obj, read=read: calls.append(1) or read(obj)
            )
    model = torch.nn.Linear(2, 2)
    model.vocab = {f"tok{index}": index for index in range(10_000)}
    model.merges = [(f"a{index}", f"b{index}") for index in range(10_000)]
    assert dk.check_module(model) == []
    assert len(calls) < 10
    model.vocab["hidden"] = torch.ones(1)
    assert [finding.split(":")[0] for finding in dk.check_module(model)] == ["vocab"]


def test_tensor_keys_of_the_dicts_given_are_checked_too() -> None:
    # Only the keys of dicts inside an object were read: a tensor key of a dict given as it
    # is (or of a UserDict anywhere) passed unchecked, on whatever device it was.
    meta = torch.ones(3, device="meta")
    with pytest.raises(dk.DeviceMismatchError) as raised:
        dk.assert_same_device(batch={meta: torch.ones(1)})
    assert str(raised.value) == (
        "expected every tensor on one device, found 2: cpu (1 tensor), meta (1 tensor)\n"
        "  batch[tensor(..., device='meta', size=(3,))]: cpu\n"
        "  batch[key tensor(..., device='meta', size=(3,))]: meta\n"
        "Fix: move everything to cpu: make batch again with its tensor keys made anew on cpu "
        "(batch[key tensor(..., device='meta', size=(3,))]), since dk.to_device() moves its "
        "values, never its keys, and meta tensors hold no values to copy.\n"
        "Tensors on meta hold no values (shapes only): make them on a real device, or "
        "materialize a model with to_empty() and load its weights."
    )
    with pytest.raises(dk.DeviceMismatchError) as raised:
        dk.assert_same_device({torch.ones(2): torch.ones(1, device="meta")}, device="meta")
    assert str(raised.value).endswith(
        "Fix: move everything to meta: make arg0 again with its tensor keys on meta "
        "(arg0[key tensor(..., device='cpu', size=(2,))]), since dk.to_device() moves its "
        "values, never its keys."
    )
    nested = {"a": [{(1, torch.ones(1, device="meta")): torch.ones(1)}]}
    with pytest.raises(
        dk.DeviceMismatchError,
        match=re.escape("  arg0['a'][0][key (1, tensor(..., device='meta', size=(1,)))][1]: meta"),
    ):
        dk.assert_same_device(nested)
    with pytest.raises(dk.DeviceMismatchError, match=re.escape("  arg0.x[key tensor(...")):
        dk.assert_same_device(Holder(collections.UserDict({meta: 1})), torch.ones(1))  # type: ignore[arg-type]
    # Keys that hold no tensor are passed over, given or inside an object.
    plain = {"a": torch.ones(1), 1: torch.ones(1), (2, "b"): torch.ones(1), None: 3}
    assert dk.assert_same_device(plain, Holder(collections.UserDict(plain))) == CPU  # type: ignore[arg-type]


def test_a_tensor_used_as_a_key_is_named_by_its_device_and_size() -> None:
    # Its path printed the whole tensor, many lines of values, as the key's name.
    key = torch.arange(1000.0).reshape(10, 100)
    for payload, path in (
        ({key: torch.ones(1, device="meta")}, "arg0[tensor(..., device='cpu', size=(10, 100))]"),
        (
            Holder({(1, key): torch.ones(1, device="meta")}),  # type: ignore[arg-type]
            "arg0.x[(1, tensor(..., device='cpu', size=(10, 100)))]",
        ),
    ):
        with pytest.raises(dk.DeviceMismatchError) as raised:
            dk.assert_same_device(payload, torch.ones(1))
        message = str(raised.value)
        assert f"\n  {path}: meta\n" in message
        assert "tensor([" not in message
        assert max(map(len, message.splitlines()[1:-2])) < 80
    # to_device()'s warning names a path the same way.
    cache = Holder({key: torch.ones(1, device="meta")})  # type: ignore[arg-type]
    assert _look.tensor_elsewhere(cache, CPU) == ".x[tensor(..., device='cpu', size=(10, 100))]"


def test_each_value_counts_once_toward_the_bulk_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    # The bulk read counted a level's values again each time the walk went one level down
    # (the read stops three containers deep, or at an object): 600 values were refused as
    # more than 1,000.
    monkeypatch.setattr(_checkwalk, "_BULK_BUDGET", 1_000)
    rows = [[*range(index, index + 100), [0]] for index in range(6)]  # 606 ints, 6 lists
    deep = [[rows]]  # past the depth read in one go
    beside = [list(range(index, index + 100)) for index in range(6)] + [[object()]]
    for payload in (deep, beside):
        assert dk.assert_same_device(Holder(payload), torch.ones(1)) == CPU  # type: ignore[arg-type]
    # More than the bound, once each, is refused as before.
    rows += [[*range(100), [0]] for _ in range(4)]
    with pytest.raises(ValueError, match=r"more than 1,000 values in its lists"):
        dk.assert_same_device(Holder(deep), torch.ones(1))  # type: ignore[arg-type]


def test_a_container_the_walk_has_is_not_read_in_bulk_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Counted once, a list shared by many lists that hold an object each would be read once
    # per list: 200 times here. The walk has it after the first, and it is read no more.
    shared = list(range(5_000))
    payload = [[shared, [object()]] for _ in range(200)]
    read = []
    snapshot = _lookbulk.snapshot

    def counted(reader: Any, container: Any, limit: int | None) -> tuple[Any, ...]:
        values = snapshot(reader, container, limit)
        read.append(len(values))
        return values

    monkeypatch.setattr(_lookbulk, "snapshot", counted)
    assert dk.assert_same_device(Holder(payload), torch.ones(1)) == CPU  # type: ignore[arg-type]
    assert sum(read) < 5 * len(shared)


# A module loaded in part on meta, a quantized model's packed weights, stale parameters.


def test_a_module_partly_on_meta_is_told_to_load_its_meta_tensors_not_to_empty() -> None:
    # to_empty() discards the values of every tensor: here the trained weight and bias too.
    norm = torch.nn.BatchNorm1d(3)
    with torch.no_grad():
        norm.weight.fill_(5.0)
    norm.running_mean = norm.running_mean.to("meta")  # as under init_empty_weights
    with pytest.raises(dk.DeviceMismatchError) as info:
        dk.assert_same_device(norm)
    message = str(info.value)
    assert "to_empty(device=" not in message
    assert (
        "Fix: move everything to cpu: load values into arg0's 1 tensor on meta "
        "(arg0.running_mean): arg0.load_state_dict(state_dict, strict=False, assign=True) with "
        "a state dict holding it on cpu"
    ) in message
    assert "not arg0.to_empty(), which would discard the values of its other 4 tensors." in message
    # The fix, as it says, keeps the trained values.
    norm.load_state_dict({"running_mean": torch.zeros(3)}, strict=False, assign=True)
    assert dk.assert_same_device(norm) == CPU
    assert norm.weight.tolist() == [5.0, 5.0, 5.0]
    # A module all on meta is still told to_empty(): it has no values to lose.
    with pytest.raises(dk.DeviceMismatchError, match=r"arg0\.to_empty\(device='cpu'\), then"):
        dk.assert_same_device(torch.nn.BatchNorm1d(3).to("meta"), torch.ones(1))


def test_a_module_partly_on_meta_elsewhere_than_the_target_is_moved_after_it_is_loaded() -> None:
    root: _checkfix.Path = (None, "model")
    metas: list[_checkfix.Path] = [(root, ".norm.running_mean")]
    where = {META: metas, CPU: [(root, ".fc.weight"), (root, ".fc.bias")], CUDA0: ["x"] * 9}
    fix = _checkfix._fix(
        where,
        {"model": {META, CPU}, "batch": {CUDA0}},
        {"model": torch.nn.Linear(1, 1), "batch": {}},
        on_meta={"model": (metas, 3)},
    )
    assert fix[0].startswith(
        "Fix: move everything to cuda:0: load values into model's 1 tensor on meta "
        "(model.norm.running_mean): model.load_state_dict(state_dict, strict=False, "
        "assign=True) with a state dict holding it on cuda:0"
    )
    assert fix[0].endswith(
        ", then model.to('cuda:0'); not model.to_empty(), which would discard the values of its "
        "other 2 tensors."
    )
    assert "to_empty() discards the values of every tensor of a model" in fix[1]


def _quantized(layers: int = 1) -> torch.nn.Module:
    """A model quantized dynamically: its linear layers' weights are in ScriptObjects."""
    quantization = pytest.importorskip("torch.ao.quantization")
    linears = [torch.nn.Linear(4, 4) for _ in range(layers)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization is deprecated
        try:
            model = quantization.quantize_dynamic(
                torch.nn.Sequential(*linears, torch.nn.LayerNorm(4)),
                {torch.nn.Linear},
                dtype=torch.qint8,
            )
        except (RuntimeError, NotImplementedError) as error:  # no quantized engine here
            pytest.skip(f"dynamic quantization is not available: {error}")
    assert type(model[0]._packed_params._packed_params) is torch.ScriptObject
    return model


def test_the_packed_weights_of_a_quantized_model_are_named_not_found_no_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from devicekit import _checks

    monkeypatch.setattr(_checks, "_warned_unread", set())
    model = _quantized()
    del model[1]  # its LayerNorm: no tensor left that Python can read
    # It said "found no tensor in arg0; pass the tensors, modules or batches to check".
    with pytest.raises(ValueError, match=r"could not look inside arg0\.0\._packed") as info:
        dk.assert_same_device(model)
    message = str(info.value)
    assert message.startswith(
        "assert_same_device() found no tensor in arg0, but it could not look inside "
        "arg0.0._packed_params._packed_params (a ScriptObject: torch keeps what this "
        "LinearPackedParamsBase holds in C++, where Python cannot read it, as it keeps a "
        "quantized module's packed weights), so it cannot say there is none."
    )
    # Beside tensors it saw, the check passes with a warning naming them, once.
    many = _quantized(layers=5)
    meta = torch.ones(1, device="meta")
    with pytest.warns(RuntimeWarning) as warned:
        assert dk.assert_same_device(model=many[:5], x=meta) == META
    assert (
        "every tensor it saw is on meta, but it could not look inside "
        "model.0._packed_params._packed_params, model.1._packed_params._packed_params, "
        "model.2._packed_params._packed_params and 2 more (ScriptObjects: torch keeps"
    ) in str(warned[0].message)
    # Objects that hold no tensor of the user's are passed over inside, as before: torch's
    # own C objects, a weak reference, a TorchScript module's C++ half (its _c).
    inside = {"g": torch.Generator(), "ref": weakref.ref(Holder), "x": torch.ones(1)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit is deprecated
        inside["scripted"] = torch.jit.script(torch.nn.Linear(1, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dk.assert_same_device(model=many[:5], x=meta) == META
        assert dk.assert_same_device(inside) == CPU


def test_check_module_names_the_packed_weights_module_to_leaves_where_they_are() -> None:
    model = _quantized()
    # It returned [], "empty when module.to() moves everything": Module.to('meta') left them.
    assert dk.check_module(model) == [
        "0._packed_params._packed_params: a torch.ScriptObject (LinearPackedParamsBase) held as "
        "a plain attribute; check_module cannot look inside it (torch keeps what it holds in "
        "C++, as it keeps a quantized module's packed weights), and module.to() will not move "
        "it or any tensor in it. Where the forward uses tensors in it, make it again on the "
        "device the model is moved to."
    ]
    packed = model[0]._packed_params._packed_params
    model.to("meta")
    assert model[0]._packed_params._packed_params is packed
    assert model[0].weight().device == CPU


class _Decayed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)
        self.decay = [self.fc.weight]  # the module's own: moved in place, not reported


def test_parameters_left_in_a_list_by_a_move_that_made_new_ones_are_named_so() -> None:
    model = _Decayed()
    assert dk.check_module(model) == []
    torch.nn.Module.to(model, "meta")  # new parameters: the list keeps the old ones
    # It said only "Use nn.ParameterList to register them": a second, stale copy.
    (finding,) = dk.check_module(model)
    assert finding.startswith("decay: a list of 1 nn.Parameter on cpu held as a plain attribute")
    assert finding.endswith(
        "Use nn.ParameterList to register them. It is not among the module's parameters: "
        "either it was never registered (then the fix above), or it is left from before a move "
        "that made new parameters (.to('meta'), .to_empty(), load_state_dict(..., assign=True); "
        "the module's 'fc.weight' has the shape and dtype of decay[0], and is on meta): then "
        "make decay again from the module's parameters after moving it, or read it through its "
        "module where used."
    )
    with pytest.warns(RuntimeWarning, match=r"It is not among the module's parameters"):
        assert dk.assert_same_device(model) == META


def test_a_torch_wrapper_s_own_list_of_parameters_gets_no_advice(tmp_path: Any) -> None:
    # DistributedDataParallel keeps _module_parameters: not the user's to register.
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        assert ddp._module_parameters
        torch.nn.Module.to(ddp, "meta")  # the list keeps the old parameters
        assert dk.check_module(ddp) == []
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert dk.assert_same_device(ddp) == META
    finally:
        dist.destroy_process_group()
