"""Dagster config generated from the library's dataclasses: one definition per setting."""

import dataclasses
import pickle

import pytest

from prodrl_pipeline.rl.estimators import EstimatorConfig
from resources.config import config_class
from resources.lab import EstimatorSettings


def test_generated_config_has_the_dataclass_fields_defaults_and_docs():
    settings = EstimatorSettings()
    assert settings.resolve() == EstimatorConfig()
    fields = EstimatorSettings.model_fields
    assert set(fields) == {f.name for f in dataclasses.fields(EstimatorConfig)}
    assert fields["type"].description  # the attribute docstring travels to the UI
    assert EstimatorSettings(type="tis_ppo").resolve().type == "tis_ppo"
    assert pickle.loads(pickle.dumps(settings)) == settings


def test_resolve_validates_and_unmappable_dataclasses_are_refused():
    with pytest.raises(ValueError):
        EstimatorSettings(type="tis_ppo", trust_region=True).resolve()

    @dataclasses.dataclass(frozen=True)
    class NoDefault:
        x: int

    with pytest.raises(TypeError, match="no plain default"):
        config_class(NoDefault, "NoDefaultSettings", __name__)
