"""One-line refusals of bad argument values, for the classes that own the values (the
strategy, the LightningModule, train.py's run options): the argument's name, what would
be valid, and the value given. train.py prints these as they are, prefixed with the
option's section (``model.lr must be a number > 0, got -1.0``)."""
from __future__ import annotations

import math
from typing import Any, Optional


def check_number(name: str, value: Any, *, low: float, high: Optional[float] = None, low_open: bool = False,
                 integer: bool = False, optional: bool = False, hint: str = "") -> None:
    """Refuse ``value`` unless it is a finite number (an int if ``integer``) >= ``low``
    (> ``low`` if ``low_open``) and <= ``high``; None passes where ``optional``."""
    if value is None and optional:
        return
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and (not integer or isinstance(value, int))
          and math.isfinite(value) and (value > low if low_open else value >= low)
          and (high is None or value <= high))
    if not ok:
        if high is None:
            bound = f"{'>' if low_open else '>='} {low}"
        else:
            bound = f"in {'(' if low_open else '['}{low}, {high}]"
        raise ValueError(f"{name} must be {'an integer' if integer else 'a number'} {bound}{hint}, got {value!r}")


def check_choice(name: str, value: Any, choices: tuple) -> None:
    """Refuse ``value`` unless it is one of ``choices`` (the values of the argument's ``Literal``)."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")


def qualified(prefix: str, names: Any, message: str) -> str:
    """``message`` said of the option ``prefix.NAME`` where it starts with one of ``names``
    (``parallel.cp_attention must be ...``), else of ``prefix`` as a whole."""
    return f"{prefix}.{message}" if message.split(" ", 1)[0] in names else f"{prefix}: {message}"
