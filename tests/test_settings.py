"""Production mode is a setting: one settings file, named by PRODRL_SETTINGS, read by the code location."""

import json
import math
import os
import subprocess
import sys
from typing import get_args

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prodrl_pipeline.evals.gate import check_gate_settings
from resources.lab import LabResource
from resources.serve import gateway_env
from resources.settings import resources_from_environment, settings_from_environment

PRODUCTION = """
lab:
  source: production
  base_checkpoint: /srv/models/base
  experiment: prod-1
  gate_margin: 0.01
store:
  root: {root}
"""


def test_unset_is_the_embedded_lab():
    resources = resources_from_environment({})
    assert resources["lab"].source == "lab" and resources["store"].root == ".prodrl"
    assert resources_from_environment({"PRODRL_SETTINGS": ""})["lab"].source == "lab"  # empty is unset


def test_a_settings_file_selects_the_free_text_mode_and_its_defaults_unless_given(tmp_path):
    path = tmp_path / "free_text.yaml"
    path.write_text("lab:\n  mode: free_text\n  max_tokens: 96\n")
    lab = resources_from_environment({"PRODRL_SETTINGS": str(path)})["lab"]
    assert (lab.mode, lab.constrain_moves, lab.max_tokens) == ("free_text", False, 96)
    assert lab.tokenizer_path() == "data/tokenizer_free_text"
    warm = lab.warm_start()
    assert (warm.steps, warm.batch_size, warm.schedule) == (400, 32, "cosine")
    assert LabResource().warm_start().schedule == "constant"
    structured = LabResource()
    assert (structured.constrain_moves, structured.max_tokens, structured.tokenizer_path()) == (
        True,
        64,
        "data/tokenizer",
    )


def test_a_settings_file_selects_production_its_experiment_thresholds_and_store(tmp_path):
    path = tmp_path / "production.yaml"
    path.write_text(PRODUCTION.format(root=tmp_path / "store"))
    resources = resources_from_environment({"PRODRL_SETTINGS": str(path)})
    lab = resources["lab"]
    assert (lab.source, lab.experiment, lab.gate_margin) == ("production", "prod-1", 0.01)
    assert lab.tokenizer_path() == "/srv/models/base"  # the deployment's own, not the lab's
    assert resources["store"].root == str(tmp_path / "store")


@pytest.mark.parametrize(
    "text,named",
    [
        ("lab:\n  sorce: production\n", "sorce"),
        ("labs:\n  source: production\n", "sections"),
        ("lab:\n  source: moon\n", "source"),
        ("- a list\n", "sections"),
        ("lab: [unclosed\n", "cannot read"),
        ("lab:\n  estimator:\n    nme: tis_ppo\n", "lab.estimator.nme"),  # a typo one level down
        ("lab:\n  source: production\nlab:\n  steps: 4\n", "given twice"),  # YAML keeps the last
        ("", "sections"),  # an empty file is not the lab defaults
        ("lab: 5\n", "must map"),
        ("lab: production\n", "must map"),
        # settings that load but could not be honoured: refused now, not inside a round
        ("lab:\n  num_heads: 0\n", "model sizes must be >= 1, got num_heads=0"),
        ("lab:\n  hidden_size: 100\n  num_heads: 3\n", "hidden_size must divide by num_heads"),
        ("lab:\n  eval_puzzles: -3\n", "eval_puzzles must be >= 0"),
        ("lab:\n  top_logprobs: 0\n", "top_logprobs must be >= 1"),
        ("lab:\n  gate_confidence: 1.0\n", "need 0 < confidence < 1"),
        ("lab:\n  mismatch_warn: .nan\n", "mismatch_warn must be >= 0"),
        ("lab:\n  steps: 0\n", "lab: "),
        ("lab:\n  top_p: 0\n", "top_p must be in"),
        ("lab:\n  source: production\n", "set base_checkpoint"),  # production has no lab model
    ],
)
def test_a_bad_settings_file_is_refused_naming_what_is_wrong(tmp_path, text, named):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=named) as refused:
        resources_from_environment({"PRODRL_SETTINGS": str(path)})
    assert str(path) in str(refused.value)


