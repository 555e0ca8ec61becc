"""How a section's field declares its flag, and the one rule per type that checks its value.

A field's ``metadata`` carries its command-line help, the commands that take it, its aliases
and, for a number, its range (``Bounds``). ``check_value`` is the whole type check: a bool flag
takes True or False only (``use_async="no"`` is refused, not truthy), an int flag a whole number
(not a bool, not 2.5), a float flag a finite number (nan and inf are refused: ``--task_timeout
nan`` would never time out), each within its bounds; a str flag takes text. It runs where flags
enter a JobConfig (``from_flags``, ``replace``, ``from_json``) and again in ``validate``, so a
flag added to a section is checked without a line of its own.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elasticdl.config.errors import ConfigError

COMMANDS = ("train", "evaluate", "predict")
# An int flag's default upper bound: the wire protocol's 32-bit fields (worker ids, counts,
# grads_to_wait in PSStats) carry several of them, and none needs more.
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Bounds:
    """The range of a number flag: at least ``low`` (None: no lower bound), above it when
    ``low_open``, at most ``high`` (None: ``INT32_MAX`` for an int, any finite float)."""

    low: float | None = 0
    low_open: bool = False
    high: float | None = None

    def high_for(self, kind: type) -> float | None:
        return INT32_MAX if self.high is None and kind is int else self.high

    def describe(self, kind: type) -> str:
        """'0 or more', 'at least 1', 'above 0', '... and at most N'."""
        parts = []
        if self.low is not None:
            low = _number(self.low, kind)
            parts.append(f"above {low}" if self.low_open else ("0 or more" if self.low == 0 else f"at least {low}"))
        high = self.high_for(kind)
        if high is not None:
            parts.append(f"at most {_number(high, kind)}")
        return " and ".join(parts)

    def holds(self, value: float, kind: type) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        high = self.high_for(kind)
        return high is None or value <= high


AT_LEAST_1 = Bounds(low=1)  # counts: workers, epochs, batch sizes ...


def _number(value: float, kind: type) -> str:
    return str(int(value)) if kind is int or float(value).is_integer() else repr(value)


def flag(
    default: Any,
    help: str,
    commands: tuple[str, ...] = COMMANDS,
    aliases: tuple[str, ...] = (),
    bounds: Bounds = Bounds(),
):
    """A field that is a flag as it is (str, int, float or bool). A number is 0 or more unless
    ``bounds`` says otherwise: a negative count, delay or timeout means nothing."""
    return field(default=default, metadata={"help": help, "commands": commands, "aliases": aliases,
                                            "bounds": bounds})


def structured(
    text: str,
    help: str,
    parse: Callable[[str], Any],
    render: Callable[[Any], str],
    commands: tuple[str, ...] = COMMANDS,
    aliases: tuple[str, ...] = (),
):
    """A field typed as text on the command line (default ``text``), held as ``parse(text)``.

    ``parse`` raises ConfigError naming the flag; ``render(parse(t))`` parses back to the same value.
    """
    return field(
        default_factory=lambda: parse(text),
        metadata={"help": help, "commands": commands, "aliases": aliases, "text": text,
                  "parse": parse, "render": render},
    )


_KIND_NAMES = {bool: "true or false (a bool)", int: "a whole number", float: "a finite number", str: "text"}


def check_value(name: str, kind: type, value: Any, bounds: Bounds = Bounds()) -> Any:
    """``value`` as flag ``name`` of type ``kind`` holds it (an int given for a float becomes a
    float), or ConfigError naming the flag, what it takes and what it received."""
    received = value
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        value = int(value) if ok else value
    elif kind is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, kind)
    if ok and kind in (int, float) and not bounds.holds(value, kind):
        ok = False
    if ok:
        return value
    what = _KIND_NAMES.get(kind, kind.__name__)
    if kind in (int, float) and bounds.describe(kind):
        what = f"{bounds.describe(kind)} ({what})"
    raise ConfigError(f"--{name} must be {what}. Received: {name}={received!r}")
