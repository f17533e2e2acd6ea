"""`Conditions`: a document read back checks each field (it may have been edited by hand)."""

from __future__ import annotations

import json
from typing import Any

import pytest

import devicekit as dk

_FULL = dk.Conditions(
    device="cuda:0",
    gpu_name="NVIDIA H100",
    other_processes=(dk.GPUProcess(pid=7, name="python", used_memory=2**30, kind="compute"),),
    utilization_before=3,
    sm_clock_min=1755,
    sm_clock_max=1980,
    throttle_reasons=("sw_thermal",),
    load_average=1.5,
    cpu_count=2,
    cpu_window=0.25,
    other_cpu_time=0.01,
    steal_time=0.0,
    preemptions=4,
    competitors=((11, "make"), (12, None)),
)


def _document(**changes: Any) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(json.dumps(_FULL.to_dict()))
    document.update(changes)
    return document


def test_a_document_round_trips_through_json() -> None:
    assert dk.Conditions.from_dict(_document()) == _FULL
    assert dk.Conditions.from_dict({"device": "cpu"}) == dk.Conditions(device="cpu")


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        # Before, each of these loaded, and the notes later broke or said nonsense.
        ({"device": 5}, TypeError, r"device must be a string, got 5 of type int$"),
        ({"gpu_name": 3}, TypeError, r"gpu_name must be a string, got 3 of type int$"),
        ({"sm_clock_min": -1}, ValueError, r"sm_clock_min must be an int >= 0, got -1$"),
        ({"preemptions": 1.5}, TypeError, r"preemptions must be an int >= 0, got 1.5 of type"),
        ({"load_average": "x"}, TypeError, r"load_average must be a finite number >= 0, got 'x'"),
        ({"steal_time": -0.1}, ValueError, r"steal_time must be a finite number >= 0, got -0.1"),
        ({"throttle_reasons": "hw"}, TypeError, r"throttle_reasons must be a list or None, got"),
        ({"throttle_reasons": [1]}, TypeError, r"throttle_reasons must be a list of strings"),
        ({"competitors": [[1]]}, TypeError, r"competitors must be a list of \[pid, name\] pairs"),
        ({"other_processes": [{"x": 1}]}, ValueError, r"other_processes: each must be a GPUPr"),
        # Before, these loaded, then the repr raised (a name not a string) or a count of 0
        # judged a loaded machine trustworthy.
        ({"competitors": [[1, 2]]}, TypeError, r"pairs \(name a string or null\), got"),
        (
            {"other_processes": [{"pid": 5, "name": 7, "used_memory": 1, "kind": "compute"}]},
            TypeError,
            r"other_processes: each must be a GPUProcess's fields: .*'name' must be a str",
        ),
        ({"cpu_count": 0}, ValueError, r"cpu_count must be an int >= 1, got 0$"),
        ({"device": ""}, ValueError, r"device must name a device \('cpu', 'cuda:0', 'unk"),
        ({"cpu_window": 0}, ValueError, r"cpu_window must be a finite number > 0, got 0 \(null"),
        ({"nope": 1}, ValueError, r"no field 'nope' in Conditions$"),
    ],
    ids=repr,
)
def test_a_malformed_field_is_refused_by_name(
    changes: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=r"^Conditions.from_dict\(\): .*" + message):
        dk.Conditions.from_dict(_document(**changes))


def test_what_is_not_a_document_is_refused() -> None:
    with pytest.raises(TypeError, match=r"needs a mapping, got None of type NoneType$"):
        dk.Conditions.from_dict(None)  # type: ignore[arg-type]
    document = _document()
    del document["device"]
    with pytest.raises(ValueError, match=r"the document has no 'device'$"):
        dk.Conditions.from_dict(document)


def test_a_measurement_document_names_its_conditions_field() -> None:
    document = json.loads(json.dumps(dk.Measurement.from_times([0.01] * 7).to_dict(times=True)))
    document["conditions"]["device"] = 5
    with pytest.raises(
        TypeError, match=r"conditions: Conditions.from_dict\(\): device must be a string, got 5"
    ):
        dk.Measurement.from_dict(document)


def test_a_process_nvml_gave_no_pid_for_is_named_as_unknown() -> None:
    unnamed = dk.GPUProcess(pid=None, name=None, used_memory=2**30, kind="compute")
    conditions = dk.Conditions(device="cuda:0", other_processes=(unnamed,))
    (note,) = [n for n in conditions.notes() if "other process" in n]
    assert "pid ?" in note
    assert "pid None" not in note
    assert dk.Conditions.from_dict(json.loads(json.dumps(conditions.to_dict()))) == conditions
