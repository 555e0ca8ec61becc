"""The quick start works as written: the shell commands of README.md and docs/getting_started.md
run, and every key of the report is documented.

The commands are taken from the ```bash blocks of the two pages, so a command that stops working
(a renamed flag, a moved file, a changed default) fails here. They run as written in a scratch
directory, with changes to keep the suite fast: one epoch and one worker per job (the
--num_epochs and --num_workers values are rewritten), independent commands side by side (the
data first, then the training jobs, then what reads their output; a job without --job_name
gets one, since two default names made in the same second would collide), and `elasticdl`,
`python` and `saved_model_cli` are this interpreter's. Not run: `make` targets (they create a venv; CI runs
`make test` itself, and the demo's command is checked against the Makefile below), `pip install`,
`source`, and fragments with `...` in them. (TensorFlow's own `saved_model_cli` is shown in a
plain block: tests/test_e2e_local.py loads the exported SavedModel and checks its signatures.)
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from elasticdl.master.report import JobReport

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "docs" / "getting_started.md", REPO / "README.md"]
_BLOCK = re.compile(r"^\s*```(\w*)\s*$")
_SKIP = ("make ", "pip ", "source ")


def shell_commands(page: Path) -> list[str]:
    """The commands of the page's ```bash blocks: continuation lines joined, comments dropped."""
    commands, language, lines = [], None, []
    for line in page.read_text(encoding="utf-8").splitlines():
        fence = _BLOCK.match(line)
        if fence and language is None:
            language, lines = fence.group(1), []
            continue
        if fence:
            if language in ("bash", "sh"):
                text = "\n".join(lines).replace("\\\n", " ")
                for command in text.splitlines():
                    command = re.sub(r"\s+#.*$", "", command).strip()
                    if command and not command.startswith("#"):
                        commands.append(" ".join(command.split()))
            language = None
            continue
        if language is not None:
            lines.append(line)
    return commands


def runnable(command: str) -> bool:
    return not command.startswith(_SKIP) and "..." not in command


def _local(argv: list[str], index: int) -> list[str]:
    """This interpreter's elasticdl/python/saved_model_cli; one epoch and one worker a job."""
    program = argv[0]
    if program in ("elasticdl", ".venv/bin/elasticdl"):
        argv = [sys.executable, "-m", "elasticdl", *argv[1:]]
    elif program in ("python", "python3"):
        argv = [sys.executable, *argv[1:]]
    elif program == "saved_model_cli":
        argv = [os.path.join(os.path.dirname(sys.executable), "saved_model_cli"), *argv[1:]]
    for flag, value in (("--num_epochs", "1"), ("--num_workers", "1")):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
    if "-m" in argv and "--job_name" not in argv:
        argv += ["--job_name", f"doc-command-{index}"]
    return argv


def _phase(command: str) -> int:
    """0: the data; 1: training jobs; 2: what reads their checkpoints and models."""
    if "prepare_data.py" in command:
        return 0
    return 1 if " train " in f" {command} " else 2


def _documented_commands() -> list[str]:
    """Every runnable command once, in order; the data preparation first (the README's train
    command needs its data and comes before it in reading order)."""
    seen: list[str] = []
    for page in PAGES:
        for command in shell_commands(page):
            if runnable(command) and command.replace(".venv/bin/", "") not in [c.replace(".venv/bin/", "") for c in seen]:
                seen.append(command)
    return seen


def test_the_quick_start_commands_are_found():
    """The extraction itself: the commands a newcomer types are all there."""
    commands = _documented_commands()
    starts = [c.split()[:2] for c in commands]
    assert ["python", "model_zoo/digits/prepare_data.py"] in starts
    assert [".venv/bin/elasticdl", "train"] in starts or ["elasticdl", "train"] in starts
    assert ["elasticdl", "evaluate"] in starts and ["elasticdl", "predict"] in starts
    assert any(c.startswith("make demo") for c in shell_commands(REPO / "README.md"))


def test_the_documented_demo_command_is_the_makefiles():
    makefile = (REPO / "Makefile").read_text(encoding="utf-8").replace("\\\n", " ")
    recipe = re.search(r"\$\(VENV\)/bin/elasticdl (train [^\n]*)", makefile).group(1)
    documented = [c for c in shell_commands(PAGES[0]) if c.startswith(".venv/bin/elasticdl train")]
    assert documented == [".venv/bin/elasticdl " + " ".join(recipe.split())]


@pytest.mark.warm_spares
def test_every_documented_command_runs(tmp_path):
    (tmp_path / "model_zoo").symlink_to(REPO / "model_zoo")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    commands = list(enumerate(_documented_commands()))

    def run(item):
        index, command = item
        argv = _local(shlex.split(command), index)
        return command, subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    for phase in (0, 1, 2):
        batch = [item for item in commands if _phase(item[1]) == phase]
        with ThreadPoolExecutor(max_workers=max(1, len(batch))) as pool:
            for command, result in pool.map(run, batch):
                assert result.returncode == 0, f"`{command}` failed (exit {result.returncode}):\n{result.stderr[-3000:]}"
                if "elasticdl" in command.split()[0]:
                    assert '"status": "succeeded"' in result.stdout, command
                    assert "absl::InitializeLog" not in result.stderr  # no TensorFlow banner


def _documented_report_keys() -> set[str]:
    """The keys named in the first column of getting_started's report table."""
    text = PAGES[0].read_text(encoding="utf-8")
    table = text[text.index("| Key | Meaning |"):]
    table = table[: table.index("\n\n")]
    keys = set()
    for row in table.splitlines()[2:]:
        keys.update(re.findall(r"`(\w+)`", row.split("|")[1]))
    return keys


def test_every_report_key_is_documented():
    fields = {f.name for f in dataclasses.fields(JobReport)}
    documented = _documented_report_keys()
    assert fields - documented == set(), "report keys missing from docs/getting_started.md's table"
    assert documented - fields == set(), "docs/getting_started.md documents keys the report does not have"
