"""The text forms of the structured flags: how each is parsed into its typed value, and how
that value is written back as text (the JSON handed to the pods): ``"a=1;b=2.5"`` -> a dict,
``"cpu=1,memory=4096Mi"`` -> a dict, ``"high"`` -> a fraction, volumes, etcd endpoints.

Every parser raises ConfigError naming the flag; ``render(parse(text))`` parses back to the
same value.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable
from typing import Any

from elasticdl.config.errors import ConfigError
from elasticdl.config.kubernetes import OptionError, Volume
from elasticdl.config.priority import parse_priority_spec


def parse_kv_params(text: str, flag: str) -> dict[str, Any]:
    """Parse ``"a=1;b=2.5;c='x';d=True"`` into keyword arguments (Python literals, else strings)."""
    params: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ConfigError(
                f"{flag} must look like \"a=1;b=2.5;c='x'\". Cannot parse {item!r} in {text!r}."
            )
        raw = raw.strip()
        try:
            params[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError, TypeError):  # TypeError: e.g. {[]: 1}, an unhashable key
            params[key] = raw  # a bare word such as relu
    return params


def _literal(value: Any) -> str:
    """Python source that ``ast.literal_eval`` reads back as ``value``: repr, but infinities as 1e999."""
    if isinstance(value, float) and math.isinf(value):
        return "1e999" if value > 0 else "-1e999"
    if isinstance(value, list):
        return "[" + ", ".join(map(_literal, value)) + "]"
    if isinstance(value, tuple):
        return "(" + ", ".join(map(_literal, value)) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, set) and value:
        return "{" + ", ".join(map(_literal, value)) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items()) + "}"
    return repr(value)


def render_kv_params(params: dict[str, Any]) -> str:
    """The text ``parse_kv_params`` reads back as ``params``."""
    return ";".join(f"{key}={_literal(value)}" for key, value in params.items())


def kv_params(flag: str) -> Callable[[str], dict[str, Any]]:
    return lambda text: parse_kv_params(text, flag)


def option(parse: Callable[[str, str], Any], flag: str) -> Callable[[str], Any]:
    """A Kubernetes flag's parser, raising ConfigError with its message."""

    def parse_flag(text: str) -> Any:
        try:
            return parse(text, flag)
        except OptionError as err:
            raise ConfigError(str(err)) from None

    return parse_flag


def render_pairs(pairs: dict[str, str]) -> str:
    return ",".join(f"{name}={value}" for name, value in pairs.items())


def render_volumes(volumes: list[Volume]) -> str:
    specs = []
    for v in volumes:
        parts = [f"claim_name={v.claim_name}" if v.claim_name else f"host_path={v.host_path}",
                 f"mount_path={v.mount_path}"]
        parts += [f"sub_path={v.sub_path}"] if v.sub_path else []
        parts += ["read_only=true"] if v.read_only else []
        specs.append(",".join(parts))
    return ";".join(specs)


def parse_priority(text: str) -> float:
    try:
        return parse_priority_spec(text)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def render_priority(fraction: float) -> str:
    return {1.0: "high", 0.0: "low"}.get(fraction, repr(float(fraction)))


def parse_endpoints(text: str) -> list[str]:
    endpoints = [e.strip() for e in text.split(",") if e.strip()]
    if text.strip() and not endpoints:
        raise ConfigError(f"--etcd_endpoints names no endpoint (host:port[,host:port]). Received: {text!r}")
    return endpoints
