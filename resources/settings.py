"""The code location's resources from one settings file: `PRODRL_SETTINGS=path.yaml` selects lab
or production source, the experiment, the deploy-gate thresholds and the store root, with no code
edited. Unset: the embedded lab defaults.

    lab:                      # any LabResource field
      source: production
      experiment: prod-2026-12
      gate_margin: 0.01
    store:                    # any StoreResource field
      root: /srv/prodrl
    sensor:                   # the round sensor and the dead-run sensor
      minimum_interval_seconds: 30
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import yaml
from dagster import ConfigurableResource
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from resources.lab import LabResource
from resources.store import StoreResource

SETTINGS_VARIABLE = "PRODRL_SETTINGS"


class SensorSettings(BaseModel):
    """How often the daemon evaluates `round_sensor` and `dead_run_sensor`."""

    model_config = ConfigDict(extra="forbid")
    minimum_interval_seconds: int = Field(30, ge=1)


RESOURCES: dict[str, type[ConfigurableResource]] = {"lab": LabResource, "store": StoreResource}
SECTIONS: dict[str, type[BaseModel]] = {**RESOURCES, "sensor": SensorSettings}


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice (YAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
        if repeated := sorted({str(k) for k in keys if keys.count(k) > 1}):
            raise yaml.constructor.ConstructorError(None, None, f"{repeated} given twice", node.start_mark)
        return super().construct_mapping(node, deep=deep)


def _unknown(model: type[BaseModel], fields: Mapping, where: str) -> list[str]:
    """Keys of `fields` (and of its nested sections) that `model` does not have."""
    out = []
    for key, value in fields.items():
        field = model.model_fields.get(key)
        if field is None:
            out.append(f"{where}.{key}")
        elif (
            isinstance(value, Mapping)
            and isinstance(field.annotation, type)
            and issubclass(field.annotation, BaseModel)
        ):
            out += _unknown(field.annotation, value, f"{where}.{key}")
    return out


def resources_from_environment(env: Mapping[str, str] = os.environ) -> dict[str, ConfigurableResource]:
    """The `lab` and `store` resources the settings file describes."""
    settings = settings_from_environment(env)
    return {name: settings[name] for name in RESOURCES}


def settings_from_environment(env: Mapping[str, str] = os.environ) -> dict[str, BaseModel]:
    """Every section (`lab`, `store`, `sensor`), with the fields the settings file names
    (ValueError, naming the file and the setting, for a missing, empty or unparsable file, a key
    given twice, an unknown section or field at any depth, or a value that cannot be honoured)."""
    path = env.get(SETTINGS_VARIABLE) or None  # set but empty: unset
    if path is None:
        return {name: cls() for name, cls in SECTIONS.items()}
    where = f"{SETTINGS_VARIABLE}={path!r}"
    try:
        settings = yaml.load(Path(path).read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 - a safe loader
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{where}: cannot read it: {e}") from e
    if not isinstance(settings, dict) or not settings or set(settings) - set(SECTIONS):
        raise ValueError(f"{where}: the file maps one or more of the sections {sorted(SECTIONS)} to fields")
    out = {}
    for name, cls in SECTIONS.items():
        fields = settings.get(name) or {}
        if not isinstance(fields, Mapping):
            raise ValueError(f"{where}: section {name!r} must map field names to values")
        if unknown := _unknown(cls, fields, name):
            raise ValueError(f"{where}: unknown setting(s) {unknown}")
        try:
            out[name] = cls(**fields)
        except ValidationError as e:
            raise ValueError(f"{where}: {name}: {e}") from e
    try:
        out["lab"].check()
    except ValueError as e:
        raise ValueError(f"{where}: lab: {e}") from e
    return out
