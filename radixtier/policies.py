"""Write and prefetch policies, named as SGLang's HiCache names them."""

from __future__ import annotations

import enum
from typing import Type, TypeVar

E = TypeVar("E", bound=enum.Enum)


class WritePolicy(str, enum.Enum):
    WRITE_THROUGH = "write_through"  # copy every new page down to host and storage right away
    WRITE_BACK = "write_back"  # copy down only when a tier fills and the page must leave it
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # copy down once a page is hit N times


class PrefetchPolicy(str, enum.Enum):
    BEST_EFFORT = "best_effort"  # use what reached host by schedule time, never wait
    WAIT_COMPLETE = "wait_complete"  # wait for the whole storage/remote prefetch
    TIMEOUT = "timeout"  # wait up to prefetch_timeout_s, then use the leading run that arrived


def parse_enum(cls: Type[E], field: str, value: object) -> E:
    """Accept an enum member or its string value; name the field and the choices otherwise."""
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(m.value for m in cls)  # type: ignore[attr-defined]
        raise ValueError(f"{field}: expected one of {choices}, got {value!r}") from None
