"""Production path: a model of the deployment's own (no lab in it) -> gateway traffic + late rewards
-> the `trajectories` asset's snapshot -> a round, whose candidate opens its canary."""

import httpx
from dagster import AssetKey, instance_for_test, materialize
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from assets.base_model import base_model
from assets.partitions import round_key
from prodrl_pipeline.evals.gate import NO_EVALUATION
from prodrl_pipeline.records import canaries
from prodrl_pipeline.records.registry import live_deployment
from prodrl_pipeline.records.store import DeltaStore
from tests.gateway.conftest import FEEDBACK_KEY, SERVE_KEY, Gateway
from tests.test_pipeline import ASSETS, ROUND, _resources, user_checkpoint

PLAIN_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}\n{{ m.content }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)
CHESS = ("heldout", "solve", "mate", "puzzle")
"""What of the lab's evaluation a production asset's metadata must not name."""

# trajectory ids as clients send them: plain in the header, any text as `user`
TIDS = [f"t{i}" if i % 2 else f"ü {i}@example.com\r\n'; --" for i in range(10)]


def plain_tokenizer() -> PreTrainedTokenizerFast:
    """A model family's tokenizer unlike the lab's: a small byte-level BPE trained here, a plain chat
    template, no tool-call tokens and no pad token (as Llama 3's)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|start|>", "<|eot|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(["a user asks for a task, turn by turn, and the model answers"] * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|eot|>", chat_template=PLAIN_TEMPLATE)


def _metadata(instance, asset: str) -> dict:
    return instance.get_latest_materialization_event(AssetKey(asset)).asset_materialization.metadata


def test_a_round_trains_on_recorded_production_traffic(tmp_path, monkeypatch):
    """The base is a checkpoint whose tokenizer has neither `<tool_call>` nor a pad token: it is
    deployed and served, and a round trains on its traffic and opens its candidate's canary against
    live, without reading a puzzle or evaluating anything offline."""
    tok = plain_tokenizer()
    assert tok.pad_token_id is None and "<tool_call>" not in tok.get_vocab()
    model = user_checkpoint(tmp_path / "model", tok)
    resources = _resources(tmp_path, source="production", base_checkpoint=str(model), steps=2, batch_size=4)

    def no_puzzles(*args):
        raise AssertionError("production mode read the lab's puzzles")

    monkeypatch.setattr("resources.lab._puzzles", no_puzzles)
    with instance_for_test() as instance:
        assert materialize([base_model], instance=instance, resources=resources).success
        base = _metadata(instance, "base_model")
        assert base["evaluation"].value == NO_EVALUATION and base["vocab_size"].value == len(tok)
        assert not [k for k in base if any(word in k for word in CHESS)]
        gw = Gateway(tmp_path, "--tokenizer", str(model)).start()  # serves the live deployment: base
        serve = {"Authorization": f"Bearer {SERVE_KEY}"}
        for i in range(10):
            for turn in range(2):
                body = {"messages": [{"role": "user", "content": f"task {i} turn {turn}"}], "max_tokens": 6}
                named = {"X-Prodrl-Trajectory-Id": TIDS[i]} if i % 2 else {}
                r = httpx.post(
                    f"{gw.url}/v1/chat/completions",
                    json=body if i % 2 else {**body, "user": TIDS[i]},
                    headers={**serve, **named},
                )
                assert r.status_code == 200
            if i < 9:  # t9 stays unscored: it must not be trained on
                fb = {"trajectory_id": TIDS[i], "reward": float(i % 2)}
                r = httpx.post(
                    f"{gw.url}/v1/feedback", json=fb, headers={"Authorization": f"Bearer {FEEDBACK_KEY}"}
                )
                assert r.status_code == 200
        gw.stop()

        instance.add_dynamic_partitions("rounds", [round_key(1)])
        result = materialize(
            ASSETS, selection=ROUND, partition_key=round_key(1), instance=instance, resources=resources
        )
        assert result.success
        (gate,) = [e for e in result.get_asset_check_evaluations() if e.check_name == "deploy_gate"]
        assert gate.passed and gate.description.startswith(
            "canary main-r000001.1 open: main-r000001 serves 25% of new trajectories beside base"
        )
        assert gate.metadata["gate"].value == "canary" and gate.metadata["min_per_arm"].value == 1000
        deployed, report = _metadata(instance, "deployment"), _metadata(instance, "eval_report")
        assert not deployed["moved_live"].value and deployed["evaluation"].value == NO_EVALUATION
        assert report["evaluation"].value == NO_EVALUATION
        assert not [k for k in (*deployed, *report) if any(word in k for word in CHESS)]
        assert not any(word in report["rounds"].value for word in CHESS)  # the per-round table
        assert report["train_reward"].value == 0.5  # rewards 0, 1, 0, 1, ... of t0..t7
        tables = DeltaStore(tmp_path / "tables")
        assert not tables.exists("eval_results")
        trajs = tables.read("trajectories", 1).to_pylist()
        assert len(trajs) == 8 and {t["source"] for t in trajs} == {"production"}
        assert {t["deployment_id"] for t in trajs} == {"base"}
        assert {t["trajectory_id"] for t in trajs} == set(TIDS[:8])  # the earliest, exactly as named
        assert all(t["n_calls"] == 2 for t in trajs)
        assert tables.read("calls", 1).num_rows == 16
        meta = instance.get_latest_materialization_event(
            AssetKey("trajectories")
        ).asset_materialization.metadata
        pinned = {t: meta[f"{t}_version"].value for t in ("landing_calls", "landing_feedback")}

        # a replay reads the same landing versions, even after more traffic has landed
        tables.append(
            "landing_feedback",
            [
                {
                    "feedback_id": "late",
                    "trajectory_id": "t9",
                    "reward": 1.0,
                    "comment": None,
                    "overwrite": False,
                    "received_at": trajs[0]["finished_at"],
                }
            ],
        )
        recollect = {"ops": {"trajectories": {"config": {"recollect": True}}}}
        assert materialize(
            ASSETS,
            selection=ROUND[:1],
            partition_key=round_key(1),
            instance=instance,
            resources=resources,
            run_config=recollect,
        ).success
        again = tables.read("trajectories", 1).to_pylist()
        assert sorted(t["trajectory_id"] for t in again) == sorted(t["trajectory_id"] for t in trajs)
        meta = instance.get_latest_materialization_event(
            AssetKey("trajectories")
        ).asset_materialization.metadata
        assert {t: meta[f"{t}_version"].value for t in pinned} == pinned
        assert live_deployment(tables)["deployment_id"] == "base"  # until the canary is promoted
        assert canaries.of_round(canaries.canaries(tables), "main-r000001")["status"] == canaries.OPEN
