"""The operator's view, as a new user gets it: `make demo` (tiny settings, two rounds) submits its
runs to the instance, where the daemon launches them; every round's metadata leads to its exact
rows; and `make ui`, driven in headless Chromium, shows the asset graph, a round's eval report with
its curves drawn in place, the Plots tab, the runs of `round_job` and the timeline, starting
without a warning. Screenshots land in $PRODRL_SCREENSHOTS when set (else the test's folder)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from dagster import (
    AssetKey,
    AssetRecordsFilter,
    DagsterEventType,
    DagsterInstance,
    DagsterRunStatus,
    RunsFilter,
)
from dagster._core.scheduler.instigation import InstigatorStatus

from assets.eval_report import PLOTTED
from assets.launch import stop
from prodrl_pipeline.gateway.process import free_port
from prodrl_pipeline.records.store import DeltaStore
from tests.test_pipeline import TINY

REPO = Path(__file__).resolve().parent.parent
ROUNDS = 2
OPERATIONS = REPO / "docs" / "operations.md"
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")


@dataclass
class Demo:
    home: Path
    env: dict[str, str]
    store: DeltaStore
    output: str


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Demo:
    tmp = tmp_path_factory.mktemp("demo")
    settings = tmp / "tiny.yaml"
    settings.write_text(
        yaml.safe_dump(
            {"lab": {**TINY, "data_dir": str(REPO / "data")}, "store": {"root": str(tmp / "store")}}
        )
    )
    home = tmp / "dagster_home"
    env = {**os.environ, "DAGSTER_HOME": str(home), "PRODRL_SETTINGS": str(settings)}
    demo = subprocess.Popen(  # its own session: a timeout kills the demo and its daemon with it
        ["make", "-s", "demo", f"ROUNDS={ROUNDS}"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = demo.communicate(timeout=900)
    finally:
        with suppress(ProcessLookupError):
            os.killpg(demo.pid, signal.SIGKILL)
    assert demo.returncode == 0, out[-4000:] + err[-4000:]
    return Demo(home, env, DeltaStore(tmp / "store" / "tables"), out)


def _materializations(instance: DagsterInstance, asset: str) -> dict:
    """The latest materialization record of each round partition of `asset`."""
    out = {}
    for partition in (f"r{k:06d}" for k in range(1, ROUNDS + 1)):
        found = instance.fetch_materializations(
            AssetRecordsFilter(asset_key=AssetKey(asset), asset_partitions=[partition]), limit=1
        ).records
        if found:
            out[partition] = found[0]
    return out


def test_the_demo_submits_its_runs_to_the_queue_and_shows_their_progress(demo):
    with DagsterInstance.from_config(str(demo.home)) as instance:
        runs = instance.get_runs(RunsFilter(job_name="round_job"))
        assert sorted(r.tags["dagster/partition"] for r in runs) == [
            f"r{k:06d}" for k in range(1, ROUNDS + 1)
        ]
        (base,) = instance.get_runs(RunsFilter(job_name="base_job"))
        for run in [base, *runs]:
            assert run.status == DagsterRunStatus.SUCCESS
            kinds = [
                r.event_log_entry.dagster_event_type for r in instance.get_records_for_run(run.run_id).records
            ]
            # submitted to the queue and launched from it (not executed in the demo's process)
            assert DagsterEventType.RUN_ENQUEUED in kinds and DagsterEventType.RUN_STARTING in kinds, kinds
        by_partition = {r.tags["dagster/partition"]: r.run_id for r in runs}
        for asset in ("trajectories", "advantages", "checkpoint", "deployment", "eval_report"):
            history = _materializations(instance, asset)
            assert {p: m.run_id for p, m in history.items()} == by_partition, asset
    out = demo.output
    for k, (_, run_id) in enumerate(sorted(by_partition.items()), start=1):
        assert (
            f"[round {k}] run {run_id[:8]} queued" in out and f"[round {k}] run {run_id[:8]} success" in out
        )
        assert re.search(rf"\[round {k}\]   checkpoint: round {k} step \d+: reward", out), out[-2000:]
        assert f"[round {k}]   deployment: check deploy_gate passed" in out
    assert "| round | train_reward | heldout_solve_rate |" in out


def test_a_rounds_metadata_leads_to_its_exact_rows(demo):
    with DagsterInstance.from_config(str(demo.home)) as instance:
        report = _materializations(instance, "eval_report")[f"r{ROUNDS:06d}"].asset_materialization.metadata
        collected = _materializations(instance, "trajectories")[f"r{ROUNDS:06d}"]
    for name in ["heldout_solve_rate", *PLOTTED]:  # floats: the Plots tab draws them across rounds
        assert isinstance(report[name].value, float), name
    for name in ("checkpoint", "deployment"):
        assert Path(report[name].value).is_absolute() and Path(report[name].value, "config.json").exists()

    # what the trajectories step wrote: each version is a commit of that run, for that round
    written = collected.asset_materialization.metadata["delta_written"].value
    assert set(written) == {"calls", "rejects", "trajectories"}
    for table, versions in written.items():
        history = {h["version"]: h for h in demo.store.table(table).history()}
        for v in versions:
            assert history[v].get("dagster_run_id") == collected.run_id, (table, v)
            assert history[v].get("partition") == f"r{ROUNDS:06d}"

    code = re.fullmatch(r"```python\n(.*)```", report["query"].value, re.S).group(1)

    def run_query() -> dict:
        scope: dict = {}
        exec(code, scope)  # noqa: S102 - the query as a user pastes it
        return scope

    rows = run_query()
    # the walk in docs/operations.md, run as written on the round's rows
    walk = re.search(
        r"<!-- tests/test_ui.py runs this block[^>]*-->\n```python\n(.*?)```", OPERATIONS.read_text(), re.S
    )
    exec(walk.group(1), rows)  # noqa: S102
    assert rows["turns"].height > 0 and set(rows["turns"]["trajectory_id"]) <= set(
        rows["trajectories"]["trajectory_id"]
    )
    assert rows["calls"].height == demo.store.read("calls", ROUNDS).num_rows > 0
    assert rows["trajectories"].height == demo.store.read("trajectories", ROUNDS).num_rows
    assert rows["steps"].height == TINY["steps"] and set(rows["steps"]["round"]) == {ROUNDS}
    assert set(rows["episode"]["trajectory_id"]) == {rows["trajectories"]["trajectory_id"][0]}
    # pinned: rows written to the round since the report do not change what the query opens
    calls = demo.store.read("calls", ROUNDS)
    demo.store.overwrite_round("calls", calls.slice(0, 1), ROUNDS)
    try:
        assert run_query()["calls"].height == calls.num_rows
    finally:
        demo.store.overwrite_round("calls", calls, ROUNDS)


def _browser_missing() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed"
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        return f"no browser: {', '.join(missing)} missing (Debian's chromium, chromium-driver)"
    try:  # a shim that only points at another installer (Ubuntu's snap) does not run here
        version = [str(CHROMIUM), "--headless", "--version"]
        subprocess.run(version, capture_output=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{CHROMIUM} does not run: {e}"
    return None


@pytest.fixture
def ui(demo, tmp_path):
    """`make ui` on a free port over the demo's instance; its output, for the quiet-start check."""
    port, log = free_port(), tmp_path / "ui.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["make", "-s", "ui", f"UI_PORT={port}"],
            cwd=REPO,
            env=demo.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:  # readiness probe: the code location is loaded when the asset graph comes back
            try:
                body = {"query": "{ assetNodes { assetKey { path } } }"}
                if httpx.post(f"{url}/graphql", json=body, timeout=5).json()["data"]["assetNodes"]:
                    break
            except (httpx.TransportError, KeyError, TypeError, ValueError):
                pass
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        yield url, log.read_text()  # what it printed while starting
    finally:
        stop(proc, grace_s=60)


