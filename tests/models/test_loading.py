"""Checkpoints as users have them: sharded folders with an index, hub ids answered from the local
Hugging Face cache with no network, and the model's own generation config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from radixgen.models import load_model
from radixgen.models.loader import is_hub_id
from tests.models.families import make_family_model, save_family_model
from tests.models.harness import PoolHarness

ROOT = Path(__file__).resolve().parents[2]


def hub_cache_with(model_dir: Path, cache: Path, repo_id: str) -> Path:
    """Lay ``model_dir`` out as huggingface_hub's cache does for ``repo_id`` (refs/main naming a
    snapshot folder), as a download would have left it."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in model_dir.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return cache


def test_sharded_checkpoint_reads_the_shards_its_index_names(tmp_path: Path, tokenizer: Any) -> None:
    hf = make_family_model("qwen3", seed=7)
    hf.save_pretrained(tmp_path, max_shard_size="2MB")
    tokenizer.save_pretrained(tmp_path)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) >= 2 and (tmp_path / "model.safetensors.index.json").exists()
    # a stray copy beside the shards (as some repositories carry) with other values is not read
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(49152, 64)}, str(tmp_path / "consolidated.safetensors"))
    ours = load_model(tmp_path).model
    ids = list(range(5, 45))
    (logits,) = PoolHarness(ours).extend([(0, ids)])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, ref, atol=2e-4, rtol=0)


def test_generation_config_adds_end_of_turn_ids_and_sampling_defaults(tmp_path: Path, tokenizer: Any) -> None:
    save_family_model("llama3.2", tmp_path, tokenizer)
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [2, 7], "temperature": 0.6, "top_p": 0.9, "do_sample": True}))
    loaded = load_model(tmp_path)
    assert loaded.config.eos_token_ids == (2, 7)
    assert loaded.sampling_defaults == {"temperature": 0.6, "top_p": 0.9}


def test_hub_ids_are_recognised_and_paths_are_not(tmp_path: Path) -> None:
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("meta-llama/Llama-3.2-1B-Instruct")
    for not_hub in ("./models/x", "/models/x", "~/x", "x", "a/b/c", "org/model.gguf"):
        assert not is_hub_id(not_hub), not_hub
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "local").mkdir()
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        assert not is_hub_id("org/local")  # a folder of that name wins
    finally:
        os.chdir(cwd)


def _resolve_offline(model: str, cache: Path) -> subprocess.CompletedProcess[str]:
    # huggingface_hub reads HF_HUB_OFFLINE and HF_HUB_CACHE when imported: a fresh interpreter
    code = "import sys; from radixgen.models.loader import resolve_model_dir; print(resolve_model_dir(sys.argv[1]))"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code, model], capture_output=True, text=True, env=env, timeout=120)


def test_a_cached_hub_id_loads_offline_and_a_missing_one_says_what_to_do(tmp_path: Path, tokenizer: Any) -> None:
    model_dir = save_family_model("gemma2", tmp_path / "model", tokenizer)
    cache = hub_cache_with(model_dir, tmp_path / "hub", "tiny-org/tiny-gemma2")
    found = _resolve_offline("tiny-org/tiny-gemma2", cache)
    assert found.returncode == 0, found.stderr
    snapshot = Path(found.stdout.strip())
    assert snapshot.parent.parent.name == "models--tiny-org--tiny-gemma2" and (snapshot / "config.json").exists()
    missing = _resolve_offline("tiny-org/not-downloaded", cache)
    assert missing.returncode != 0
    assert "not in the local Hugging Face cache" in missing.stderr and "HF_HUB_OFFLINE" in missing.stderr


@pytest.mark.parametrize("model", ["/nonexistent/folder", "weights.bin"])
def test_an_unknown_model_path_names_what_is_accepted(model: str) -> None:
    with pytest.raises(FileNotFoundError, match="neither an HF folder, a .gguf file nor a hub id"):
        load_model(model)

