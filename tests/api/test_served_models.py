"""A model of another family, named by its hub id and answered from the local cache with no
network, served and called through the OpenAI client: /v1/models reports the model's own name,
chat uses the model's template, and sampling defaults come from its generation config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai

from tests.api.conftest import LiveServer
from tests.models.families import save_family_model
from tests.models.test_loading import hub_cache_with

REPO = "tiny-org/tiny-qwen3"


def test_a_hub_model_serves_under_its_own_name(tmp_path: Path, tokenizer: Any) -> None:
    model_dir = save_family_model("qwen3", tmp_path / "model", tokenizer)
    # greedy by default: two identical requests without a temperature must agree
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 0.0}))
    cache = hub_cache_with(model_dir, tmp_path / "hub", REPO)
    server = LiveServer(["--model", REPO, "--kv-cache-tokens", "4096", "--max-context-len", "1024"],
                        env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)})
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [REPO]
        answers = [
            client.chat.completions.create(model=REPO, messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
            for _ in range(2)
        ]
        assert answers[0].model == REPO
        assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
        assert answers[0].usage.completion_tokens >= 1
    finally:
        server.stop()