BROWSER_MISSING = _browser_missing()


@pytest.mark.skipif(BROWSER_MISSING is not None, reason=str(BROWSER_MISSING))
def test_the_ui_in_a_browser_shows_graph_report_plots_and_runs(demo, ui, tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    url, started = ui
    shots = Path(os.environ.get("PRODRL_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (  # a closed network: no background connections, no first-run pages
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1500,1000",
        f"--user-data-dir={tmp_path / 'chromium'}",
    ):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    wait = WebDriverWait(browser, 90)

    def page(path: str, ready, shot: str):
        browser.get(url + path)
        found = wait.until(ready)
        browser.save_screenshot(str(shots / shot))
        return found

    def text(*needles: str):
        return lambda b: all(n in b.find_element(By.TAG_NAME, "body").text for n in needles)

    try:
        assets = ("base_model", "trajectories", "advantages", "checkpoint", "deployment", "eval_report")
        page("/locations/assets.definitions/asset-groups/round/lineage", text(*assets), "asset_graph.png")

        def drawn_curves(b):
            images = b.find_elements(By.CSS_SELECTOR, "img[src^='data:image/svg+xml']")
            return next((i for i in images if i.get_property("naturalWidth") > 0), None)

        curves = page(f"/assets/eval_report?partition=r{ROUNDS:06d}", drawn_curves, "eval_report.png")
        browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", curves)
        assert "per round: held-out solve rate" in curves.get_attribute("alt")
        browser.save_screenshot(str(shots / "eval_report_curves.png"))
        plots = next(b for b in browser.find_elements(By.TAG_NAME, "button") if b.text.strip() == "Plots")
        plots.click()
        wait.until(  # one plot per number, by partition
            lambda b: text(*PLOTTED)(b) and len(b.find_elements(By.TAG_NAME, "canvas")) >= len(PLOTTED)
        )
        browser.save_screenshot(str(shots / "eval_report_plots.png"))

        with DagsterInstance.from_config(str(demo.home)) as instance:
            run_ids = [r.run_id[:8] for r in instance.get_runs(RunsFilter(job_name="round_job"))]
        page("/locations/assets.definitions/jobs/round_job/runs", text(*run_ids), "round_job_runs.png")
        page("/overview/activity/timeline", text("round_job", "base_job"), "timeline.png")
    finally:
        browser.quit()
    assert not re.search(r"warn", started, re.I), started  # a quiet start: nothing to act on
    names = {
        "asset_graph",
        "eval_report",
        "eval_report_curves",
        "eval_report_plots",
        "round_job_runs",
        "timeline",
    }
    assert {p.stem for p in shots.glob("*.png")} >= names


def _block(doc: Path, first: str) -> str:
    """The fenced block of `doc` whose first line starts with `first`, continuation lines joined."""
    blocks = re.findall(r"```\w*\n(.*?)```", doc.read_text(), re.S)
    (block,) = [b for b in blocks if b.lstrip().startswith(first)]
    return block


@contextmanager
def _started(command: list[str], env: dict[str, str], log: Path):
    """A make target in its own session, stopped (SIGINT, then SIGKILL) when the block ends."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield proc
    finally:
        stop(proc, grace_s=60)


def test_make_serve_with_the_documented_simulator_client_and_feedback_curl(demo, tmp_path):
    """docs/operations.md's two terminals and docs/gateway.md's client and `curl`, as written but
    for the port (8000 may be taken here)."""
    port = free_port()
    serve_line, simulate_line = _block(OPERATIONS, "PRODRL_API_KEYS=").replace("\\\n", "").splitlines()[:2]
    keys = dict(kv.split("=", 1) for kv in serve_line.split()[:2])
    serve = ["bash", "-c", f"{serve_line.split('#')[0].strip()} SERVE_PORT={port}"]
    with _started(serve, demo.env, tmp_path / "serve.log") as proc:
        deadline = time.monotonic() + 120
        while True:  # readiness probe: the gateway answers its health check once the model is loaded
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "serve.log").read_text()
            time.sleep(0.5)
        simulate = simulate_line.replace("http://127.0.0.1:8000", f"http://127.0.0.1:{port}")
        played = subprocess.run(
            ["bash", "-c", simulate], cwd=REPO, env=demo.env, capture_output=True, text=True, timeout=300
        )
        assert played.returncode == 0, played.stdout[-2000:] + played.stderr[-2000:]
        assert "64 episodes" in played.stdout

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=keys["PRODRL_API_KEYS"])
        reply = client.chat.completions.create(  # the documented client call, with a real message
            model="live",
            messages=[{"role": "user", "content": "Your move."}],
            max_tokens=4,
            extra_headers={"X-Prodrl-Trajectory-Id": "session-123"},
        )
        assert reply.model_extra["prodrl"]["trajectory_id"] == "session-123"
        curl = _block(REPO / "docs" / "gateway.md", "curl").replace(
            "http://127.0.0.1:8000", f"http://127.0.0.1:{port}"
        )
        answer = subprocess.run(
            ["bash", "-c", curl],
            env={**os.environ, "FEEDBACK_KEY": keys["PRODRL_FEEDBACK_KEYS"]},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert answer.returncode == 0, answer.stderr
        assert json.loads(answer.stdout)["trajectory_id"] == "session-123", answer.stdout


def test_the_documented_replay_and_sensor_commands(demo):
    """docs/operations.md's ranged re-materialization and the sensor's start, on the demo's
    instance: the replayed rounds reproduce their rows, each round's metadata stays its own, and
    the sensor turns on. Last in the module: it re-materializes rounds the tests above read, and
    leaves the sensor on in an instance no daemon serves again."""
    before = {t: demo.store.read(t).sort_by("trajectory_id") for t in ("trajectories", "advantages")}
    replay = _block(OPERATIONS, "export DAGSTER_HOME").replace("\\\n", "").splitlines()[1]
    env = {**demo.env, "PYTHONPATH": str(REPO)}  # the block's `export` line, for this instance
    done = subprocess.run(
        ["bash", "-c", replay], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert {t: demo.store.read(t).sort_by("trajectory_id") for t in before} == before
    with DagsterInstance.from_config(str(demo.home)) as instance:
        report = _materializations(instance, "eval_report")
    for key in report:  # one result stamped on both rounds: each round's values are under its key
        meta = report[key].asset_materialization.metadata
        assert "query" not in meta and "heldout_solve_rate" not in meta
        assert set(meta["per_round"].value) == set(report) and meta["rounds_in_run"].value == ROUNDS
    per_round = meta["per_round"].value
    assert len({per_round[k]["checkpoint"] for k in per_round}) == ROUNDS  # each round its own

    sensor = re.search(r"`(dagster sensor start [^`]+)`", OPERATIONS.read_text()).group(1)
    dagster = [str(REPO / ".venv/bin/dagster"), *sensor.split()[1:]]
    done = subprocess.run(dagster, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    with DagsterInstance.from_config(str(demo.home)) as instance:
        states = {s.name: s.status for s in instance.all_instigator_state()}
    assert states["round_sensor"] == InstigatorStatus.RUNNING
    # the demo will not run rounds beside the sensor (which would add the next round too)
    refused = subprocess.run(
        [sys.executable, "-m", "assets.demo", "--rounds", "1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode != 0 and "round_sensor is on" in refused.stderr, refused.stderr[-2000:]
