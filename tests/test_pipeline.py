"""The real round graph on a real Dagster instance and real Delta tables, at tiny settings."""

import json
import math
from pathlib import Path

import torch
from dagster import AssetKey, Definitions, instance_for_test, materialize
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from assets.advantages import advantages
from assets.base_model import base_model
from assets.checkpoint import checkpoint
from assets.checks import CHECKS
from assets.definitions import defs
from assets.deployment import deployment
from assets.eval_report import eval_report
from assets.partitions import round_key
from assets.torchrun import trainer_pod_spec
from assets.trajectories import trajectories
from prodrl_pipeline.chat.render import load_tokenizer, render_ids
from prodrl_pipeline.model import SIZES, TinyQwen3Config, build_model
from prodrl_pipeline.quant.nvfp4 import load_deployment
from prodrl_pipeline.records.registry import BASE, live_deployment, lookup, register_checkpoint
from prodrl_pipeline.rl.checkpoint import META_FILE
from prodrl_pipeline.rl.recorded import RecordedCalls
from prodrl_pipeline.rl.trainer import policy_logprobs
from resources.lab import LabResource
from resources.store import StoreResource

ASSETS = [base_model, trajectories, advantages, checkpoint, deployment, eval_report, *CHECKS]
ROUND = [trajectories, advantages, checkpoint, deployment, eval_report]


TINY = dict(
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    steps=2,
    batch_size=8,
    eval_puzzles=16,
    warm_start_steps=3,
    warm_start_batch=8,
    warm_start_copy_steps=2,
)
"""Lab settings small enough for a round in seconds."""


def user_checkpoint(
    folder: Path, tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel | None = None
) -> Path:
    """An HF checkpoint as a deployment's owner hands one over: `model` (default: a tiny random Qwen3
    of `tokenizer`'s vocabulary) and `tokenizer`."""
    tokenizer.save_pretrained(folder)
    if model is None:
        sizes = TinyQwen3Config(**{k: v for k, v in TINY.items() if k in SIZES})
        model = build_model(sizes, len(tokenizer), tokenizer.pad_token_id)
    model.save_pretrained(folder)
    return folder


def _resources(root, **lab_overrides):
    """Store and lab at `root`. Production starts from an HF checkpoint: unless `base_checkpoint`
    is given, a tiny random model with the lab's tokenizer (`user_checkpoint`, in `root`)."""
    if lab_overrides.get("source") == "production" and "base_checkpoint" not in lab_overrides:
        folder = user_checkpoint(Path(root) / "user-model", load_tokenizer("data/tokenizer"))
        lab_overrides["base_checkpoint"] = str(folder)
    return {"store": StoreResource(root=str(root)), "lab": LabResource(**{**TINY, **lab_overrides})}


def run_rounds(instance, resources, rounds) -> None:
    """Build the base model, then materialize each round's five assets (and their checks)."""
    assert materialize([base_model], instance=instance, resources=resources).success
    for k in rounds:
        instance.add_dynamic_partitions("rounds", [round_key(k)])
        assert materialize(
            ASSETS, selection=ROUND, partition_key=round_key(k), instance=instance, resources=resources
        ).success


def _round_one(instance, resources):
    """Round 1's five assets, its failures returned rather than raised."""
    instance.add_dynamic_partitions("rounds", [round_key(1)])
    return materialize(
        ASSETS,
        selection=ROUND,
        partition_key=round_key(1),
        instance=instance,
        resources=resources,
        raise_on_error=False,
    )


def _evaluation_after(instance, resources, asset):
    """Re-materialize `asset` for round 1 and return its (single) asset check evaluation."""
    result = materialize(
        ASSETS,
        selection=[asset],
        partition_key=round_key(1),
        instance=instance,
        resources=resources,
        raise_on_error=False,
    )
    (check,) = [
        e.event_specific_data for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"
    ]
    return check


def test_definitions_load():
    Definitions.validate_loadable(defs)
    assert {j.name for j in defs.resolve_all_job_defs()} >= {"base_job", "round_job"}


