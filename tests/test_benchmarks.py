"""Every benchmark script still loads against the library as it is (its --help runs).

The benchmarks reach into private modules to time parts alone; a module split
moves what they import. Running them whole takes minutes, so this checks what
breaks first: the imports and the module-level code, through ``--help``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).parent.parent / "benchmarks").glob("*.py"))


def test_there_are_benchmarks() -> None:
    assert BENCHMARKS


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda path: path.name)
def test_benchmark_loads_and_shows_its_options(script: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(script), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage:"), result.stdout
