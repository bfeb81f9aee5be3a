"""Native CPU kernels, compiled on first use with the system C++ compiler and cached.

Eight sources (compiled as one unit, kernels.cpp), one extension registering ops under
``torch.ops.radixgen``: decode and prefill attention over the KV pool (decode_attention.cpp,
prefill_attention.cpp), a matrix-vector linear for one or two tokens
(small_linear.cpp), the fused element-wise steps of a layer (fused_ops.cpp), and weight-only
4/5/6/8-bit linears (quant_linear.cpp), their records decoded into float tiles for
large steps (quant_tiles.cpp), and the repacking of GGUF blocks for them (gguf_repack.cpp).

The build goes through ``torch.utils.cpp_extension`` into ``$RADIXGEN_CACHE/kernels``, keyed by
torch version, machine and source hash (torch rebuilds when the source changes), so a machine
pays the compile (under half a minute) once. Every kernel has a pure-PyTorch path beside it: where no compiler
is found or the build fails, the caller is told ``None`` and the engine keeps working, slower.
"""

from __future__ import annotations

import logging
import os
import platform
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixgen.kernels import ops  # noqa: F401  # defines the fused ops before the extension registers their CPU kernels

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(name) for name in (
    "kernels.cpp", "decode_attention.cpp", "prefill_attention.cpp", "prefill_attention_float.cpp", "small_linear.cpp", "fused_ops.cpp", "quant_linear.cpp", "quant_tiles.cpp", "gguf_repack.cpp", "common.h", "quant_records.h")]
_UNIT = "kernels.cpp"  # includes the other sources
_LIBRARY = "radixgen_kernels.so"  # what torch's builder links in the build folder
# the ops only the extension defines (the attention kernels); the fused layer ops' schemas are
# defined in ops.py, and the extension adds their CPU kernels
_OPS = ("decode_attention", "prefill_attention", "prefill_attention_native", "shared_prefix_attention", "gguf_repack",
        "gguf_repack_into", "dequantize_records")
_FUSED_OPS = ("rms_norm", "add_rms_norm", "rope_store_kv", "silu_mul", "small_linear", "quant_linear", "argmax_rows",
              "apply_bitmask")
# Release flags that keep IEEE semantics apart from reassociation (so the dot products
# vectorise); -ffast-math would link crtfastmath and flush denormals process-wide. -fopenmp:
# at::parallel_for is an OpenMP pragma in a header and runs serially without it; torch ships
# libgomp.so.1 under the same soname, so the loader reuses torch's runtime (one thread team).
_CFLAGS = [
    "-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
]
_LDFLAGS = ["-fopenmp"]
# The instruction set the kernels are built for: this CPU's by default. Naming an older one (e.g.
# x86-64-v3: AVX2 and FMA, no AVX-512) builds and runs the paths such a CPU takes, on this one.
_MARCH_ENV = "RADIXGEN_KERNELS_MARCH"


def _march() -> str:
    return os.environ.get(_MARCH_ENV) or "native"


def _cflags() -> list[str]:
    return [*_CFLAGS, f"-march={_march()}"]

_lock = threading.Lock()
_state: dict[str, object] = {}


def source_digest() -> str:
    """A hash of the kernel sources: names a build, and the tuning measured with it."""
    import hashlib

    digest = hashlib.sha256()
    for path in _SOURCES:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def build_signature() -> str:
    """The sources and the instruction set of the kernels this process loads: what their timings
    depend on."""
    return f"{source_digest()}-{_march()}"


