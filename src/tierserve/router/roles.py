"""Worker roles the router routes to."""

from __future__ import annotations

from enum import Enum


class Role(Enum):
    PREFILL = "prefill"
    DECODE = "decode"
