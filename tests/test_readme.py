"""README.md holds the two set-up commands, and .ci/run runs the test command verbatim (NIXL tests required)."""

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
    # Editable: the C extension (the ring's atomics) is built into src/, which the tests import.
    assert any("pip install -e '.[test]'" in c and c.endswith("python -m pytest -q") for c in cmds), cmds


def test_ci_runs_the_readme_test_command():
    test_cmd = next(c for c in _commands() if c.endswith("python -m pytest -q"))
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in ci


def test_ci_builds_the_docs_with_warnings_as_errors_and_checks_nvrtc():
    ci = (ROOT / ".ci" / "run").read_text()
    docs_cmd = "python -m sphinx -W --keep-going -b html docs docs/_build/html"
    assert docs_cmd in ci and docs_cmd in (ROOT / "README.md").read_text()
    assert 'load_nvidia_dynamic_lib("nvrtc")' in ci


def test_test_command_installs_nixl_without_torch_and_ci_requires_it():
    test_cmd = next(c for c in _commands() if c.endswith("python -m pytest -q"))
    m = re.search(r"pip install --no-deps 'nixl-cu13==([0-9.]+)'", test_cmd)
    assert m, test_cmd
    extra = re.search(r'nixl = \["nixl-cu13>=([0-9.]+),<([0-9]+)"\]', (ROOT / "pyproject.toml").read_text())
    assert extra and m.group(1) == extra.group(1) and int(m.group(1).split(".")[0]) < int(extra.group(2))
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    require = [i for i, line in enumerate(ci) if line.startswith("export DMABUF_INTEROP_REQUIRE_NIXL=1")]
    assert require and require[0] < ci.index(test_cmd)  # the NIXL tests fail rather than skip in CI


def test_ci_requires_the_ring():
    """CI builds the ring's C extension (the editable install) and its tests fail rather than skip there."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    test_cmd = next(c for c in _commands() if c.endswith("python -m pytest -q"))
    require = [i for i, line in enumerate(ci) if line.startswith("export DMABUF_INTEROP_REQUIRE_RING=1")]
    assert require and require[0] < ci.index(test_cmd)
    assert 'optional=True' in (ROOT / "setup.py").read_text()  # no compiler: the package installs all the same


def test_the_html_docs_hold_every_guide():
    """docs/index.rst lists the README (through docs/readme.md) and every Markdown guide, read by MyST."""
    index = (ROOT / "docs" / "index.rst").read_text()
    pages = set(re.findall(r"^   ([\w-]+)$", index, re.M))
    guides = {p.stem for p in (ROOT / "docs").glob("*.md")}
    assert guides == pages - {"api"} and "readme" in guides and "protocol" in guides
    assert "../README.md" in (ROOT / "docs" / "readme.md").read_text()
    assert '"myst_parser"' in (ROOT / "docs" / "conf.py").read_text()
    assert re.search(r'^docs = \[.*"myst-parser>=', (ROOT / "pyproject.toml").read_text(), re.M)
