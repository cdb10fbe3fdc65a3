"""data: the whole dataset's length profile."""

from __future__ import annotations