def test_a_missing_settings_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        resources_from_environment({"PRODRL_SETTINGS": str(tmp_path / "missing.yaml")})


def test_the_code_location_reads_the_settings_file(tmp_path):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(PRODUCTION.format(root=tmp_path / "store"))
    bad.write_text("lab:\n  sorce: production\n")
    code = "from assets.definitions import defs; r = defs.resources; print(r['lab'].source, r['store'].root)"
    env = {**os.environ, "PRODRL_SETTINGS": str(good)}
    read = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert read.stdout.split() == ["production", str(tmp_path / "store")]
    failed = subprocess.run(
        [sys.executable, "-c", code], env={**env, "PRODRL_SETTINGS": str(bad)}, capture_output=True, text=True
    )
    assert failed.returncode != 0 and "sorce" in failed.stderr


def test_the_gateway_serves_the_settings_store_tokenizer_and_recorded_head(tmp_path):
    path = tmp_path / "production.yaml"
    path.write_text(
        "lab:\n  source: production\n  base_checkpoint: /srv/models/base\n  top_logprobs: 8\n"
        f"store:\n  root: {tmp_path / 'store'}\n"
        "sensor:\n  minimum_interval_seconds: 5\n"
    )
    args, env = gateway_env({"PRODRL_SETTINGS": str(path)})
    assert env == {}
    assert args == [
        "--root",
        str(tmp_path / "store"),
        "--tokenizer",
        "/srv/models/base",
        "--top-logprobs",
        "8",
        "--extra-samples",
        "0",
    ]
    assert settings_from_environment({"PRODRL_SETTINGS": str(path)})["sensor"].minimum_interval_seconds == 5
    path.write_text("store:\n  tables_uri: s3://b/t\n  storage_options: {AWS_REGION: eu-west-1}\n")
    args, env = gateway_env({"PRODRL_SETTINGS": str(path)})
    assert args[2:4] == ["--tables-uri", "s3://b/t"]
    assert json.loads(env["PRODRL_STORAGE_OPTIONS"]) == {"AWS_REGION": "eu-west-1"}
    assert gateway_env({"PRODRL_SETTINGS": str(path), "PRODRL_STORAGE_OPTIONS": "{}"})[1] == {}
    path.write_text("sensor:\n  minimum_interval_seconds: 0\n")
    with pytest.raises(ValueError, match="minimum_interval_seconds"):
        gateway_env({"PRODRL_SETTINGS": str(path)})


LAB_NUMBERS = [  # numeric settings, the mode-defaulted ones (`int | None`: None is the mode's) too
    name
    for name, field in LabResource.model_fields.items()
    if set(get_args(field.annotation) or [field.annotation]) - {type(None)} in ({int}, {float})
    and name not in ("seed", "model_seed")
]
SETTING = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.sampled_from([0, -1, 1, 2, 10**9, 0.5, 1.5, -0.0, math.nan, math.inf, -math.inf]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=2),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(LAB_NUMBERS), SETTING, min_size=1, max_size=3))
def test_a_setting_that_cannot_be_honoured_is_refused_when_read_not_mid_round(tmp_path, lab):
    """Whatever the values, the file is refused naming itself and the setting, or every
    configuration a round derives from it builds (the model's, warm start's, sampling's, the
    trainer's, the deploy gate's): nothing the settings admit fails later, inside a round."""
    path = tmp_path / "settings.yaml"
    path.write_text(yaml.safe_dump({"lab": lab}))
    try:
        resource = settings_from_environment({"PRODRL_SETTINGS": str(path)})["lab"]
    except ValueError as e:
        assert str(path) in str(e) and any(name in str(e) for name in lab), str(e)  # names file and setting
        return
    resource.tiny_model(), resource.warm_start(), resource.sampling(), resource.trainer()
    check_gate_settings(resource.gate_margin, resource.gate_confidence)