def test_two_rounds_end_to_end(tmp_path):
    resources = _resources(tmp_path)
    tables = resources["store"].tables()
    with instance_for_test() as instance:
        assert materialize([base_model], instance=instance, resources=resources).success
        assert live_deployment(tables)["deployment_id"] == "base"
        for k in (1, 2):
            instance.add_dynamic_partitions("rounds", [round_key(k)])
            result = materialize(
                ASSETS, selection=ROUND, partition_key=round_key(k), instance=instance, resources=resources
            )
            assert result.success

        # lineage is data: round 2 was served by round 1's deployment, and the chain leads to base
        assert set(tables.read("trajectories", 2).column("deployment_id").to_pylist()) == {"main-r000001"}
        assert lookup(tables, "checkpoints", "checkpoint_id", "main-r000002")["parent_id"] == "main-r000001"
        assert lookup(tables, "checkpoints", "checkpoint_id", "main-r000001")["parent_id"] == "base"
        assert live_deployment(tables)["deployment_id"] == "main-r000002"
        # optimizer steps continue across rounds: one long run
        assert sorted(tables.read("train_steps").column("step").to_pylist()) == [1, 2, 3, 4]
        assert sorted(set(tables.read("eval_results").column("round").to_pylist())) == [0, 1, 2]
        meta = instance.get_latest_materialization_event(
            AssetKey("eval_report")
        ).asset_materialization.metadata
        assert "reward_curve" in meta and "heldout_solve_rate" in meta
        base_meta = instance.get_latest_materialization_event(
            AssetKey("base_model")
        ).asset_materialization.metadata
        assert "warm_start_plot" in base_meta and "heldout_solve_rate_mateIn2" in base_meta

        counts = {t: tables.read(t).num_rows for t in ("calls", "trajectories", "advantages")}
        ids = sorted(tables.read("trajectories", 1).column("trajectory_id").to_pylist())
        assert materialize(
            ASSETS,
            selection=[trajectories, advantages],
            partition_key=round_key(1),
            instance=instance,
            resources=resources,
        ).success
        assert {t: tables.read(t).num_rows for t in counts} == counts  # re-materializing never duplicates
        assert sorted(tables.read("trajectories", 1).column("trajectory_id").to_pylist()) == ids  # immutable
        recollect = {"ops": {"trajectories": {"config": {"recollect": True}}}}
        assert materialize(
            ASSETS,
            selection=[trajectories],
            partition_key=round_key(1),
            instance=instance,
            resources=resources,
            run_config=recollect,
        ).success
        assert {t: tables.read(t).num_rows for t in counts} == counts


ESTIMATOR_RUNS = {
    "reinforce": {"type": "reinforce"},
    "token-is": {"type": "token_is", "trust_region": True},
    "tis-ppo": {"type": "tis_ppo", "kl_beta": 0.05},
    "ref-is": {"type": "ref_is"},
    "centering": {"type": "score_centering", "truncated_is": True},
    "centering-samples": {"type": "score_centering", "centering": "samples"},
    "centering-qat": {"type": "score_centering"},
}


def test_each_estimator_runs_a_round_and_logs_its_diagnostics(tmp_path):
    import json

    resources = _resources(tmp_path, extra_samples=2)
    tables = resources["store"].tables()
    with instance_for_test() as instance:
        assert materialize([base_model], instance=instance, resources=resources).success
        instance.add_dynamic_partitions("rounds", [round_key(1)])
        assert materialize(
            ASSETS,
            selection=[trajectories, advantages],
            partition_key=round_key(1),
            instance=instance,
            resources=resources,
        ).success
        for experiment, estimator in ESTIMATOR_RUNS.items():
            qat = experiment.endswith("-qat")
            lab = _resources(tmp_path, extra_samples=2, experiment=experiment, qat=qat)["lab"]
            run_config = {"ops": {"checkpoint": {"config": {"estimator": estimator}}}}
            result = materialize(
                ASSETS,
                selection=[checkpoint, deployment, eval_report],
                partition_key=round_key(1),
                instance=instance,
                resources={**resources, "lab": lab},
                run_config=run_config,
            )
            assert result.success, experiment
            meta = json.loads(
                (tmp_path / "checkpoints" / experiment / round_key(1) / "prodrl.json").read_text()
            )
            assert meta["trainer"]["estimator"]["type"] == estimator["type"]
            assert meta["trainer"]["qat"] == qat
    steps = [r for r in tables.read("train_steps", 1).to_pylist()]
    mismatch = {r["experiment"]: r["engine_mismatch"] for r in steps if r["step"] == 1}
    assert mismatch["centering-qat"] < 1e-4 < mismatch["centering"]  # QAT: pi_k is what NVFP4 serves
    assert {r["experiment"] for r in steps} == set(ESTIMATOR_RUNS)
    for r in steps:
        for key in (
            "engine_mismatch",
            "staleness",
            "total_mismatch",
            "clip_fraction",
            "rho_truncated_fraction",
            "kl",
            "entropy",
            "grad_norm",
            "dropped_trajectories",
        ):
            assert r[key] is not None and r[key] == r[key], (r["experiment"], key)  # present, not NaN
    assert tables.read("policy_logprobs", 1).num_rows > 0


