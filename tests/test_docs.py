"""The Python snippets of pages that promise to run as written do, as scripts, on any machine."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).parent.parent / "docs"
# Pages whose every snippet is a whole program. Other pages show fragments
# (`train(model)`, a `batch` from elsewhere) that are not meant to run alone.
RUNNABLE = ["questions.md", "nvml.md"]
_SNIPPET = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def snippets() -> list[tuple[str, str]]:
    found = []
    for page in RUNNABLE:
        text = (DOCS / page).read_text(encoding="utf-8")
        found += [(f"{page}#{n}", code) for n, code in enumerate(_SNIPPET.findall(text), 1)]
    return found


def test_each_runnable_page_has_snippets() -> None:
    assert {name.split("#")[0] for name, _ in snippets()} == set(RUNNABLE)


@pytest.mark.parametrize(("name", "code"), snippets(), ids=[name for name, _ in snippets()])
def test_snippet_runs_as_a_script(name: str, code: str, tmp_path: Path) -> None:
    # As a file, not `python -c`: gpu_map's spawned workers import the main script.
    script = tmp_path / "snippet.py"
    script.write_text(code, encoding="utf-8")
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 0, f"{name}:\n{result.stderr}"
