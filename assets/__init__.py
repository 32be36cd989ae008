"""The Dagster layer: assets, checks, jobs, sensors and schedules over the library.

Dagster marks two APIs this layer relies on as beta or preview; their warnings say nothing a user
can act on, so they are silenced here, by exact message, before any asset is defined:
`backfill_policy` (a ranged replay runs as one run, in round order) and a partitioned asset check
(a check's result names the round it judged).
"""

import warnings

from dagster import BetaWarning, PreviewWarning

for message, category in (
    ("Parameter `backfill_policy` of function `asset`", BetaWarning),
    ("Specifying a partitions_def on an AssetCheckSpec", PreviewWarning),
):
    warnings.filterwarnings("ignore", message=message, category=category)
