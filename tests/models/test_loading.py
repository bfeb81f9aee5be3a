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



def test_every_familys_config_reads_back_equal_from_its_json() -> None:
    from radixgen.models import ModelConfig
    from tests.models.families import family_configs

    for case, hf_config in family_configs().items():
        cfg = ModelConfig.from_hf(hf_config)
        assert ModelConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg, case


# a GGUF's second start: the config and tokenizer from the cache folder, no family module imported
_SECOND_START = """
import json, sys
from radixgen.models import load_model
loaded = load_model()
print(json.dumps({"family_modules": sorted(m for m in sys.modules if m.startswith("transformers.models.")),
                  "config": loaded.config.to_json(),
                  "ids": loaded.tokenizer.encode(sys.argv[1]), "eos": loaded.tokenizer.eos_token_id,
                  "chat": loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                              add_generation_prompt=True)}))
"""


def test_a_ggufs_second_start_reads_config_and_tokenizer_without_transformers_family_modules(
        default_model_dir: Path, tokenizer: Any) -> None:
    """A first start derives the config through transformers' classes and caches it in the GGUF's
    index; a second start reads it and the tokenizer.json as they are. Both must equal what
    transformers' own classes give."""
    if os.environ.get("RADIXGEN_TEST_MODEL_DIR"):
        pytest.skip("the bundled GGUF is not installed here")
    from transformers import AutoConfig

    from radixgen.models import ModelConfig

    load_model()  # the first start writes the index, if no test did before
    text = "Hello, wörld!  <|im_start|>user\n{\"id\": 12.5e-3, \"name\": \"Ann\"}\n\n\t don't"
    result = subprocess.run([sys.executable, "-c", _SECOND_START, text], capture_output=True, text=True, cwd=ROOT,
                            timeout=120, check=True)
    second = json.loads(result.stdout.strip().splitlines()[-1])
    assert second["family_modules"] == []
    derived = ModelConfig.from_hf(AutoConfig.from_pretrained(default_model_dir))
    assert ModelConfig.from_json(second["config"]).rope == derived.rope
    assert second["config"]["num_layers"] == derived.num_layers and second["config"]["family"] == derived.family.name
    assert second["ids"] == tokenizer.encode(text)
    assert second["eos"] == tokenizer.eos_token_id
    assert second["chat"] == tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                           add_generation_prompt=True)


def test_a_config_cached_by_other_code_is_derived_again(default_model_dir: Path) -> None:
    from radixgen.models import _cached_config
    from radixgen.models.loader import gguf_index

    if os.environ.get("RADIXGEN_TEST_MODEL_DIR"):
        pytest.skip("the bundled GGUF is not installed here")
    load_model()
    index = gguf_index(default_model_dir)
    assert index is not None and _cached_config(index) is not None
    stale = {**index, "model_config": {**index["model_config"], "code": "an older release"}}
    assert _cached_config(stale) is None


def test_a_converted_tokenizer_records_its_added_tokens_and_reloads_without_parsing_its_json(
        default_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' save leaves a tokenizer's added tokens out of tokenizer_config.json, and a
    load that misses them there parses the whole tokenizer.json in Python. The first load of a
    converted folder (one converted before this was written, too) records them; the next reads
    them from the config, and the tokenizer is the same."""
    import shutil

    import transformers.tokenization_utils_base as base

    from radixgen.models.loader import _DONE_MARKER, load_tokenizer

    if os.environ.get("RADIXGEN_TEST_MODEL_DIR"):
        pytest.skip("the bundled GGUF is not installed here")
    load_model()  # converted, if no test did before
    for name in ("tokenizer.json", "tokenizer_config.json", _DONE_MARKER):
        shutil.copy(default_model_dir / name, tmp_path / name)
    config_path = tmp_path / "tokenizer_config.json"
    older = json.loads(config_path.read_text())
    older.pop("added_tokens_decoder", None)
    config_path.write_text(json.dumps(older))
    parsed: list[str] = []
    real_load = base.json.load

    def load(handle: Any, *args: Any, **kwargs: Any) -> Any:
        parsed.append(Path(handle.name).name)
        return real_load(handle, *args, **kwargs)

    monkeypatch.setattr(base.json, "load", load)
    first = load_tokenizer(tmp_path)
    assert "tokenizer.json" in parsed, "a config without the added tokens is read the slow way"
    recorded = json.loads(config_path.read_text())["added_tokens_decoder"]
    assert {int(i): t["content"] for i, t in recorded.items()} == \
        {i: t.content for i, t in first.added_tokens_decoder.items()}
    parsed.clear()
    second = load_tokenizer(tmp_path)
    assert "tokenizer.json" not in parsed
    assert second.added_tokens_decoder == first.added_tokens_decoder
    assert second.all_special_ids == first.all_special_ids and second.eos_token_id == first.eos_token_id
    text = "<|im_start|>user\nHello {\"a\": 1}<|im_end|>"
    assert second.encode(text) == first.encode(text)
