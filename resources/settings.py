"""The code location's resources from one settings file: `PRODRL_SETTINGS=path.yaml` selects lab
or production source, the experiment, the deploy-gate thresholds and the store root, with no code
edited. Unset: the embedded lab defaults.

    lab:                      # any LabResource field
      source: production
      experiment: prod-2026-12
      gate_margin: 0.01
    store:                    # any StoreResource field
      root: /srv/prodrl
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import yaml
from dagster import ConfigurableResource
from pydantic import ValidationError

from resources.lab import LabResource
from resources.store import StoreResource

SETTINGS_VARIABLE = "PRODRL_SETTINGS"
RESOURCES: dict[str, type[ConfigurableResource]] = {"lab": LabResource, "store": StoreResource}


def resources_from_environment(env: Mapping[str, str] = os.environ) -> dict[str, ConfigurableResource]:
    """The `lab` and `store` resources, with the fields the settings file names (ValueError, naming
    the file and the setting, for a missing file, an unknown section or field, or a bad value)."""
    path = env.get(SETTINGS_VARIABLE)
    settings: dict = {}
    if path:
        try:
            settings = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"{SETTINGS_VARIABLE}={path}: cannot read it: {e}") from e
        if not isinstance(settings, dict) or set(settings) - set(RESOURCES):
            raise ValueError(
                f"{SETTINGS_VARIABLE}={path}: the file maps sections {sorted(RESOURCES)} to fields"
            )
    out = {}
    for name, cls in RESOURCES.items():
        fields = settings.get(name) or {}
        unknown = set(fields) - set(cls.model_fields)
        if unknown:
            raise ValueError(f"{SETTINGS_VARIABLE}={path}: unknown {name} setting(s) {sorted(unknown)}")
        try:
            out[name] = cls(**fields)
        except ValidationError as e:
            raise ValueError(f"{SETTINGS_VARIABLE}={path}: {name}: {e}") from e
    return out