def _build_dir() -> Path:
    """One folder per torch version, machine, kernel sources and compiler flags: torch's builder
    hashes the .cpp files it is given but not the header they share, and a start that finds the
    library in its folder loads it without asking the builder (``_load``)."""
    import hashlib

    from radixgen.paths import cache_dir

    flags = hashlib.sha256(" ".join([*_cflags(), "|", *_LDFLAGS]).encode()).hexdigest()[:6]
    tag = f"torch{torch.__version__.replace('+', '_')}-{platform.machine()}-{source_digest()}-{flags}"
    path = cache_dir() / "kernels" / tag
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass(frozen=True)
class CpuKernels:
    """The native attention ops of the ``cpu`` attention backend (each an overload of
    ``torch.ops.radixgen``). The fused layer ops need no handle: with the extension loaded,
    ``torch.ops.radixgen`` runs their CPU kernels on CPU tensors (``ops.py``)."""

    decode_attention: Any
    prefill_attention: Any
    prefill_attention_native: Any
    shared_prefix_attention: Any
    gguf_repack: Any
    """A GGUF tensor's quantized blocks as ``quant_linear``'s records (gguf_repack.cpp)."""
    gguf_repack_into: Any
    """The same records written into a given uint8 tensor of their shape (a slice of the weights' arena)."""
    dequantize_records: Any
    """Records decoded into a float tile of the transposed weight (quant_tiles.cpp)."""

    def prefill_attention_for(self, dtype: torch.dtype) -> Any:
        """The prefill kernel where the fixed rule takes it (bfloat16 on a CPU with AVX-512 BF16;
        elsewhere its plain loops are not known to beat PyTorch's flash kernel), else None. Its
        float32 path (AVX2) is taken where tuning measures it faster (models/tuning.py)."""
        return self.prefill_attention if dtype == torch.bfloat16 and self.prefill_attention_native() else None

    def shared_prefix_attention_for(self, dtype: torch.dtype, head_dim: int) -> Any:
        """The shared-prefix decode attention where it runs (as ``prefill_attention_for``, for
        heads of 64 or 128: the decode kernel's bf16 dot-product path extends it), else None."""
        runs = dtype == torch.bfloat16 and head_dim in (64, 128) and self.prefill_attention_native()
        return self.shared_prefix_attention if runs else None


def cpu_kernels() -> CpuKernels | None:
    """The native ops (built on first call), or None when they cannot be built here or
    ``RADIXGEN_DISABLE_KERNELS=1``. Thread-safe; the outcome is remembered."""
    with _lock:
        if "ops" not in _state:
            _state["ops"] = _load()
        namespace = _state["ops"]
    if namespace is None:
        return None
    return CpuKernels(**{name: getattr(namespace, name).default for name in _OPS})


def decode_attention_op() -> Any:
    """``torch.ops.radixgen.decode_attention``, or None where the native ops are unavailable."""
    kernels = cpu_kernels()
    return kernels.decode_attention if kernels is not None else None


def _registered() -> Any:
    namespace = getattr(torch.ops, "radixgen", None)
    if namespace is None or not all(hasattr(namespace, name) for name in _OPS):
        return None
    has_cpu_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    return namespace if all(has_cpu_kernel(f"radixgen::{name}", "CPU") for name in _FUSED_OPS) else None


def _load() -> Any:
    if os.environ.get("RADIXGEN_DISABLE_KERNELS") == "1":
        logger.info("native kernels disabled by RADIXGEN_DISABLE_KERNELS=1")
        return None
    if (namespace := _registered()) is not None:
        return namespace  # loaded earlier in this process
    build_dir = _build_dir()
    built = build_dir / _LIBRARY
    if built.exists():  # the folder names these sources and flags: the library is theirs
        try:
            torch.ops.load_library(str(built))
            if (namespace := _registered()) is not None:
                return namespace
        except OSError as exc:  # a library cut short by an interrupted build: built again below
            logger.info("rebuilding the CPU kernels: %s", exc)
    try:
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()

        logger.info("loading the CPU kernels (built on the first start on this machine only)")
        load(
            name="radixgen_kernels", sources=[str(p) for p in _sources_in(build_dir)], extra_cflags=_cflags(),
            extra_ldflags=_LDFLAGS, build_directory=str(build_dir), is_python_module=False, verbose=False,
        )
        return _registered()
    except Exception as exc:  # no compiler, no ninja, a failed build: fall back, loudly
        logger.warning("CPU kernels unavailable (%s); the model runs on PyTorch ops alone", exc)
        return None


def _sources_in(build_dir: Path) -> list[Path]:
    """The sources, copied into the build folder: ninja's build file names them by absolute
    path, so compiling them where they lie rebuilt the same sources (~60 s) whenever another
    checkout of them (a worktree, a second clone) was loaded last."""
    src = build_dir / "src"
    src.mkdir(exist_ok=True)
    copies = []
    for path in _SOURCES:
        copy = src / path.name
        data = path.read_bytes()
        if not copy.exists() or copy.read_bytes() != data:  # rewriting an equal copy would look newer to ninja
            copy.write_bytes(data)
        copies.append(copy)
    return [c for c in copies if c.name == _UNIT]


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
