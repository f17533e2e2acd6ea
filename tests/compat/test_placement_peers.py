"""``to_device`` against the real peers: accelerate, Lightning, transformers' output classes.

Every batch is moved to the ``meta`` device (every tensor is really copied,
and no GPU is needed) by devicekit and by the peer, and the two results are
compared element by element: types, keys, order, devices, shapes, and which
objects are the same object. Where a peer does something else on purpose,
the test says so.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import types
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit import _mover, _tree

META = torch.device("meta")
Move = Callable[[Any], Any]
# A model's cache stays behind, as with both peers: one test checks the warning that says so.
pytestmark = pytest.mark.filterwarnings("ignore:to_device\\(\\) returned a transformers")


def accelerate_move() -> Move:
    operations = pytest.importorskip("accelerate.utils.operations")
    return lambda obj: operations.send_to_device(obj, META)


def lightning_move() -> Move:
    apply_func = pytest.importorskip("lightning.fabric.utilities.apply_func")
    return lambda obj: apply_func.move_data_to_device(obj, META)


def tiny_gpt2_output(*, use_cache: bool = True) -> Any:
    """A real ``CausalLMOutputWithCrossAttentions`` from a one-layer GPT-2 (no download)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=8, vocab_size=16, n_positions=8, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.tensor([[1, 2, 3]])
    return model(
        input_ids=ids,
        labels=ids,
        output_hidden_states=True,
        output_attentions=True,
        use_cache=use_cache,
    )


def assert_same(ours: Any, theirs: Any, path: str = "obj") -> None:
    """The same structure: types, keys in order, tensors on the same device with the same shape."""
    assert type(ours) is type(theirs), f"{path}: {type(ours)} vs {type(theirs)}"
    if isinstance(ours, torch.Tensor):
        assert (ours.device, ours.shape, ours.dtype) == (theirs.device, theirs.shape, theirs.dtype)
        return
    if isinstance(ours, Mapping):
        assert list(ours) == list(theirs), path
        for key in ours:
            assert_same(ours[key], theirs[key], f"{path}[{key!r}]")
        if dataclasses.is_dataclass(ours):
            for field in dataclasses.fields(ours):
                assert_same(getattr(ours, field.name), getattr(theirs, field.name), path)
        return
    if isinstance(ours, (list, tuple)):
        assert len(ours) == len(theirs), path
        for index, (mine, other) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(mine, other, f"{path}[{index}]")
        return
    if dataclasses.is_dataclass(ours):
        for field in dataclasses.fields(ours):
            assert_same(getattr(ours, field.name), getattr(theirs, field.name), f"{path}.{field}")
        return
    assert ours is theirs or ours == theirs, path


def tensors_in(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for value in obj.values() for t in tensors_in(value)]
    if isinstance(obj, (list, tuple)):
        return [t for value in obj for t in tensors_in(value)]
    return []


# --- transformers' real output classes ----------------------------------------------------


def test_a_real_model_output_keeps_its_type_items_and_attributes() -> None:
    output = tiny_gpt2_output()
    moved = dk.to_device(output, META)
    assert type(moved) is type(output)
    assert list(moved) == list(output)
    assert tensors_in(moved)  # the logits, the loss, the hidden states and attentions
    assert all(t.device == META for t in tensors_in(moved))
    assert all(t.device.type == "cpu" for t in tensors_in(output))  # the original is untouched
    for key in moved:
        assert moved[key] is getattr(moved, key)  # items and attributes stay one object
    assert len(moved.to_tuple()) == len(output.to_tuple())
    assert moved.past_key_values is output.past_key_values  # a Cache has no .to(): unchanged


def test_a_real_model_output_moves_as_accelerate_moves_it() -> None:
    output = tiny_gpt2_output()
    assert_same(dk.to_device(output, META), accelerate_move()(output))


def test_a_real_model_output_moves_as_lightning_moves_it() -> None:
    output = tiny_gpt2_output()
    assert_same(dk.to_device(output, META), lightning_move()(output))


def test_a_batch_encoding_moves_as_the_peers_move_it() -> None:
    transformers = pytest.importorskip("transformers")
    encoding = transformers.BatchEncoding(
        {"input_ids": torch.tensor([[1, 2]]), "attention_mask": torch.ones(1, 2)}
    )
    ours = dk.to_device(encoding, META)
    assert type(ours) is transformers.BatchEncoding
    assert all(t.device == META for t in ours.values())
    assert_same(ours, accelerate_move()(encoding))
    assert_same(ours, lightning_move()(encoding))


