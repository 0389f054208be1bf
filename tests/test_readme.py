"""README.md holds the two set-up commands, and .ci/run runs the test command verbatim."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [c.strip() for c in re.findall(r"```bash\n(.*?)```", text, re.S)]


def test_readme_has_the_two_setup_commands():
    cmds = _commands()
    assert any(c.endswith("&& dmabuf-interop") and "pip install ." in c for c in cmds), cmds
    assert any("pip install '.[test]'" in c and c.endswith("python -m pytest -q") for c in cmds), cmds


def test_ci_runs_the_readme_test_command():
    test_cmd = next(c for c in _commands() if c.endswith("python -m pytest -q"))
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in ci


def test_ci_builds_the_docs_with_warnings_as_errors_and_checks_nvrtc():
    ci = (ROOT / ".ci" / "run").read_text()
    docs_cmd = "python -m sphinx -W --keep-going -b html docs docs/_build/html"
    assert docs_cmd in ci and docs_cmd in (ROOT / "README.md").read_text()
    assert 'load_nvidia_dynamic_lib("nvrtc")' in ci
