"""One production round per real model family: a tiny random model of the family's vocabulary,
handed over as an HF checkpoint with the family's own tokenizer and template, becomes the base
deployment; the gateway serves it; a round trains on its recorded traffic and deploys; the gateway
follows the new deployment and serves it, every prompt recorded as the family renders the request.
The canary is off here (tests/gateway/test_canary_routing.py runs it)."""

import httpx
import pytest
from dagster import instance_for_test, materialize

from assets.base_model import base_model
from assets.partitions import round_key
from prodrl_pipeline.chat.harmony import HarmonyChat
from prodrl_pipeline.records.registry import live_deployment
from prodrl_pipeline.records.store import DeltaStore
from resources.lab import CanarySettings
from tests.families import FAMILIES, WEATHER, family_tokenizer
from tests.gateway.conftest import FEEDBACK_KEY, SERVE_KEY, Gateway
from tests.gateway.test_families import WITH_TOOLS, _reference
from tests.gateway.test_follow import _health, _until
from tests.test_pipeline import ASSETS, ROUND, _resources, user_checkpoint

SERVE, FEEDBACK = {"Authorization": f"Bearer {SERVE_KEY}"}, {"Authorization": f"Bearer {FEEDBACK_KEY}"}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_production_round_deploys_and_the_gateway_follows_it(family, tmp_path):
    tok = family_tokenizer(family)
    model = user_checkpoint(tmp_path / "model", tok)
    resources = _resources(
        tmp_path,
        source="production",
        base_checkpoint=str(model),
        steps=1,
        batch_size=4,
        canary=CanarySettings(type="off"),  # the candidate goes live at once: the gate is tested elsewhere
    )
    prompt_ids = HarmonyChat(tok).prompt_ids if family == "gptoss" else lambda m, t: _reference(tok, m, t)
    sent: dict[str, tuple[list[dict], list | None]] = {}

    def chat(tid: str, **extra) -> dict:
        body = {
            "messages": [{"role": "user", "content": f"task {tid}"}],
            "max_tokens": 6,
            "user": tid,
            **extra,
        }
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=SERVE, timeout=120)
        assert r.status_code == 200, r.text
        reply = r.json()
        sent[reply["prodrl"]["call_id"]] = (body["messages"], extra.get("tools"))
        return reply

    with instance_for_test() as instance:
        assert materialize([base_model], instance=instance, resources=resources).success
        gw = Gateway(tmp_path, "--tokenizer", str(model), "--follow-seconds", "0.2").start(timeout=180)
        try:
            for i in range(4):
                forced = family in WITH_TOOLS | {"gptoss"} and i == 3
                tools = {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 64} if forced else {}
                assert chat(f"t{i}", **tools)["model"] == "base"
                r = httpx.post(
                    f"{gw.url}/v1/feedback",
                    json={"trajectory_id": f"t{i}", "reward": i % 2},
                    headers=FEEDBACK,
                )
                assert r.status_code == 200, r.text
            store = DeltaStore(tmp_path / "tables")
            _until(
                lambda: store.exists("landing_feedback") and store.read("landing_feedback").num_rows == 4,
                "landed",
            )

            instance.add_dynamic_partitions("rounds", [round_key(1)])
            result = materialize(
                ASSETS, selection=ROUND, partition_key=round_key(1), instance=instance, resources=resources
            )
            assert result.success
            new = live_deployment(store)["deployment_id"]
            assert new == "main-r000001"
            _until(lambda: _health(gw.url)["deployment_id"] == new, f"the gateway follows {new}", timeout=120)
            assert chat("after")["model"] == new
        finally:
            gw.stop()
    trained = store.read("trajectories", 1).to_pylist()
    assert sorted(t["trajectory_id"] for t in trained) == [f"t{i}" for i in range(4)]
    landed = {r["call_id"]: r for r in store.read("landing_calls").to_pylist()}
    assert set(sent) == set(landed)
    for call_id, (messages, tools) in sent.items():
        assert landed[call_id]["prompt_token_ids"] == prompt_ids(messages, tools), (family, messages)
    assert [r["deployment_id"] for r in landed.values() if r["trajectory_id"] == "after"] == [new]
