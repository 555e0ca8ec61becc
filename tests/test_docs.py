"""The docs stay true to the code: the generated CLI reference, flag coverage, links, the module map."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from elasticdl.cli.reference import REGENERATE_COMMAND, VALIDATION_RULES, render
from elasticdl.config import FLAGS, ConfigError, JobConfig

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
CLI_MD = DOCS / "cli.md"
DOC_FILES = sorted(DOCS.glob("*.md"))

# [text](target) and [text](target "title"); images too. Autolinks and bare URLs are not files.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~)")


def _strip_code(text: str) -> str:
    """The Markdown without fenced code blocks and inline code, where links are not links."""
    kept, in_fence = [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            in_fence = not in_fence
            continue
        if not in_fence:
            kept.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(kept)


def _config_flags() -> list[str]:
    flags = []
    for f in FLAGS.values():
        flags.append(f.option)
        flags.extend(f.aliases)
    return flags


def test_docs_exist():
    assert CLI_MD.is_file(), f"docs/cli.md is missing; run `{REGENERATE_COMMAND}`"
    assert (DOCS / "index.md").is_file()


def test_cli_reference_is_up_to_date():
    expected = render()
    actual = CLI_MD.read_text(encoding="utf-8") if CLI_MD.is_file() else ""
    assert actual == expected, (
        f"docs/cli.md differs from what the code renders; regenerate it with `{REGENERATE_COMMAND}` "
        "(from the repository root) and commit the result."
    )


def test_cli_reference_is_deterministic_and_runs_as_a_module():
    env = dict(os.environ, COLUMNS="37")  # a narrow terminal must not change the output
    result = subprocess.run(
        [sys.executable, "-m", "elasticdl.cli.reference"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=True,
    )
    assert result.stdout == render() == render()
    assert REGENERATE_COMMAND in result.stdout


@pytest.mark.parametrize("flag", _config_flags())
def test_every_config_flag_is_documented(flag):
    text = CLI_MD.read_text(encoding="utf-8")
    assert f"`{flag}`" in text, (
        f"{flag} (a field of a JobConfig section in elasticdl/config/sections.py) is not in docs/cli.md; "
        f"regenerate it with `{REGENERATE_COMMAND}`"
    )


def _anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    anchors = set()
    for line in _strip_code_blocks_only(doc.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            anchors.add(re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-"))
    return anchors


def _strip_code_blocks_only(text: str) -> str:
    kept, in_fence = [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            in_fence = not in_fence
        elif not in_fence:
            kept.append(line)
    return "\n".join(kept)


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: p.name)
def test_relative_links_point_to_existing_files(doc):
    broken = []
    for target in _LINK.findall(_strip_code(doc.read_text(encoding="utf-8"))):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
            continue  # http:, https:, mailto: ...
        path, _, anchor = target.split("?", 1)[0].partition("#")
        file = (doc.parent / path) if path else doc
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{doc.relative_to(REPO)} links to files or headings that do not exist: {broken}"


def _valid_config(**overrides) -> JobConfig:
    flags = {
        "model_zoo": str(REPO / "model_zoo"),
        "model_def": "digits.digits_functional.custom_model",
        "training_data": "data/digits/train",
    }
    return JobConfig.from_flags(**{**flags, **overrides})


def test_validation_rules_start_from_a_valid_config():
    _valid_config().validate("train")


@pytest.mark.parametrize(
    "text,overrides",
    [(text, o) for text, examples in VALIDATION_RULES for o in examples],
    ids=lambda v: ",".join(f"{k}={v[k]!r}" for k in v) if isinstance(v, dict) else "",
)
def test_every_documented_validation_rule_is_enforced(text, overrides):
    """docs/cli.md lists these rules; each example must really be refused, naming a flag of the rule."""
    with pytest.raises(ConfigError) as err:
        _valid_config(**overrides).validate("train")
    flags = re.findall(r"--[a-z_]+", text)
    assert any(flag in str(err.value) for flag in flags), (
        f"the error for {overrides} does not name any of {flags}: {err.value}"
    )


# Flags in the docs that belong to other programs (saved_model_cli, tensorboard, pip).
_OTHER_PROGRAMS_FLAGS = {"--all", "--dir", "--tag_set", "--signature_def", "--help", "--logdir"}


def _answered_flags() -> set[str]:
    """Names the command refuses with a hint, which the docs show: Keras's names
    (elasticdl/config/suggest.py) and a prefix of a flag (no prefix matching)."""
    from elasticdl.config.suggest import KERAS_ELSEWHERE, KERAS_NAMES

    return {f"--{name}" for name in (*KERAS_NAMES, *KERAS_ELSEWHERE)} | {"--num_work"}


def _simulator_flags() -> set[str]:
    """`python -m elasticdl.sim`'s flags (docs/reliability.md, "Simulation")."""
    from elasticdl.sim.runner import build_parser

    return {o for action in build_parser()._actions for o in action.option_strings if o.startswith("--")}


