"""import (a trainer's config as a spec), catalog import, launch."""

from __future__ import annotations