def test_an_invalid_estimator_fails_the_run_with_the_reason(tmp_path):
    resources = _resources(tmp_path)
    with instance_for_test() as instance:
        assert materialize([base_model], instance=instance, resources=resources).success
        instance.add_dynamic_partitions("rounds", [round_key(1)])
        run_config = {
            "ops": {"checkpoint": {"config": {"estimator": {"type": "tis_ppo", "trust_region": True}}}}
        }
        result = materialize(
            ASSETS,
            selection=ROUND[:3],
            partition_key=round_key(1),
            instance=instance,
            resources=resources,
            run_config=run_config,
            raise_on_error=False,
        )
        assert not result.success
        failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
        assert "trust_region applies to type='token_is'" in str(failure.event_specific_data.error)


def test_the_base_is_reused_and_not_rebuilt_under_checkpoints_trained_from_it(tmp_path):
    resources = _resources(tmp_path)
    with instance_for_test() as instance:
        assert materialize([base_model], instance=instance, resources=resources).success
        again = materialize([base_model], instance=instance, resources=resources)
        meta = again.asset_materializations_for_node("base_model")[0].metadata
        assert meta["cached"].value is True
        register_checkpoint(
            resources["store"].tables(),
            checkpoint_id="main-r000001",
            round_=1,
            experiment="main",
            parent_id=BASE,
            path=str(tmp_path / "r1"),
            step=2,
        )
        changed = _resources(tmp_path, warm_start_steps=4)
        result = materialize([base_model], instance=instance, resources=changed, raise_on_error=False)
        assert not result.success
        failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
        assert "settings changed (warm_start)" in str(failure.event_specific_data.error)
        assert "main-r000001" in str(failure.event_specific_data.error)


def test_a_free_text_lab_runs_a_round_on_its_own_tokenizer_and_template(tmp_path):
    """mode free_text flows through every asset of a round: the base is built for its tokenizer,
    collection and the held-out evaluation play free text, and each call's conversation ends with
    the answer it was served for."""
    resources = _resources(tmp_path, mode="free_text", max_tokens=16)
    with instance_for_test() as instance:
        run_rounds(instance, resources, [1])
    tables = resources["store"].tables()
    free = load_tokenizer("data/tokenizer_free_text")
    calls = tables.read("calls", 1).to_pylist()
    assert calls and all(c["vocab_size"] == len(free) for c in calls)
    for call in calls:
        messages = json.loads(call["messages_json"])
        assert messages[-1]["role"] == "assistant" and call["prompt_token_ids"] == render_ids(
            free, messages[:-1]
        )
    evaluated = tables.read("eval_results").to_pylist()
    assert {r["round"] for r in evaluated} == {0, 1} and len(evaluated) == 2 * TINY["eval_puzzles"]


def test_a_w4a4_lab_records_what_its_nvfp4_activations_serve(tmp_path):
    """quant_format nvfp4_w4a4 flows into the registry row, and the engine that collects reads it:
    the recorded log mu of the sampled tokens is the W4A4 forward's, not the W4A16 one's."""
    resources = _resources(tmp_path, quant_format="nvfp4_w4a4")
    lab, store = resources["lab"], resources["store"]
    with instance_for_test() as instance:
        assert materialize([base_model], instance=instance, resources=resources).success
        instance.add_dynamic_partitions("rounds", [round_key(1)])
        assert materialize(
            ASSETS,
            selection=[trajectories],
            partition_key=round_key(1),
            instance=instance,
            resources=resources,
        ).success
    tables = store.tables()
    base = lookup(tables, "deployments", "deployment_id", BASE)
    assert base["quant_format"] == "nvfp4_w4a4"
    calls = RecordedCalls.from_arrow(tables.read("calls", 1))
    sampled = torch.from_numpy(calls.support.size > 1)
    mu = torch.from_numpy(calls.completion_logprobs)[sampled]
    distance = {}
    for served in ("nvfp4", "nvfp4_w4a4"):
        model = load_deployment(store.artifacts().local(base["path"]), served)
        lp = policy_logprobs(model, calls, lab.trainer(), lab.pad_id(), fake_quant=False)
        distance[served] = float((torch.cat([lp[c] for c in calls.call_id])[sampled] - mu).abs().mean())
    assert distance["nvfp4_w4a4"] < distance["nvfp4"] / 10, distance


