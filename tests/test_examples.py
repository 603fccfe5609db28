"""Every script in examples/ runs to completion, and the README's API snippet is an excerpt of the quickstart."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
# Generous: a first run on a cold numba cache compiles the CPU kernels (about 30 s on 2 idle cores).
EXAMPLE_TIMEOUT_S = 300


def test_examples_exist():
    assert ROOT / "examples" / "quickstart.py" in EXAMPLES


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda path: path.name)
def test_example_runs(script):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), *sys.path]))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=EXAMPLE_TIMEOUT_S)
    assert proc.returncode == 0, f"{script.name} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.strip(), f"{script.name} printed nothing"


def readme_api_snippet() -> list[str]:
    """The code lines of the README's "The API in brief" Python block."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## The API in brief", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert block, "README: no ```python block under '## The API in brief'"
    return block.group(1).splitlines()


def test_readme_snippet_is_an_excerpt_of_the_quickstart():
    """Each non-blank snippet line appears in quickstart.py, in the same order (indentation aside);
    a line ``...`` marks an elision."""
    source = [line.strip() for line in (ROOT / "examples" / "quickstart.py").read_text(encoding="utf-8").splitlines()]
    position = 0
    for line in readme_api_snippet():
        wanted = line.strip()
        if not wanted or wanted == "...":
            continue
        try:
            position = source.index(wanted, position) + 1
        except ValueError:
            pytest.fail(f"README snippet line not found in examples/quickstart.py (in order): {wanted!r}")
