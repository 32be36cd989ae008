"""The code location: gathers assets, jobs and resources (loaded by workspace.yaml)."""

from __future__ import annotations

import warnings

from dagster import BetaWarning, Definitions

from assets.advantages import advantages
from assets.base_model import base_model
from assets.canary import canary_job, canary_sensor
from assets.checkpoint import checkpoint
from assets.checks import CHECKS
from assets.dead_runs import dead_run_sensor
from assets.deployment import deployment
from assets.eval_report import eval_report
from assets.jobs import base_job, round_job
from assets.operations import (
    cleanup_job,
    eval_live_job,
    eval_live_schedule,
    maintenance_job,
    maintenance_schedule,
)
from assets.sensors import round_sensor
from assets.study_report import study_report
from assets.trajectories import trajectories
from resources.settings import RESOURCES, settings_from_environment

ROUND_ASSETS = [trajectories, advantages, checkpoint, deployment, eval_report]
"""One round, in order: what `round_job` materializes for a partition."""
ASSETS = [base_model, *ROUND_ASSETS, *CHECKS]
"""Everything `materialize` needs to run a round with its asset checks."""

# Dagster 1.13 binds resources to an op job by rebuilding the sensors that target it, passing their
# empty `owners` to an initializer that warns on any value: canary_sensor (which targets the op job
# canary_job) would log a beta warning at every load for a parameter nobody set.
warnings.filterwarnings(
    "ignore", message="Parameter `owners` of initializer `SensorDefinition", category=BetaWarning
)

settings = settings_from_environment()  # PRODRL_SETTINGS (resources/settings.py), else the lab
interval = settings["sensor"].minimum_interval_seconds
defs = Definitions(
    assets=[base_model, *ROUND_ASSETS, study_report],
    asset_checks=CHECKS,
    jobs=[base_job, round_job, canary_job, maintenance_job, eval_live_job, cleanup_job],
    sensors=[round_sensor(interval), canary_sensor(interval), dead_run_sensor(interval)],
    schedules=[maintenance_schedule, eval_live_schedule],
    resources={name: settings[name] for name in RESOURCES},
)
