"""One-line refusals of bad argument values, for the classes that own the values (the
strategy, the LightningModule, the data module, train.py's run options): the argument's
name, what would be valid, and the value given. A refusal of one argument is an
``ArgumentValueError`` carrying that argument's name, so train.py says it of the option
(``model.lr must be a number > 0, got -1.0``) from ``.argument``, not from the text."""

from __future__ import annotations

import math
import re
from typing import Any, Optional


class ArgumentValueError(ValueError):
    """One argument's value refused by the class that takes it. ``argument``: its name there
    (dotted where nested: ``parallel.cp_attention``); the message is ``"{argument}
    {complaint}"``, the same raised from Python as said by train.py of ``section.argument``."""

    def __init__(self, argument: str, complaint: str) -> None:
        super().__init__(f"{argument} {complaint}")
        self.argument, self.complaint = argument, complaint

    def __reduce__(self):  # pickled whole (a rank's error sent to the others), not from str()
        return type(self), (self.argument, self.complaint)

    def within(self, parent: str) -> ArgumentValueError:
        """The same refusal said of the argument nested in ``parent`` (``parallel.cp_attention``)."""
        return type(self)(f"{parent}.{self.argument}", self.complaint)


class ArgumentPathError(ArgumentValueError, FileNotFoundError):
    """An argument naming a path that does not exist (still a ``FileNotFoundError``)."""


def check_number(
    name: str,
    value: Any,
    *,
    low: float,
    high: Optional[float] = None,
    low_open: bool = False,
    integer: bool = False,
    optional: bool = False,
    hint: str = "",
) -> None:
    """Refuse ``value`` unless it is a finite number (an int if ``integer``) >= ``low``
    (> ``low`` if ``low_open``) and <= ``high``; None passes where ``optional``."""
    if value is None and optional:
        return
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and (not integer or isinstance(value, int))
        and math.isfinite(value)
        and (value > low if low_open else value >= low)
        and (high is None or value <= high)
    )
    if not ok:
        if high is None:
            bound = f"{'>' if low_open else '>='} {low}"
        else:
            bound = f"in {'(' if low_open else '['}{low}, {high}]"
        raise ArgumentValueError(
            name, f"must be {'an integer' if integer else 'a number'} {bound}{hint}, got {value!r}"
        )


def check_choice(name: str, value: Any, choices: tuple) -> None:
    """Refuse ``value`` unless it is one of ``choices`` (the values of the argument's ``Literal``)."""
    if value not in choices:
        raise ArgumentValueError(name, f"must be one of {', '.join(map(str, choices))}, got {value!r}")


def parse_size(text: str) -> int:
    """'8192', '8K', '64k', '1M' -> tokens (K = 1024): command-line token counts."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", str(text))
    if not m:
        raise ValueError(f"not a token count: {text!r} (use e.g. 8192 or 8K)")
    return int(m.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()]


def parse_sizes(text: str) -> list[int]:
    """'8K,512,1M' -> [8192, 512, 1048576]."""
    return [parse_size(t) for t in str(text).split(",") if t.strip()]
