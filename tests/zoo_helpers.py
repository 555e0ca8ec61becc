"""For tests that write throwaway model-zoo packages and import them."""

from __future__ import annotations

import sys

import pytest


def restore_import_state(prefix: str):
    """An autouse fixture: each test's zoo is a fresh package; afterwards drop it from sys.path
    and drop the modules named ``prefix*`` it imported (other modules, e.g. TensorFlow's, stay)."""

    @pytest.fixture(autouse=True)
    def _restore_import_state():
        path, modules = list(sys.path), set(sys.modules)
        yield
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            if name.startswith(prefix):
                del sys.modules[name]

    return _restore_import_state