def _parser_flags() -> set[str]:
    """Every flag of every subcommand, including those that are not JobConfig fields (scale)."""
    import argparse

    from elasticdl.cli import build_parser

    flags = set()
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                for sub_action in sub._actions:
                    flags.update(o for o in sub_action.option_strings if o.startswith("--"))
    return flags


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: p.name)
def test_docs_mention_only_real_flags(doc):
    from elasticdl.cli.legacy_flags import LEGACY_FLAGS

    known = (set(_config_flags()) | _parser_flags() | _OTHER_PROGRAMS_FLAGS | LEGACY_FLAGS | _simulator_flags()
             | _answered_flags())
    mentioned = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9_]*", doc.read_text(encoding="utf-8")))
    unknown = sorted(mentioned - known)
    assert not unknown, (
        f"{doc.relative_to(REPO)} mentions flags that `elasticdl` does not have: {unknown} "
        "(renamed or removed in elasticdl/config/__init__.py?)"
    )


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: p.name)
def test_python_examples_parse(doc):
    text = doc.read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    for block in blocks:
        try:
            ast.parse(block)
        except SyntaxError as err:
            pytest.fail(f"{doc.relative_to(REPO)}: a python example does not parse: {err}\n{block}")


# ---------------------------------------------------------------- docs/architecture.md's module map

ARCHITECTURE_MD = DOCS / "architecture.md"
PACKAGE = REPO / "elasticdl"


def _defines_something(init: Path) -> bool:
    """An __init__.py with a function or class of its own (not only a docstring and re-exports)."""
    tree = ast.parse(init.read_text(encoding="utf-8"))
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for node in tree.body)


def _package_paths() -> list[Path]:
    """Every package (directory) and module under elasticdl/ that the module map must list.

    Skipped: __pycache__, the generated elasticdl/proto/*_pb2*.py, and __init__.py files that
    define nothing of their own (their package's row covers them).
    """
    paths = []
    for root, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        here = Path(root)
        paths.append(here)
        for name in sorted(files):
            path = here / name
            if not name.endswith(".py"):
                continue
            if here == PACKAGE / "proto" and "_pb2" in name:
                continue
            if name == "__init__.py" and not _defines_something(path):
                continue
            paths.append(path)
    return paths


def _module_map_links() -> list[str]:
    """The link targets of the '## Module map' section of docs/architecture.md, as written."""
    text = ARCHITECTURE_MD.read_text(encoding="utf-8")
    section = re.search(r"^## Module map[ \t]*$(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert section, "docs/architecture.md has no '## Module map' section"
    return _LINK.findall(_strip_code(section.group(1)))


def _resolve(target: str) -> Path:
    return (DOCS / target.split("#", 1)[0]).resolve()


def test_the_walk_finds_packages_and_modules():
    found = {p.relative_to(REPO).as_posix() for p in _package_paths()}
    assert {"elasticdl", "elasticdl/master", "elasticdl/master/controller.py", "elasticdl/cli/__init__.py",
            "elasticdl/model/embedding"} <= found
    assert "elasticdl/master/__init__.py" not in found  # a docstring only: the package row covers it
    assert not any("_pb2" in p or "__pycache__" in p for p in found)


def test_module_map_lists_every_package_and_module():
    linked = {_resolve(target) for target in _module_map_links()}
    missing = [p.relative_to(REPO).as_posix() + ("/" if p.is_dir() else "")
               for p in _package_paths() if p.resolve() not in linked]
    assert not missing, (
        f"docs/architecture.md's module map does not list {missing}: add a row for each, "
        "linking to it (e.g. [elasticdl/master/controller.py](../elasticdl/master/controller.py)), "
        "with one line on what it holds."
    )


def test_module_map_links_only_to_paths_that_exist():
    links = _module_map_links()
    assert len(links) > 50, "the module map looks empty"
    broken = [target for target in links if not _resolve(target).exists()]
    assert not broken, (
        f"docs/architecture.md's module map links to paths that do not exist: {broken} "
        "(renamed, moved or deleted? update or remove the row)"
    )


def test_architecture_quotes_the_import_contracts_of_pyproject():
    """docs/architecture.md quotes the dependency rules; they must be the ones lint-imports checks."""
    import tomllib

    blocks = re.findall(r"^```toml\n(.*?)^```", ARCHITECTURE_MD.read_text(encoding="utf-8"), flags=re.S | re.M)
    assert blocks, "docs/architecture.md quotes no contracts (a ```toml block)"
    quoted = [c for block in blocks for c in tomllib.loads(block)["tool"]["importlinter"]["contracts"]]
    with open(REPO / "pyproject.toml", "rb") as f:
        actual = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    assert quoted == actual, "the contracts quoted in docs/architecture.md differ from pyproject.toml's: quote them again"


# ---------------------------------------------------------------- the controller's tables


def _table_names(heading: str) -> set[str]:
    """The first column's names (``Name(...)``) of the table under ``heading`` in architecture.md."""
    text = ARCHITECTURE_MD.read_text()
    section = text.split(heading, 1)[1].split("\n#", 1)[0]
    first_cells = re.findall(r"^\| ([^|]*`\w+\([^|]*)\|", section, re.M)
    return {name for cell in first_cells for name in re.findall(r"`(\w+)\(", cell)}


def _union_names(union) -> set[str]:
    return {t.__name__ for t in typing.get_args(union)}


def test_the_event_table_lists_exactly_the_controllers_events():
    from elasticdl.master import events

    assert _table_names("### Events") == _union_names(events.Event)


def test_the_decision_table_lists_exactly_the_controllers_decisions():
    from elasticdl.master import events

    assert _table_names("### Decisions, and how the job carries them out") == _union_names(events.Decision)