def test_settings_given_as_run_config_are_checked_before_the_first_step(tmp_path):
    """The launchpad or the CLI can override the settings file with run config: the run fails at its
    start with the reason, before any step writes anything."""
    from dagster import instance_for_test, materialize

    from assets.base_model import base_model
    from resources.store import StoreResource

    with instance_for_test() as instance:
        result = materialize(
            [base_model],
            instance=instance,
            resources={"store": StoreResource(root=str(tmp_path)), "lab": LabResource()},
            run_config={"resources": {"lab": {"config": {"eval_puzzles": -3}}}},
            raise_on_error=False,
        )
    assert not result.success
    said = [
        str(e.event_specific_data)
        for e in result.all_events
        if e.is_failure or "FAILURE" in e.event_type_value
    ]
    assert any("eval_puzzles must be >= 0, got -3" in s for s in said), said
    assert not (tmp_path / "tables").exists()


def test_rounds_evaluate_a_fixed_subset_and_every_kth_round_the_whole_held_out_set():
    from resources.lab import LabResource

    lab = LabResource(eval_puzzles=4, eval_full_every=3)
    every = lab.puzzles("heldout")
    sizes = [len(lab.heldout(k)) for k in range(7)]
    assert sizes == [len(every), 4, 4, len(every), 4, 4, len(every)]
    assert [p.puzzle_id for p in lab.heldout(1)] == [
        p.puzzle_id for p in every[:4]
    ]  # the same four each time
    assert len(LabResource(eval_puzzles=4).heldout(3)) == 4 and len(LabResource().heldout(1)) == len(every)


def test_the_free_text_mode_defaults_its_own_settings_and_an_explicit_one_wins():
    from resources.lab import LabResource  # noqa: PLC0415

    free, structured = LabResource(mode="free_text"), LabResource()
    assert (free.lr, free.quant_format, free.constrain_moves) == (1e-4, "nvfp4_w4a4", False)
    assert (structured.lr, structured.quant_format, structured.constrain_moves) == (5e-4, "nvfp4", True)
    chosen = LabResource(mode="free_text", lr=5e-4, quant_format="nvfp4")
    assert (chosen.lr, chosen.quant_format) == (5e-4, "nvfp4")


def test_a_dagster_run_gets_each_mode_default_and_keeps_an_explicit_structured_value():
    """Dagster rebuilds the resource in its run from a config holding every field: the mode's
    defaults (the Literal ones too) arrive there, and an explicit value equal to the structured
    mode's is not replaced by the free-text one."""
    from dagster import asset, materialize  # noqa: PLC0415

    from resources.lab import MODE_DEFAULTS  # noqa: PLC0415

    seen = []

    @asset
    def settings_in_run(lab: LabResource) -> None:
        seen.append({k: getattr(lab, k) for k in MODE_DEFAULTS["free_text"]})

    assert {"lr", "max_tokens", "warm_start_steps"} <= set(LAB_NUMBERS)  # the fuzz above covers them
    explicit = {"lr": 5e-4, "quant_format": "nvfp4", "warm_start_schedule": "constant"}
    for lab in (LabResource(mode="free_text"), LabResource(), LabResource(mode="free_text", **explicit)):
        assert materialize([settings_in_run], resources={"lab": lab}).success
    switched = {"resources": {"lab": {"config": {"mode": "free_text"}}}}  # the launchpad's run config
    assert materialize([settings_in_run], resources={"lab": LabResource()}, run_config=switched).success
    free, structured = MODE_DEFAULTS["free_text"], MODE_DEFAULTS["structured"]
    assert seen == [free, structured, {**free, **explicit}, free]