def test_a_failed_deploy_gate_keeps_the_live_pointer(tmp_path):
    resources = _resources(tmp_path)
    tables = resources["store"].tables()
    with instance_for_test() as instance:
        assert materialize([base_model], instance=instance, resources=resources).success
        # crafted: the live deployment's stored evaluation solves every held-out puzzle
        rows = [{**r, "solved": True, "reward": 1.0} for r in tables.read("eval_results", 0).to_pylist()]
        tables.overwrite("eval_results", rows, "round = 0 AND deployment_id = 'base'")
        result = _round_one(instance, resources)
        assert not result.success
        checks = [
            e.event_specific_data for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"
        ]
        (gate,) = [c for c in checks if c.check_name == "deploy_gate"]
        assert gate.check_name == "deploy_gate" and not gate.passed and "FAILS" in gate.description
        assert live_deployment(tables)["deployment_id"] == "base"  # live stays
        assert "main-r000001" in tables.read("deployments").column("deployment_id").to_pylist()  # registered
        materialized = {
            e.asset_key.path[-1] for e in result.all_events if e.event_type_value == "ASSET_MATERIALIZATION"
        }
        assert "eval_report" not in materialized  # blocked downstream


def test_asset_checks_pass_on_a_real_round_and_fail_on_crafted_bad_input(tmp_path):
    from prodrl_pipeline.records import checks

    resources = _resources(tmp_path)
    tables = resources["store"].tables()
    with instance_for_test() as instance:
        assert materialize([base_model], instance=instance, resources=resources).success
        instance.add_dynamic_partitions("rounds", [round_key(1)])
        result = materialize(
            ASSETS, selection=ROUND, partition_key=round_key(1), instance=instance, resources=resources
        )
        evaluations = [
            e.event_specific_data for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"
        ]
        assert {e.check_name for e in evaluations} >= {
            "token_integrity",
            "advantage_sanity",
            "mismatch_monitor",
        }
        assert all(e.passed for e in evaluations), [e.check_name for e in evaluations if not e.passed]
        assert {e.check_name: e.partition for e in evaluations} == {  # each check names the round it judged
            name: round_key(1)
            for name in ("token_integrity", "advantage_sanity", "mismatch_monitor", "deploy_gate")
        }

        # token integrity: a positive log-prob stored for round 1 fails it, through Dagster (the
        # trajectories asset keeps stored rows, and its check re-reads them)
        calls = tables.read("calls", 1).to_pylist()
        calls[0]["completion_logprobs"] = [0.5] + calls[0]["completion_logprobs"][1:]
        tables.overwrite_round("calls", calls, 1)
        check = _evaluation_after(instance, resources, trajectories)
        assert check.check_name == "token_integrity" and not check.passed

        # advantage sanity: a non-finite reward stored for round 1 makes the SQL's advantages NaN
        trajs = tables.read("trajectories", 1).to_pylist()
        tables.overwrite_round("trajectories", [{**trajs[0], "reward": float("nan")}, *trajs[1:]], 1)
        check = _evaluation_after(instance, resources, advantages)
        assert check.check_name == "advantage_sanity" and not check.passed
        tables.overwrite_round("trajectories", trajs, 1)
        assert materialize(
            ASSETS, selection=[advantages], partition_key=round_key(1), instance=instance, resources=resources
        ).success

    trajs = tables.read("trajectories", 1).to_pylist()
    adv = tables.read("advantages", 1).to_pylist()
    known = {t["trajectory_id"] for t in trajs}
    assert checks.advantage_sanity(adv, known)[0]
    assert not checks.advantage_sanity([{**adv[0], "advantage": float("nan")}, *adv[1:]], known)[0]
    assert not checks.advantage_sanity([{**adv[0], "advantage": adv[0]["advantage"] + 0.5}, *adv[1:]], known)[
        0
    ]
    assert not checks.advantage_sanity(adv + adv[:1], known)[0]

    steps = tables.read("train_steps", 1).to_pylist()
    rising = [
        {**r, "round": k, "engine_mismatch": m}
        for k, m in ((1, 0.05), (2, 0.1), (3, 0.2), (4, 0.4))
        for r in steps
    ]
    passed, sustained, _ = checks.mismatch_monitor(rising, 4, mismatch_warn=0.15, staleness_warn=10)
    assert not passed and sustained
    passed, sustained, _ = checks.mismatch_monitor(rising, 2, mismatch_warn=0.15, staleness_warn=10)
    assert passed and not sustained
    spike = [{**r, "round": 1, "engine_mismatch": 0.3} for r in steps]
    passed, sustained, _ = checks.mismatch_monitor(spike, 1, mismatch_warn=0.15, staleness_warn=10)
    assert not passed and not sustained  # above the threshold: a warning, not yet a sustained rise


