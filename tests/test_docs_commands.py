"""Every command README.md and docs/ show is executed somewhere: by this file, by another test
(`EXECUTED` names it and a line of it that runs the command, which must be there), by `make demo`
or by CI. A command added to the docs without an executor, or an executor that no longer runs
it, fails here. Long commands run in `slow` tests (`make test-slow`), GPU ones in `gpu` tests.
Links between the documents resolve to files in the repository."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
THIS = "tests/test_docs_commands.py"
COMMAND = re.compile(
    r"^(make\b|python[0-9.]* -m |\.venv/bin/|curl |dagster |torchrun |pip install |scripts/\S+\.sh"
    r"|export |[A-Z_]+=\S+ )"  # an environment prefix counts only in front of a command
)

EXECUTED: list[tuple[str, str, str]] = [
    # (the documented command, a regular expression; where it runs; what in that file runs it)
    (r"make demo( ROUNDS=\d+)?", "tests/test_ui.py", r'"make", "-s", "demo", f"ROUNDS=\{ROUNDS\}"'),
    (r"python -m assets\.demo --rounds 3", "Makefile", r"-m assets\.demo --rounds \$\(ROUNDS\)"),
    (r"(PRODRL_SETTINGS=production\.yaml )?make ui", "tests/test_ui.py", r'"make", "-s", "ui"'),
    (r"dagster dev", "Makefile", r"dagster dev -w workspace\.yaml"),
    (
        r"(PRODRL_SETTINGS=production\.yaml )?(PRODRL_API_KEYS=\S+ PRODRL_FEEDBACK_KEYS=\S+ )?make serve",
        "tests/test_ui.py",
        r'_block\(OPERATIONS, "PRODRL_API_KEYS="\)',
    ),
    (r"python -m resources\.serve --port \d+", "Makefile", r"-m resources\.serve --port \$\(SERVE_PORT\)"),
    (
        r"(PRODRL_API_KEYS=\S+ PRODRL_FEEDBACK_KEYS=\S+ \.venv/bin/)?python -m prodrl_pipeline\.simulate.*",
        "tests/test_ui.py",
        r'\["bash", "-c", simulate\]',
    ),
    (
        r"curl -X POST http://127\.0\.0\.1:8000/v1/feedback .*",
        "tests/test_ui.py",
        r'_block\(REPO / "docs" / "gateway\.md", "curl"\)',
    ),
    (
        r"export DAGSTER_HOME=.*|\.venv/bin/dagster asset materialize .*|dagster asset materialize",
        "tests/test_ui.py",
        r'_block\(OPERATIONS, "export DAGSTER_HOME"\)',
    ),
    (r"dagster sensor start round_sensor -w workspace\.yaml", "tests/test_ui.py", r"dagster sensor start"),
    (r"\.venv/bin/python", "tests/test_ui.py", r"exec\(walk\.group\(1\), rows\)"),
    (r"make test", ".ci/run", r"^make test$"),
    (r"make test-slow", THIS, r'"make", "-s", "test-slow"'),
    (r"make clean", THIS, r'"clean"'),
    (r"python -m prodrl_pipeline\.gateway --help", THIS, r'"prodrl_pipeline\.gateway", "--help"'),
    (
        r"python -m prodrl_pipeline\.records --root \.prodrl",
        "tests/test_clean_exits.py",
        r'"prodrl_pipeline\.records"',
    ),
    (r"pip install -e '\.\[(postgres|k8s)\]'", THIS, r'"pip", "install", "-e", f"\.\[\{extra\}\]"'),
    (r"make bench", THIS, r'"make", "-s", "bench"'),
    (r"python -m bench( --smoke)?", "tests/test_bench_smoke.py", r'"-m", "bench", "--smoke"'),
    (
        r"python -m bench\.scaling( --smoke)?",
        "tests/test_bench_smoke.py",
        r'"-m", "bench\.scaling", "--smoke"',
    ),
    (
        r"python -m bench\.(gateway(_load)? .*|w4a4_mismatch( .*)?|free_text_base( .*)?)",
        THIS,
        r"BENCH_COMMANDS",
    ),
    (r"make data|python -m prodrl_pipeline\.envs\.lab_data data", THIS, r'"make", "-s", "data"'),
    (
        r"python -m prodrl_pipeline\.envs\.lab_data data --tokenizers-only",
        THIS,
        r'"prodrl_pipeline\.envs\.lab_data", "data", "--tokenizers-only"',
    ),
    (
        r"python -m assets\.lab_traffic --mode free_text",
        THIS,
        r'"assets\.lab_traffic", "--mode", "free_text"',
    ),
    (r"make study|python -m assets\.study (run|report).*", THIS, r'"assets\.study",\s*"run"'),
    (
        r"python -m prodrl_pipeline\.rl\.retokenize .*",
        "tests/rl/test_retokenize_causes.py",
        r'"prodrl_pipeline\.rl\.retokenize"',
    ),
    (
        r"python -m prodrl_pipeline\.evals\.fidelity_study.*",
        "tests/evals/test_fidelity.py",
        r'"prodrl_pipeline\.evals\.fidelity_study"',
    ),
    (
        r"make mutation( MUTANTS='prodrl_pipeline\.evals\.gate\.\*')?",
        THIS,
        r'"MUTANTS=prodrl_pipeline\.evals\.gate\.\*"',
    ),
    (r"scripts/gpu_check\.sh|python -m bench\.(gpu_check|vllm_check)", THIS, r'"scripts/gpu_check\.sh"'),
    (r"python -m bench\.gpu_check --prepare DIR", THIS, r'"--prepare"'),
    (r"python -m bench\.gpu_nvfp4_check", THIS, r'"bench\.gpu_nvfp4_check"'),
    (
        r"VLLM_SERVER_DEV_MODE=1 python -m vllm\.entrypoints\.openai\.api_server .*",
        "prodrl_pipeline/engine/vllm_server.py",
        r'"VLLM_SERVER_DEV_MODE": "1"',
    ),  # started by serve_command in tests/engine/test_vllm.py (gpu)
    (
        r"(torchrun --standalone --nproc-per-node N|python -m torch\.distributed\.run \.\.\.)"
        r" -m resources\.pipes_train",
        "tests/test_pipeline.py",
        r"trainer_processes=2",  # the checkpoint asset launches it (assets/torchrun.py)
    ),
    (
        r"torchrun --standalone --nproc-per-node 2 -m prodrl_pipeline\.rl\.train_distributed .*",
        "tests/rl/test_distributed.py",
        r'"prodrl_pipeline\.rl\.train_distributed"',
    ),
]


def documented_commands() -> dict[str, set[str]]:
    """Each command in a shell block (continuation lines joined, comments dropped) or in an inline
    code span that starts like one, with the documents that show it."""
    found: dict[str, set[str]] = {}
    for doc in DOCS:
        text = doc.read_text()
        for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, re.S):
            lines = body.replace("\\\n", " ").splitlines()
            if lang not in ("bash", "sh") and not (lines and COMMAND.match(lines[0].strip())):
                continue
            for line in lines:
                line = re.sub(r"\s+#\s.*$", "", line).strip()
                if line and not line.startswith("#"):
                    found.setdefault(" ".join(line.split()), set()).add(doc.name)
        for span in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
            if COMMAND.match(span) or span == ".venv/bin/python":
                found.setdefault(" ".join(span.split()), set()).add(doc.name)
    return found


def test_every_documented_command_has_an_executor():
    commands = documented_commands()
    unrun = {c: sorted(d) for c, d in commands.items() if not any(re.fullmatch(p, c) for p, _, _ in EXECUTED)}
    assert not unrun, f"documented commands nothing executes: {unrun}"
    stale = [p for p, _, _ in EXECUTED if not any(re.fullmatch(p, c) for c in commands)]
    assert not stale, f"executors of commands the docs no longer show: {stale}"


@pytest.mark.parametrize(("where", "evidence"), sorted({(w, e) for _, w, e in EXECUTED}))
def test_each_executor_runs_its_command(where, evidence):
    text = (REPO / where).read_text()
    if where == THIS:  # the evidence is looked for in the tests below, not in EXECUTED itself
        text = text[text.index("def documented_commands") :]
    assert re.search(evidence, text, re.M), f"{where} no longer runs it ({evidence})"


def test_links_between_documents_resolve():
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)", doc.read_text()):
            if "://" not in target:
                assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which is not here"


def _run(args: list[str], timeout: int, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(
        args, cwd=kwargs.pop("cwd", REPO), capture_output=True, text=True, timeout=timeout, **kwargs
    )
    assert done.returncode == 0, (args, done.stdout[-3000:], done.stderr[-3000:])
    return done


def test_gateway_help_lists_its_options():
    out = _run([sys.executable, "-m", "prodrl_pipeline.gateway", "--help"], 120).stdout
    assert "--root" in out and "--top-logprobs" in out and "--ttl" in out


def test_make_clean_removes_what_the_demo_wrote(tmp_path):
    (tmp_path / ".prodrl" / "dagster_home").mkdir(parents=True)
    (tmp_path / "kept.txt").write_text("not the demo's")
    _run(["make", "-s", "-f", str(REPO / "Makefile"), "-C", str(tmp_path), "clean"], 60)
    assert not (tmp_path / ".prodrl").exists() and (tmp_path / "kept.txt").exists()


def test_make_test_slow_collects_the_slow_tests():
    env = {**os.environ, "PYTEST_ADDOPTS": "--collect-only"}  # the command, collecting only
    out = _run(["make", "-s", "test-slow"], 300, env=env).stdout
    assert re.search(r"\d+/\d+ tests collected", out) and "test_docs_commands.py::test_make_bench" in out


@pytest.mark.slow
@pytest.mark.parametrize("extra", ["postgres", "k8s"])
def test_the_documented_extras_install(extra):
    _run([sys.executable, "-m", "pip", "install", "-e", f".[{extra}]", "-c", "constraints.txt"], 900)


BENCH_COMMANDS = [
    ["bench.gateway", "--bursts", "4"],
    ["bench.gateway_load", "--rounds", "3"],
    ["bench.w4a4_mismatch"],
    ["bench.w4a4_mismatch", "--mode", "free_text", "--puzzles", "8", "--warm-start-steps", "2"],
    ["bench.free_text_base", "--steps", "20", "--copy-steps", "20", "--heldout", "16", "--nll-turns", "8"],
]


@pytest.mark.slow
@pytest.mark.parametrize("command", BENCH_COMMANDS, ids=lambda c: c[0])
def test_the_documented_bench_commands(command):
    _run([sys.executable, "-m", *command], 1800)


@pytest.mark.slow
def test_make_bench():
    _run(["make", "-s", "bench"], 3600)


@pytest.mark.slow
def test_make_data_regenerates_the_shipped_data_byte_for_byte():
    _run(["make", "-s", "data"], 3600)
    changed = _run(["git", "status", "--porcelain", "data"], 60).stdout
    assert not changed, changed


@pytest.mark.slow
def test_the_tokenizers_rebuild_byte_for_byte():
    _run([sys.executable, "-m", "prodrl_pipeline.envs.lab_data", "data", "--tokenizers-only"], 1800)
    changed = _run(["git", "status", "--porcelain", "data"], 60).stdout
    assert not changed, changed


@pytest.mark.slow
def test_the_documented_lab_traffic_command():
    out = _run([sys.executable, "-m", "assets.lab_traffic", "--mode", "free_text"], 3600).stdout
    assert "round1_parse_rate" in out and "round1_non_canonical_per_1000" in out


@pytest.mark.slow
def test_the_documented_study_run_and_report(tmp_path):
    """README's study command in a folder of its own (the study writes under ./.prodrl/study)."""
    (tmp_path / "data").symlink_to(REPO / "data")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = [
        sys.executable,
        "-m",
        "assets.study",
        "run",
        "--configs",
        "sc16,tis_ppo",
        "--seeds",
        "0",
        "--rounds",
        "3",
    ]
    _run(run, 3600, cwd=tmp_path, env=env)
    out = _run([sys.executable, "-m", "assets.study", "report"], 600, cwd=tmp_path, env=env).stdout
    assert "sc16" in out and "tis_ppo" in out


@pytest.mark.slow
def test_make_mutation_on_the_deploy_gate(tmp_path):
    _run(["make", "-s", "mutation", "MUTANTS=prodrl_pipeline.evals.gate.*"], 3600)
    assert (REPO / "mutants" / "score.json").exists()


@pytest.mark.gpu
def test_the_gpu_check(tmp_path):
    env = {**os.environ, "PRODRL_GPU_PYTHON": sys.executable}
    _run(["bash", "scripts/gpu_check.sh"], 3600, env=env)
    _run([sys.executable, "-m", "bench.gpu_nvfp4_check"], 1800)
    _run([sys.executable, "-m", "bench.gpu_check", "--prepare", str(tmp_path / "prepared")], 1800)
    assert shutil.which("nvidia-smi")
