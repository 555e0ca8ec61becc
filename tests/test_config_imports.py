"""No import cycle inside elasticdl.config, and the import-linter contracts that keep it so.

config, config.sections, config.paths and config.kubernetes once imported one another in a
cycle (through the package's __init__). The contracts in pyproject.toml must fail when such
a cycle comes back: each case below plants one in a copy of the package and runs lint-imports
on it, after checking that the unchanged copy passes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(REPO / "pyproject.toml"), "--no-cache"],
        cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True, timeout=120,
    )


@pytest.fixture(scope="module")
def copy(tmp_path_factory):
    root = tmp_path_factory.mktemp("lint")
    shutil.copytree(REPO / "elasticdl", root / "elasticdl", ignore=shutil.ignore_patterns("__pycache__"))
    return root


PLANTED = {
    # a module importing the package, whose __init__ imports every module (the old cycle)
    "paths.py imports the package": ("paths.py", "from elasticdl.config import check_job_name  # noqa\n"),
    "a lower module imports an upper one": ("kubernetes.py", "from elasticdl.config.sections import LOG_LEVELS  # noqa\n"),
}


@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="lint-imports is not installed beside this Python")
@pytest.mark.parametrize("case", PLANTED)
def test_the_contracts_fail_on_a_cycle_inside_elasticdl_config(copy, case):
    assert _lint(copy).returncode == 0, "the unchanged copy must pass"
    module, line = PLANTED[case]
    path = copy / "elasticdl" / "config" / module
    original = path.read_text()
    try:
        path.write_text(original + line)
        result = _lint(copy)
    finally:
        path.write_text(original)
    assert result.returncode != 0
    assert "elasticdl.config: its modules in layers" in result.stdout and "BROKEN" in result.stdout

