"""A worker's start: the optional packages kept out of TensorFlow's import, the startup clock."""

from __future__ import annotations

import importlib
import sys
import time

import pytest

from elasticdl.model.tf_runtime import without_optional_extras
from elasticdl.worker.startup import StartupClock, process_age


def test_optional_extras_are_unimportable_only_inside_the_block(tmp_path, monkeypatch):
    (tmp_path / "heavy_extra").mkdir()
    (tmp_path / "heavy_extra" / "__init__.py").write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with without_optional_extras(("heavy_extra",)):
        with pytest.raises(ImportError, match="not imported while TensorFlow starts"):
            importlib.import_module("heavy_extra.sub")
        importlib.import_module("json")  # anything else imports as usual
    assert importlib.import_module("heavy_extra").LOADED  # afterwards: a model zoo may import it
    assert sys.meta_path[0].__class__.__name__ != "_Unavailable"
    monkeypatch.delitem(sys.modules, "heavy_extra")


def test_a_package_imported_before_is_left_alone():
    with without_optional_extras(("json",)):
        importlib.reload(importlib.import_module("json"))  # already in sys.modules: not blocked


def test_startup_clock_adds_up_the_phases():
    clock = StartupClock(started=time.monotonic() - 0.5)
    clock.mark("python")
    clock.mark("tensorflow")
    clock.mark("tensorflow")
    line = clock.finish()
    clock.mark("late")  # after the first gradient nothing is counted
    assert list(clock.phases) == ["python", "tensorflow"] and clock.phases["python"] >= 0.5
    assert line.startswith(f"{sum(clock.phases.values()):.2f}s since the process started (python ")
    assert 0.0 < process_age() < 3600
