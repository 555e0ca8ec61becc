"""``--class_weight``: Keras's ``fit(class_weight=...)`` as a flag, ``{"0": 1.0, "1": 5.0}`` (JSON)
or ``0:1.0,1:5.0``, held as ``{class id: weight}``; the same checks for a model-zoo module's
``class_weight()`` (elasticdl/model/class_weight.py turns it into sample weights)."""

from __future__ import annotations

import json
import math
import numbers
from typing import Any

from elasticdl.config.errors import ConfigError

EXAMPLE = '0:1.0,1:5.0 or {"0": 1.0, "1": 5.0}'


def check_class_weight(value: Any, source: str) -> dict[int, float]:
    """``{class id: weight}`` as Keras takes it: ids whole numbers from 0, weights finite and not
    negative. ConfigError naming ``source`` (the flag, or the module's function) otherwise."""
    if not isinstance(value, dict):
        raise ConfigError(f"{source} must be a dict {{class id: weight}}, e.g. {EXAMPLE}. Received: {value!r}")
    weights: dict[int, float] = {}
    for key, weight in value.items():
        cls = _class_id(key)
        if cls is None:
            raise ConfigError(
                f"{source}: class ids are whole numbers from 0 (the labels' class indices), e.g. {EXAMPLE}. "
                f"Received the key {key!r}"
            )
        ok = isinstance(weight, numbers.Real) and not isinstance(weight, bool)
        if not ok or not math.isfinite(weight) or weight < 0:
            raise ConfigError(
                f"{source}: the weight of class {cls} must be a finite number, 0 or more. Received: {weight!r}"
            )
        if cls in weights:
            raise ConfigError(f"{source}: class {cls} is given twice")
        weights[cls] = float(weight)
    return weights


def parse_class_weight(text: str, flag: str = "--class_weight") -> dict[int, float]:
    """``--class_weight``'s text: JSON, or ``id:weight`` pairs separated by commas ('' for none)."""
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{flag} is not valid JSON ({err.msg} at character {err.pos}): {text!r}. "
                              f"Write it as {EXAMPLE}") from None
        return check_class_weight(value, flag)
    pairs: dict[Any, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, weight = item.partition(":")
        try:
            number = float(weight)
        except ValueError:
            number = None
        if not sep or number is None:
            raise ConfigError(f"{flag} must look like {EXAMPLE}. Cannot parse {item!r} in {text!r}.")
        if key.strip() in {str(k) for k in pairs}:
            raise ConfigError(f"{flag}: class {key.strip()} is given twice")
        pairs[key.strip()] = number
    return check_class_weight(pairs, flag)


def render_class_weight(weights: dict[int, float]) -> str:
    """The text ``parse_class_weight`` reads back as ``weights``."""
    return ",".join(f"{cls}:{weight!r}" for cls, weight in check_class_weight(weights, "--class_weight").items())


def _class_id(key: Any) -> int | None:
    if isinstance(key, bool):
        return None
    if isinstance(key, numbers.Integral):
        return int(key) if key >= 0 else None
    if isinstance(key, str) and key.strip().isdigit():
        return int(key.strip())
    return None
