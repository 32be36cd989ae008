"""`python -m resources.serve [gateway options]`: the capture gateway on the settings file's store
root, tokenizer and recording head (`make serve`), so that one file, `PRODRL_SETTINGS`, sets up both
the code location and the gateway. Options given on the command line come after those read from
the settings and win over them."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from prodrl_pipeline.gateway.__main__ import main as gateway_main
from resources.settings import settings_from_environment


def gateway_args(env: Mapping[str, str] = os.environ) -> list[str]:
    """The gateway options the settings imply: store root, tokenizer, K and M recorded."""
    settings = settings_from_environment(env)
    lab, store = settings["lab"], settings["store"]
    return [
        "--root",
        store.root,
        "--tokenizer",
        lab.tokenizer_path(),
        "--top-logprobs",
        str(lab.top_logprobs),
        "--extra-samples",
        str(lab.extra_samples),
    ]


def main() -> None:
    try:
        implied = gateway_args()
    except ValueError as e:
        raise SystemExit(str(e)) from e
    sys.argv = [sys.argv[0], *implied, *sys.argv[1:]]
    gateway_main()


if __name__ == "__main__":
    main()
