"""`python -m resources.serve [gateway options]`: the capture gateway on the settings file's store
root, tokenizer and recording head (`make serve`), so that one file, `PRODRL_SETTINGS`, sets up both
the code location and the gateway. Options given on the command line come after those read from
the settings and win over them."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping

from prodrl_pipeline.artifacts import STORAGE_OPTIONS_ENV
from prodrl_pipeline.gateway.__main__ import main as gateway_main
from resources.settings import settings_from_environment


def gateway_env(env: Mapping[str, str] = os.environ) -> tuple[list[str], dict[str, str]]:
    """The gateway options the settings imply (store root and tables, tokenizer, K and M recorded)
    and the environment they add (the object-store options, unless already set there)."""
    settings = settings_from_environment(env)
    lab, store = settings["lab"], settings["store"]
    args = [
        "--root",
        store.root,
        *(["--tables-uri", store.tables_uri] if store.tables_uri else []),
        "--tokenizer",
        lab.tokenizer_path(),
        "--top-logprobs",
        str(lab.top_logprobs),
        "--extra-samples",
        str(lab.extra_samples),
    ]
    extra = {STORAGE_OPTIONS_ENV: json.dumps(store.storage_options)} if store.storage_options else {}
    return args, {k: v for k, v in extra.items() if k not in env}


def main() -> int:
    """The gateway's exit status (`prodrl_pipeline.gateway.__main__.main`); a bad settings file exits 1."""
    try:
        implied, extra_env = gateway_env()
    except ValueError as e:
        raise SystemExit(str(e)) from e
    os.environ.update(extra_env)
    sys.argv = [sys.argv[0], *implied, *sys.argv[1:]]
    return gateway_main()


if __name__ == "__main__":
    sys.exit(main())
