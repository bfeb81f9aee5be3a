"""Write the folder a GPU machine without network runs the GPU check from (``make gpu-bundle``).

    python benchmarks/gpu_bundle.py [--out gpu-bundle]

It holds the package source (radixgen/, tests/, benchmarks/, pyproject.toml), the bundled
model's config and tokenizer files (model/), and under wheels/ manylinux cp312 wheels of what a
CUDA image with torch, transformers and triton lacks: the grammar backends (xgrammar with
apache-tvm-ffi, llguidance), pydantic (pydantic-core, annotated-types, typing-inspection,
typing_extensions), interegular, and jsonschema (referencing, rpds-py,
jsonschema-specifications). On the GPU machine:

    cd gpu-bundle
    python3 -m pip install -q --no-index --no-deps --target /tmp/site wheels/*.whl
    PYTHONPATH=/tmp/site:. python3 benchmarks/gpu_check.py
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WHEELS = ["xgrammar", "apache-tvm-ffi", "llguidance", "pydantic", "pydantic-core", "annotated-types",
          "typing-inspection", "typing_extensions", "interegular", "jsonschema", "referencing", "rpds-py",
          "jsonschema-specifications"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_24_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64"]
MODEL_FILES = ["config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "generation_config.json", "chat_template.jinja"]
LIMIT_BYTES = 64 * 2**20


def _installed_version(name: str) -> str | None:
    """The version installed here, so the GPU machine runs what the tests ran against."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def download_wheels(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    specs = []
    for name in WHEELS:
        installed = _installed_version(name)
        specs.append(f"{name}=={installed}" if installed else name)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "-d", str(dest)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    for spec in specs:  # one at a time: a pure-Python wheel and a binary one resolve differently
        subprocess.run([*command, spec], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "gpu-bundle"))
    args = parser.parse_args()
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "results")
    for folder in ("radixgen", "tests", "benchmarks"):
        shutil.copytree(ROOT / folder, out / folder, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", out / "pyproject.toml")
    from radixgen.models.loader import resolve_model_dir

    source = resolve_model_dir(None, float_weights=False)
    (out / "model").mkdir()
    for name in MODEL_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, out / "model" / name)
    download_wheels(out / "wheels")
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    wheels = sorted(f.name for f in (out / "wheels").iterdir())
    print(f"{out}: {total / 2**20:.1f} MiB, {len(wheels)} wheels: {', '.join(wheels)}")
    if total > LIMIT_BYTES:
        sys.exit(f"the bundle is {total / 2**20:.1f} MiB, over the 64 MiB a GPU run may carry")


if __name__ == "__main__":
    main()
