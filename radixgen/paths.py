"""Where radixgen keeps what it builds or converts once per machine (compiled kernels,
converted checkpoints): ``$RADIXGEN_CACHE``, by default ``~/.cache/radixgen``. A leaf module, so
that both ``kernels`` and ``models`` can use it without importing each other."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("RADIXGEN_CACHE", Path.home() / ".cache" / "radixgen"))