def test_async1_collects_from_two_rounds_back_and_trains_on_from_the_previous_round(tmp_path):
    resources = _resources(tmp_path, schedule="async1", gate_margin=1.0)
    tables = resources["store"].tables()
    with instance_for_test() as instance:
        run_rounds(instance, resources, (1, 2, 3))
    served = {k: set(tables.read("trajectories", k).column("deployment_id").to_pylist()) for k in (1, 2, 3)}
    assert served == {1: {"base"}, 2: {"base"}, 3: {"main-r000001"}}  # lineage columns
    parents = {r["checkpoint_id"]: r["parent_id"] for r in tables.read("checkpoints").to_pylist()}
    assert parents["main-r000002"] == "main-r000001" and parents["main-r000003"] == "main-r000002"
    lag = {(r["round"], r["step"]): r["policy_lag_steps"] for r in tables.read("train_steps").to_pylist()}
    # optimizer steps between the sampling checkpoint and the trained policy: S = 2 behind from round 2 on
    assert lag == {(1, 1): 0, (1, 2): 1, (2, 3): 2, (2, 4): 3, (3, 5): 2, (3, 6): 3}


def test_a_round_trains_data_parallel_in_torchrun_processes_launched_through_pipes(tmp_path):
    resources = _resources(tmp_path, trainer_processes=2)
    with instance_for_test() as instance:
        run_rounds(instance, resources, (1,))
        meta = instance.get_latest_materialization_event(
            AssetKey("checkpoint")
        ).asset_materialization.metadata
    assert meta["trainer_processes"].value == 2
    assert meta["pipes_global_step"].value == meta["global_step"].value == 2  # reported by rank 0
    tables = resources["store"].tables()
    ckpt = lookup(tables, "checkpoints", "checkpoint_id", "main-r000001")
    saved = json.loads((Path(ckpt["path"]) / META_FILE).read_text())
    assert saved["data_parallel"] == 2 and saved["parent_id"] == BASE and saved["step"] == 2
    steps = tables.read("train_steps", 1).to_pylist()
    assert [r["step"] for r in steps] == [1, 2] and all(math.isfinite(r["loss"]) for r in steps)
    assert live_deployment(tables)["deployment_id"] == "main-r000001"  # the round went on to deploy


def test_a_trainer_pod_needs_object_storage_and_gets_its_gpus(tmp_path):
    resources = _resources(tmp_path, trainer_processes=2, trainer_image="registry.example/prodrl:1")
    with instance_for_test() as instance:
        assert materialize([base_model], instance=instance, resources=resources).success
        result = _round_one(instance, resources)
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert failure.step_key == "checkpoint"
    assert "object storage only" in failure.event_specific_data.error.message  # before any pod starts
    spec = trainer_pod_spec(4, "prodrl-s3")
    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert spec["containers"][0]["env_from"] == [{"secret_ref": {"name": "prodrl-s3"}}]
    assert spec["volumes"][0]["empty_dir"]["medium"] == "Memory"
    assert "env_from" not in trainer_pod_spec(1)["containers"][0]
