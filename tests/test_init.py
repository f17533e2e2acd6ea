"""The public API: one list of names, loaded lazily, each from the module that owns it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import devicekit as dk

from .conftest import run_python

INIT = Path(dk.__file__)


def _type_checking_imports() -> dict[str, str]:
    tree = ast.parse(INIT.read_text())
    (block,) = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
    ]
    found = {}
    for statement in block.body:
        assert isinstance(statement, ast.ImportFrom)
        for alias in statement.names:
            assert alias.asname == alias.name  # `import x as x`: a deliberate re-export
            found[alias.name] = f".{statement.module}"
    return found


def test_all_names_the_type_checking_imports_and_the_lazy_map_agree() -> None:
    imports = _type_checking_imports()
    assert imports == dk._EXPORTS
    assert sorted(dk.__all__) == dk.__all__
    assert set(dk.__all__) == {*imports, "__version__"}


def test_every_public_name_loads_from_its_module() -> None:
    for name in dk.__all__:
        value = getattr(dk, name)
        assert value is not None, name
    assert dir(dk) == sorted(dk.__all__)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
        dk.no_such_thing  # type: ignore[attr-defined]  # noqa: B018


def test_import_devicekit_imports_no_torch() -> None:
    check = "print(json.dumps('torch' in sys.modules))"
    assert run_python(f"import json, sys, devicekit as dk; {check}") is False
    # ...and the first real name brings it in.
    assert run_python(f"import json, sys, devicekit as dk; dk.try_gpu(); {check}") is True
