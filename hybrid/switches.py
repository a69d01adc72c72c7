"""The HYBRID_* environment switches, read one way: a value stripped and lower-cased, unset or empty meaning the
switch's default, anything outside its choices a one-line HybridError naming the variable and what it takes.
What each switch does is documented where it is read."""
from __future__ import annotations

import os
from collections.abc import Iterable

from hybrid.errors import HybridError

OFF = ("0", "off", "false", "no")


def env_choice(name: str, choices: Iterable[str], default: str, expected: str | None = None) -> str:
    """$name (stripped, lower-cased; unset or empty: default), one of choices; HybridError
    "NAME='value': expected <expected, or the choices>" otherwise."""
    choices = tuple(choices)
    v = os.environ.get(name, "").strip().lower() or default
    if v not in choices:
        raise HybridError(f"{name}={v!r}: expected {expected or 'one of ' + ', '.join(choices)}")
    return v


def env_flag(name: str, default: bool = True) -> bool:
    """An on/off switch: $name unset or empty -> default, one of OFF (0, off, false, no) -> False, any other value
    -> True."""
    v = os.environ.get(name, "").strip().lower()
    return default if not v else v not in OFF
