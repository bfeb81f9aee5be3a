"""Native CPU kernels, compiled on first use with the system C++ compiler and cached.

The build goes through ``torch.utils.cpp_extension`` into ``$RADIXGEN_CACHE/kernels``, keyed by
torch version, machine and source hash (torch rebuilds when the source changes), so a machine
pays the ~10 s compile once. Every kernel has a pure-PyTorch path beside it: where no compiler
is found or the build fails, the caller is told ``None`` and the engine keeps working, slower.
"""

from __future__ import annotations

import logging
import os
import platform
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("decode_attention.cpp")
# Release flags that keep IEEE semantics apart from reassociation (so the dot products
# vectorise); -ffast-math would link crtfastmath and flush denormals process-wide. -fopenmp:
# at::parallel_for is an OpenMP pragma in a header and runs serially without it; torch ships
# libgomp.so.1 under the same soname, so the loader reuses torch's runtime (one thread team).
_CFLAGS = [
    "-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
    "-fno-signed-zeros",
]
_LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_state: dict[str, object] = {}


def _build_dir() -> Path:
    from radixgen.models.loader import cache_dir

    tag = f"torch{torch.__version__.replace('+', '_')}-{platform.machine()}"
    path = cache_dir() / "kernels" / tag
    path.mkdir(parents=True, exist_ok=True)
    return path


def decode_attention_op():
    """``torch.ops.radixgen.decode_attention`` (built on first call), or None when it cannot be
    built here or ``RADIXGEN_DISABLE_KERNELS=1``. Thread-safe; the outcome is remembered."""
    with _lock:
        if "decode_attention" not in _state:
            _state["decode_attention"] = _load_decode_attention()
        return _state["decode_attention"]


def _load_decode_attention():
    if os.environ.get("RADIXGEN_DISABLE_KERNELS") == "1":
        logger.info("native kernels disabled by RADIXGEN_DISABLE_KERNELS=1")
        return None
    if hasattr(torch.ops, "radixgen") and hasattr(torch.ops.radixgen, "decode_attention"):
        return torch.ops.radixgen.decode_attention  # registered by an earlier load in this process
    try:
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()

        logger.info("building the CPU decode-attention kernel (first start on this machine only)")
        load(
            name="radixgen_decode_attention", sources=[str(_SOURCE)], extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS,
            build_directory=str(_build_dir()), is_python_module=False, verbose=False,
        )
        return torch.ops.radixgen.decode_attention
    except Exception as exc:  # no compiler, no ninja, a failed build: fall back, loudly
        logger.warning("CPU decode-attention kernel unavailable (%s); decode uses gather + SDPA", exc)
        return None


def _put_ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; the pip-installed one sits in the virtualenv's
    bin folder, which is not on PATH when the venv's python is run directly."""
    import shutil

    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