def _tokenized() -> Any:
    """A real fast tokenizer's BatchEncoding (its encodings, n_sequences), made offline."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    vocabulary = {"[UNK]": 0, "[PAD]": 1, "a": 2, "b": 3}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]"
    )
    return fast(["a b", "b"], padding=True, return_tensors="pt")


def test_a_batch_encoding_is_rebuilt_never_changed_and_keeps_shared_tensors() -> None:
    # Before, its own .to() ran: it moved the caller's encoding in place (the result was
    # the input), and labels = input_ids came back as two copies.
    encoding = _tokenized()
    encoding["labels"] = encoding["input_ids"]
    encoding["pixel_values"] = [torch.ones(1)]  # nested: its .to() left it behind
    ids = encoding["input_ids"]
    ours = dk.to_device(encoding, META)
    assert type(ours) is type(encoding)
    assert ours is not encoding
    assert encoding["input_ids"] is ids  # the input is never changed
    assert ours["labels"] is ours["input_ids"]  # a tensor reached twice is moved once
    assert ours["pixel_values"][0].device == META
    # What a tokenizer's encoding holds besides its items is kept.
    assert ours.n_sequences == encoding.n_sequences == 1
    assert ours.word_ids(0) == encoding.word_ids(0)
    assert ours.encodings == encoding.encodings
    # As its own .to() moves a copy of it (a shallow copy, so the input stays).
    theirs = copy.copy(encoding).to(META)
    theirs["pixel_values"] = ours["pixel_values"]  # the one it leaves behind
    assert_same(ours, theirs)
    batch = dk.to_device({"enc": encoding, "ids": ids}, META)
    assert batch["enc"]["input_ids"] is batch["ids"]  # shared with the rest of the batch


def test_the_checks_see_a_batch_encoding_and_a_model_output_once_each() -> None:
    # Their storage (BatchEncoding's UserDict .data) and their mirrors (a ModelOutput's
    # fields) are their items: never a second path to the same tensor.
    transformers = pytest.importorskip("transformers")
    encoding = transformers.BatchEncoding({"input_ids": torch.tensor([[1, 2]])})
    paths = [path for path, _ in _tree.iter_tensors(encoding, "enc")]
    assert paths == ["enc['input_ids']"]
    output = tiny_gpt2_output(use_cache=False)
    paths = [path for path, _ in _tree.iter_tensors(output, "out")]
    assert paths
    assert all(path.startswith("out[") for path in paths)
    assert dk.assert_same_device(dk.to_device(output, META)) == META


def test_a_model_output_s_cache_is_left_as_the_peers_leave_it_but_not_in_silence() -> None:
    # A transformers cache has no .to(), and its layers record their device: devicekit
    # returns it unchanged, as accelerate and Lightning do, but says so, and the check
    # names the tensors left behind (accelerate and Lightning say nothing).
    output = tiny_gpt2_output()
    cache = output["past_key_values"]
    _mover.looks_left.pop(type(cache), None)  # warned once per class: as if never met
    with pytest.warns(
        RuntimeWarning,
        match=r"returned a transformers\.cache_utils\.DynamicCache as it is: .* \(DynamicCache"
        r"\.layers\[0\]\.keys\).* pass use_cache=False",
    ):
        moved = dk.to_device(output, META)
    assert moved["past_key_values"] is cache
    assert accelerate_move()(output)["past_key_values"] is cache
    assert lightning_move()(output)["past_key_values"] is cache
    # transformers 5.24 keeps it under "cache" ("past_key_values" reads it still).
    key = "cache" if "cache" in output else "past_key_values"
    with pytest.raises(dk.DeviceMismatchError, match=rf"arg0\['{key}'\]\.layers\[0\]\.keys: cpu"):
        dk.assert_same_device(moved)


# --- containers ---------------------------------------------------------------------------


class Lengths(dict[str, Any]):
    """A batch that was given an attribute besides its items."""


@pytest.mark.parametrize("peer", [accelerate_move, lightning_move])
def test_a_dict_subclass_s_attributes_are_moved_where_the_peers_drop_them(
    peer: Callable[[], Move],
) -> None:
    # Both peers rebuild it as type(batch)(items): its attributes are gone. devicekit
    # keeps them, moved (a deliberate difference, in docs/placement.md).
    batch = Lengths(x=torch.ones(1))
    batch.lengths = torch.ones(1)  # type: ignore[attr-defined]
    ours, theirs = dk.to_device(batch, META), peer()(batch)
    assert_same(dict(ours), dict(theirs))  # the same items
    assert ours.lengths.device == META  # type: ignore[attr-defined]
    assert not hasattr(theirs, "lengths")


def nested_batch() -> dict[str, Any]:
    shared = torch.ones(2)
    return {
        "inputs": {"ids": [torch.arange(3), shared], "mask": (torch.ones(3), None)},
        "targets": [{"y": torch.zeros(1), "w": shared, "name": "a"}],
        "ordered": collections.OrderedDict([("z", torch.ones(1)), ("a", torch.ones(1))]),
    }


@pytest.mark.parametrize("peer", [accelerate_move, lightning_move])
def test_nested_batches(peer: Callable[[], Move]) -> None:
    batch = nested_batch()
    ours = dk.to_device(batch, META)
    assert_same(ours, peer()(batch))
    # devicekit also keeps one tensor reached twice as one moved tensor
    assert ours["inputs"]["ids"][1] is ours["targets"][0]["w"]


@pytest.mark.parametrize("peer", [accelerate_move, lightning_move])
def test_counters_keep_their_counts(peer: Callable[[], Move]) -> None:
    counts: collections.Counter[str] = collections.Counter({"cat": 2, "dog": 1})
    ours = dk.to_device(counts, META)
    assert ours == counts
    assert_same(ours, peer()(counts))


def test_defaultdicts_keep_their_factory_as_with_lightning() -> None:
    # accelerate rebuilds a mapping as type(m)(items), which a defaultdict refuses.
    groups: collections.defaultdict[str, Any] = collections.defaultdict(list)
    groups["x"] = torch.ones(1)
    ours = dk.to_device(groups, META)
    theirs = lightning_move()(groups)
    assert_same(ours, theirs)
    assert ours.default_factory is theirs.default_factory is list


@dataclasses.dataclass
class Features:
    x: torch.Tensor
    label: str

    @functools.cached_property
    def doubled(self) -> torch.Tensor:
        return self.x * 2


def test_dataclasses_drop_cached_properties_as_with_lightning() -> None:
    # accelerate returns a dataclass unchanged, its tensors where they were.
    features = Features(torch.ones(2), "a")
    assert features.doubled.device.type == "cpu"  # cached on the original
    ours = dk.to_device(features, META)
    theirs = lightning_move()(features)
    assert_same(ours, theirs)
    assert "doubled" not in vars(ours)
    assert "doubled" not in vars(theirs)
    assert ours.doubled.device == theirs.doubled.device == META


@dataclasses.dataclass
class Masked:
    x: torch.Tensor

    def __post_init__(self) -> None:
        self.mask = self.x > 0  # not a field


def test_attributes_that_are_not_fields_are_moved_where_the_peers_leave_them() -> None:
    # accelerate returns the dataclass itself; Lightning moves its fields and deep-copies
    # the rest, so its copy's mask is a new CPU tensor beside a moved x: a mixed-device
    # object (a deliberate difference, in docs/placement.md).
    batch = Masked(torch.ones(2))
    accelerated = accelerate_move()(batch)
    assert accelerated is batch
    lightning = lightning_move()(batch)
    assert lightning.x.device == META
    assert lightning.mask.device.type == "cpu"
    assert lightning.mask is not batch.mask
    ours = dk.to_device(batch, META)
    assert ours.x.device == ours.mask.device == META


class MovesItself:
    def __init__(self) -> None:
        self.tensor = torch.ones(1)

    def to(self, device: torch.device, **kwargs: Any) -> None:
        self.tensor = self.tensor.to(device)


def test_an_object_whose_to_returns_none_is_kept_as_with_lightning() -> None:
    # accelerate returns what .to() returned: None.
    move = lightning_move()
    ours, theirs = MovesItself(), MovesItself()
    with pytest.warns(RuntimeWarning, match=r"\.to\(\) returned None"):
        assert dk.to_device([ours], META)[0] is ours
    assert move([theirs])[0] is theirs
    assert ours.tensor.device == theirs.tensor.device == META


@pytest.mark.parametrize("peer", [accelerate_move, lightning_move])
def test_tensors_already_there_are_the_same_objects(peer: Callable[[], Move]) -> None:
    batch = {"x": torch.ones(1, device="meta"), "y": [torch.zeros(1, device="meta")]}
    ours, theirs = dk.to_device(batch, META), peer()(batch)
    assert ours["x"] is theirs["x"] is batch["x"]
    assert ours["y"][0] is theirs["y"][0] is batch["y"][0]


@pytest.mark.parametrize("peer", [accelerate_move, lightning_move])
def test_namespaces_and_attrs_records_are_moved_where_the_peers_leave_them(
    peer: Callable[[], Move],
) -> None:
    # Both peers return these unchanged, their tensors where they were: devicekit
    # moves them as it moves a dataclass (a deliberate difference, in docs/placement.md).
    attrs = pytest.importorskip("attrs")

    @attrs.define
    class Record:
        x: torch.Tensor

    for record in (types.SimpleNamespace(x=torch.ones(1)), Record(torch.ones(1))):
        theirs = peer()(record)
        assert theirs is record
        assert theirs.x.device.type == "cpu"
        ours = dk.to_device(record, META)
        assert type(ours) is type(record)
        assert ours.x.device == META
