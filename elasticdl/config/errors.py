"""ConfigError: the one error of the config package, in a module of its own so that every
module of the package can raise it without importing the package (no import cycle)."""

from __future__ import annotations

from elasticdl.errors import UserError


class ConfigError(UserError, ValueError):
    """A flag or flag combination that cannot work; the message names the flag and the fix."""


ConfigError.__module__ = "elasticdl.config"  # its public name, where users import it from
