"""The `checkpoint` asset's data-parallel trainer: torchrun processes launched through Dagster
Pipes, here (PipesSubprocessClient) or in a Kubernetes pod with GPUs (PipesK8sClient)."""

import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from dagster import AssetExecutionContext, Failure, PipesSubprocessClient
from dagster._core.errors import DagsterPipesExecutionError  # what PipesSubprocessClient raises; not exported

from prodrl_pipeline.artifacts import STORAGE_OPTIONS_ENV, is_remote
from prodrl_pipeline.rl.trainer import TrainerConfig
from resources.lab import LabResource
from resources.store import StoreResource

SECRET_OPTIONS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
"""Storage options that must not be written into a pod spec."""
REPO = Path(__file__).resolve().parent.parent


def train_with_torchrun(  # noqa: PLR0913
    context: AssetExecutionContext,
    lab: LabResource,
    cfg: TrainerConfig,
    store: StoreResource,
    k: int,
    parent: str,
    out: str,
    meta: dict,
    behaviour_step: int,
    progress: Callable[[AssetExecutionContext, int, dict], None],
) -> tuple[list[dict], dict, str]:
    """S steps data-parallel in `lab.trainer_processes` torchrun processes launched through Dagster
    Pipes: here (PipesSubprocessClient, from the repository root) or, with `lab.trainer_image`,
    in a Kubernetes pod with that many GPUs (PipesK8sClient), which reads the tables and the
    parent and writes `out` on the object store itself. Rank 0 writes the checkpoint and reports
    the step rows and where it wrote (on S3 a new version below `out`), returned with the rows.
    pi_k stays inside the processes: `policy_logprobs` keeps no rows for the round."""
    if cfg.tokens != "recorded" or cfg.qat or cfg.estimator.type == "ref_is":
        raise Failure(
            description="trainer_processes > 0 trains recorded tokens without QAT, with any estimator "
            "but ref_is"
        )
    tables_uri = store.tables().root
    in_pod = bool(lab.trainer_image)
    if in_pod and not all(is_remote(uri) for uri in (tables_uri, parent, out)):
        raise Failure(
            description="a trainer pod (lab.trainer_image) reads and writes object storage only: set "
            "store.tables_uri and store.artifacts_uri to s3:// URIs (and train the parent there)"
        )
    secrets = sorted(k for k in store.storage_options if k.upper() in SECRET_OPTIONS)
    if in_pod and secrets:
        raise Failure(
            description=f"the storage options hold {', '.join(secrets)}, which would be written into the "
            "trainer pod's spec: put them in a Kubernetes Secret named by lab.trainer_secret, or give "
            "the pod a service account with access"
        )
    local = lambda uri: uri if is_remote(uri) else str(Path(uri).resolve())  # noqa: E731
    args = [
        "--tables", local(tables_uri), "--round", str(k), "--parent", local(parent), "--out", local(out),
        "--trainer", json.dumps(asdict(cfg)), "--pad-id", str(lab.pad_id()),
        "--behaviour-step", str(behaviour_step), "--meta", json.dumps(meta, default=str),
    ]  # fmt: skip
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(lab.trainer_processes)]
    env = {STORAGE_OPTIONS_ENV: json.dumps(store.storage_options)}
    try:
        if in_pod:
            from dagster_k8s import PipesK8sClient  # noqa: PLC0415 (the k8s extra)

            invocation = PipesK8sClient().run(
                context=context,
                image=lab.trainer_image,
                command=["python", *torchrun, "-m", "resources.pipes_train", *args],
                namespace=lab.trainer_namespace or None,
                env=env,
                base_pod_spec=trainer_pod_spec(lab.trainer_processes, lab.trainer_secret),
            )
        else:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
            command = [sys.executable, *torchrun, "-m", "resources.pipes_train", *args]
            invocation = PipesSubprocessClient(cwd=str(REPO), env=env).run(command=command, context=context)
        results = invocation.get_results()
    except DagsterPipesExecutionError as e:
        raise Failure(
            description=f"round {k}: the {lab.trainer_processes} trainer processes failed ({e}); "
            "their tracebacks are in this step's stderr"
        ) from e
    store.tables(context.run.run_id).overwrite(
        "policy_logprobs", [], f"round = {k} AND experiment = '{lab.experiment}'"
    )  # rows an earlier in-process run left would not match this checkpoint
    reported = {
        key: value.value if hasattr(value, "value") else value
        for r in results
        for key, value in (r.metadata or {}).items()
    }
    rows, written = reported.pop("step_rows"), reported.pop("checkpoint_uri")
    for row in rows:
        progress(context, k, row)
    extra = {
        "trainer_processes": lab.trainer_processes,
        **({"trainer_image": lab.trainer_image} if in_pod else {}),
        **{f"pipes_{key}": v for key, v in reported.items()},
    }
    return rows, extra, written


def trainer_pod_spec(gpus: int, secret: str = "") -> dict:
    """The trainer pod: `gpus` GPUs for its first container (one torchrun process each), a
    memory-backed /dev/shm (NCCL needs more than the default 64 MiB), the keys of Secret `secret`
    as environment variables, no restart."""
    container = {
        "name": "trainer",
        "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
        "volume_mounts": [{"name": "shm", "mount_path": "/dev/shm"}],
    }
    if secret:
        container["env_from"] = [{"secret_ref": {"name": secret}}]
    return {
        "restart_policy": "Never",
        "containers": [container],
        "volumes": [{"name": "shm", "empty_dir": {"medium": "Memory"}}],
    }
