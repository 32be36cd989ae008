"""The lab's configuration: data, model, deployment engine, sampling and trainer settings."""

from __future__ import annotations

import gc
from functools import lru_cache
from pathlib import Path
from typing import Literal, get_args, get_type_hints

from dagster import ConfigurableResource, InitResourceContext
from pydantic import ValidationInfo, field_validator, model_validator
from transformers import PreTrainedTokenizerBase

from prodrl_pipeline.chat.render import load_tokenizer
from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.rows import check_recording
from prodrl_pipeline.engine.sampler import TorchEngine
from prodrl_pipeline.envs.chess_env import Mode
from prodrl_pipeline.envs.lab_data import TOKENIZER_DIRS, iter_lab_puzzles
from prodrl_pipeline.envs.puzzles import Puzzle
from prodrl_pipeline.evals.canary import CanaryConfig
from prodrl_pipeline.evals.gate import check_gate_settings
from prodrl_pipeline.model import TinyQwen3Config, pad_id
from prodrl_pipeline.quant.nvfp4 import QUANT_FORMATS, QuantFormat, load_deployment
from prodrl_pipeline.rl.estimators import EstimatorConfig
from prodrl_pipeline.rl.trainer import TrainerConfig
from prodrl_pipeline.rl.warmstart import WarmStartConfig
from resources.config import config_class


@lru_cache(maxsize=4)
def _tokenizer(path: str) -> PreTrainedTokenizerBase:
    return load_tokenizer(path)


@lru_cache(maxsize=4)
def _puzzles(data_dir: str, split: str) -> tuple[Puzzle, ...]:
    return tuple(iter_lab_puzzles(data_dir, split))


EstimatorSettings = config_class(EstimatorConfig, "EstimatorSettings", __name__)
CanarySettings = config_class(CanaryConfig, "CanarySettings", __name__)

SCHEDULES: tuple[str, ...] = get_args(get_type_hints(WarmStartConfig)["schedule"])
"""The warm start's learning-rate schedules."""
MODE_DEFAULTS: dict[str, dict[str, object]] = {
    "structured": {
        "constrain_moves": True,
        "max_tokens": 64,
        "warm_start_steps": 40,
        "warm_start_puzzles": 250,
        "warm_start_batch": 64,
        "warm_start_lr": 2e-3,
        "warm_start_schedule": "constant",
        "warm_start_copy_steps": 0,
        "quant_format": "nvfp4",
        "lr": 5e-4,
    },
    "free_text": {
        "constrain_moves": False,
        "max_tokens": 128,
        "warm_start_steps": 400,
        "warm_start_puzzles": 500,
        "warm_start_batch": 32,
        "warm_start_lr": 3e-3,
        "warm_start_schedule": "cosine",
        "warm_start_copy_steps": 300,
        "quant_format": "nvfp4_w4a4",
        "lr": 1e-4,
    },
}
"""The settings each mode defaults differently: a setting left unset (None) takes its mode's value.
A free-text turn is unconstrained and runs to ~100 tokens with 20 checks to list, and its warm start
learns ~52 tokens a turn instead of one choice: twice the updates of half the turns, decayed to 0,
for the compute of 200 steps of 64, after 300 steps of induction pre-training (~30 s) without which
the model does not copy the move its reasoning names into its call (docs/lab.md's sweeps); its
deployments are served W4A4, as Blackwell serves NVFP4; and RL steps at a fifth of the structured
mode's rate (ten rounds from one base served W4A16, one run each: +3.5 points held-out at 1e-4,
-4.7 at 5e-4; docs/lab.md). Unset is None, not absent, because Dagster rebuilds a resource in its
run from a config that holds every field: a mode default applied only to absent fields was lost
there for the fields it always passes (the Literal ones) and replaced an explicit setting equal to
the structured value. Dagster's launchpad shows these settings as null: the mode's value."""


class LabResource(ConfigurableResource):
    """Everything a lab round needs besides storage. Defaults are the embedded CPU lab."""

    source: Literal["lab", "production"] = "lab"
    """Where a round's trajectories come from: the chess lab, or the capture gateway's landing tables.
    Production starts from `base_checkpoint` and uses nothing of the lab: no warm start and no
    held-out evaluation; its deploy gate is a canary on live traffic (`canary`)."""
    experiment: str = "main"
    """Name of the run; checkpoints and deployments are versioned under it."""
    schedule: Literal["sync", "async1"] = "sync"
    """sync: round k collects from round k-1's deployment and trains from its checkpoint. async1
    (one-round asynchronous): round k collects from round k-2's deployment (what was live while
    round k-1 trained) and trains on from round k-1's checkpoint."""
    counterfactual: bool = False
    """A counterfactual replay: train `experiment` on the stored traffic of earlier rounds (e.g. with
    another estimator), following its own checkpoint chain, never collecting and never moving live."""
    compare_to: str = "main"
    """The experiment a counterfactual replay is compared with, side by side, in eval_report."""
    mode: Mode = "structured"
    """How the model answers a turn (envs/chess_env.py, docs/lab.md): `structured`, one sampled
    token a call (the move, constrained to the legal moves, the rest forced); or `free_text`, a
    sampled reasoning segment and call (several-token moves, no constraint), with its own tokenizer
    and template. The settings left unset (None) take its values in `MODE_DEFAULTS`."""
    data_dir: str = "data"
    """Shipped puzzles (Lichess CSV) and each mode's tokenizer."""
    base_checkpoint: str = ""
    """An HF checkpoint directory (weights and tokenizer) to start from instead of building the tiny
    model; required with source production."""
    hidden_size: int = 128
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    model_seed: int = 0
    warm_start_steps: int | None = None
    """Supervised warm start of the lab's base model on solved transcripts of the `warmup` puzzles
    (0 keeps the random initialisation). Ignored with `base_checkpoint`."""
    warm_start_puzzles: int | None = None
    """Demonstrations for the warm start: the first N warmup puzzles (0 = all 4,974). A small set
    learned to a peak leaves the base decent and peaked, with room for RL on traffic (250: 15.6%
    held-out, and three rounds gain ~6 points; 500: 20.8%, ~3 points; docs/lab.md)."""
    warm_start_lr: float | None = None
    warm_start_batch: int | None = None
    """Player turns per warm-start step."""
    warm_start_schedule: str | None = None
    """The warm start's learning rate over its steps: constant, or a cosine decay to 0."""
    warm_start_copy_steps: int | None = None
    """Induction pre-training steps before the warm start (random sequences written twice, ~0.1 s
    a step): the free-text model then copies the move its reasoning names into its call."""
    quant_format: str | None = None
    """How deployments are exported and served: NVFP4 weights with fp32 activations (`nvfp4`, Hopper's
    W4A16), NVFP4 weights and activations (`nvfp4_w4a4`, Blackwell's W4A4, emulated: quant/w4a4.py;
    the free-text mode's default) or full precision (`none`). Recorded in each deployment's registry
    row, which the engine reads."""
    qat: bool = False
    """NVFP4 quantization-aware training: the trainer's forward uses the weights the deployment will
    serve (straight-through gradient), so pi_k matches mu up to kernel differences."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = None
    top_logprobs: int = 20
    """K: head of mu recorded per position."""
    constrain_moves: bool | None = None
    """Structured outputs: the move argument is limited to the listed legal moves (free_text mode:
    a required `move` call once the reasoning has ended; off by default there)."""
    partial_credit: bool = False
    """Reward the fraction of player moves found instead of 0/1."""
    eval_puzzles: int = 0
    """Held-out puzzles evaluated per round: the first N (0 = all)."""
    eval_full_every: int = 0
    """With eval_puzzles: every k-th round (and the base, round 0) evaluates all held-out puzzles
    (0 = never). Curves use the puzzles every round was evaluated on; a full round's gain over the
    base is measured on all of them."""
    gate_margin: float = 0.02
    """Deploy gate: a candidate may trail the live deployment's held-out solve rate by this much."""
    gate_confidence: float = 0.95
    """Deploy gate: confidence of the one-sided paired test that the drop exceeds the margin."""
    canary: CanarySettings = CanarySettings()
    """Production's deploy gate: the candidate's canary on live traffic (evals/canary.py)."""
    mismatch_warn: float = 0.1
    """Mismatch monitor: warn when a round's mean |log pi_k - log mu| exceeds this (nats); fail when it
    also rose over the last 3 rounds (the early warning of collapse the recipe describes)."""
    staleness_warn: float = 0.5
    """Mismatch monitor: warn when a round's mean |log pi - log pi_k| exceeds this (nats)."""
    steps: int = 16
    """S: optimizer steps per round."""
    batch_size: int = 64
    """B: trajectories per step; a round collects S*B."""
    lr: float | None = None
    warmup_steps: int = 16
    """Linear learning-rate warm-up over the run's first optimizer steps (0: none)."""
    grad_clip: float = 1.0
    # Dagster rebuilds a nested config default from its class, not from this instance: the default
    # estimator (the recipe's score centering) is therefore the library's own default.
    estimator: EstimatorSettings = EstimatorSettings()
    """Default estimator; a run can override it (config of the `checkpoint` asset)."""
    extra_samples: int = 0
    """M: extra tokens the engine samples per position (score centering's samples form)."""
    tokens: Literal["recorded", "retokenized"] = "recorded"
    """Train on the served token ids (recorded) or, to measure the naive pipeline, on ids rebuilt
    from each call's conversation (retokenized, rl/retokenize.py)."""
    microbatch_calls: int = 16
    trainer_processes: int = 0
    """0: train in the `checkpoint` step's own process (the embedded default). N >= 1: launch
    `torchrun --nproc-per-node N` through Dagster Pipes, data-parallel with FSDP2
    (rl/distributed.py; recorded tokens, no QAT, any estimator but ref_is). With CUDA each
    process trains on its own GPU."""
    trainer_image: str = ""
    """With `trainer_processes` N: run the torchrun processes in a Kubernetes pod of this image (the
    project installed, `python` on the PATH) with N GPUs, through PipesK8sClient (the `k8s` extra).
    Tables and artifacts must then be on object storage. Empty: local processes."""
    trainer_namespace: str = ""
    """The trainer pod's namespace (empty: the current one, else "default")."""
    trainer_secret: str = ""
    """A Kubernetes Secret whose keys become the trainer pod's environment (e.g. AWS_ACCESS_KEY_ID,
    AWS_SECRET_ACCESS_KEY): secret storage options are never written into the pod spec."""
    resume_every: int = 4
    """Save a resumable state every this many optimizer steps of a round; a re-run continues
    from it, bit-identically (rl/resume.py). 0: never."""
    trainer_device: str = "cpu"
    """Where the in-process trainer runs: "cpu" or a torch device such as "cuda"."""
    vllm_url: str = ""
    """A vLLM server (engine/vllm_server.py: recording flags, VLLM_SERVER_DEV_MODE=1) that serves
    the live deployment: before a deployment goes live the `deployment` asset reloads it there in
    place, tags its output with the deployment id and checks golden prompts; the gateway runs with
    `--engine vllm --vllm-follow`. The server must read the export's local path. Empty: none."""
    vllm_model: str = "prodrl"
    """The model name that server serves (`--served-model-name`)."""
    seed: int = 0
    """Seed of puzzle sampling, engine sampling and minibatch shuffles."""

    @model_validator(mode="before")
    @classmethod
    def _mode_defaults(cls, data: object) -> object:
        """Each setting its mode defaults (`MODE_DEFAULTS`) takes that default when unset (None)."""
        if isinstance(data, dict):
            defaults = MODE_DEFAULTS.get(data.get("mode") or "structured", {})
            return {**data, **{k: v for k, v in defaults.items() if data.get(k) is None}}
        return data

    @field_validator("warm_start_schedule", "quant_format")
    @classmethod
    def _one_of(cls, value: str, info: ValidationInfo) -> str:
        """The choices of these two (typed str for Dagster, which has no optional Literal config)."""
        choices = SCHEDULES if info.field_name == "warm_start_schedule" else QUANT_FORMATS
        if value is not None and value not in choices:  # None: an invalid mode, refused on its own
            raise ValueError(f"{info.field_name} must be one of {', '.join(choices)}, got {value!r}")
        return value

    def setup_for_execution(self, context: InitResourceContext) -> None:
        """A run's settings, whatever set them (the settings file, the launchpad's run config, the
        CLI), are checked before its first step. Then, once per process (a run's: its steps run in
        process), what is alive after a full collection (mostly the imports of torch, transformers
        and Dagster: ~0.5M objects) is moved out of the cyclic garbage collector's reach: every
        later full collection would walk it again (0.3 s each on 2 cores), and a round's Python
        work (episodes, constraints, records) triggers many. What the freeze holds is never
        collected: one snapshot per process, taken when it is smallest."""
        self.check()
        if not gc.get_freeze_count():
            gc.collect()
            gc.freeze()

    def check(self) -> None:
        """Build every configuration a round derives from these settings, so that settings that
        cannot be honoured are refused when they are read, not mid-round (ValueError, the reason)."""
        derived = {  # each configuration, and the settings it is built from
            "model": (self.tiny_model, "hidden_size num_layers num_heads num_kv_heads intermediate_size"),
            "warm start": (
                self.warm_start,
                "warm_start_steps warm_start_puzzles warm_start_batch warm_start_lr warm_start_schedule "
                "warm_start_copy_steps",
            ),
            "sampling": (self.sampling, "temperature top_p top_k max_tokens"),
            "trainer": (
                self.trainer,
                "steps batch_size lr warmup_steps grad_clip estimator microbatch_calls resume_every qat "
                "quant_format trainer_processes trainer_image tokens trainer_device",
            ),
            "recording": (
                lambda: check_recording(self.top_logprobs, self.extra_samples),
                "top_logprobs extra_samples",
            ),
            "deploy gate": (
                lambda: check_gate_settings(self.gate_margin, self.gate_confidence),
                "gate_margin gate_confidence",
            ),
            "canary": (self.canary_gate, "canary"),
        }
        for what, (build, settings) in derived.items():
            try:
                build()
            except ValueError as e:
                raise ValueError(f"the {what} settings ({', '.join(settings.split())}): {e}") from e
        if self.source == "production" and not self.base_checkpoint:
            raise ValueError(
                "source production starts from the deployment's own model: set base_checkpoint to its "
                "HF checkpoint directory (weights and tokenizer)"
            )
        for name in (
            "eval_puzzles",
            "eval_full_every",
            "trainer_processes",
            "mismatch_warn",
            "staleness_warn",
        ):
            if not getattr(self, name) >= 0:  # NaN fails too
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def heldout(self, round_: int) -> list[Puzzle]:
        """The held-out puzzles round `round_`'s deployment is evaluated on (`eval_puzzles`,
        `eval_full_every`)."""
        full = self.eval_puzzles == 0 or (self.eval_full_every > 0 and round_ % self.eval_full_every == 0)
        return list(self.puzzles("heldout"))[: None if full else self.eval_puzzles]

    def tiny_model(self) -> TinyQwen3Config:
        return TinyQwen3Config(
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            seed=self.model_seed,
        )

    def warm_start(self) -> WarmStartConfig:
        return WarmStartConfig(
            steps=self.warm_start_steps,
            puzzles=self.warm_start_puzzles,
            batch_size=self.warm_start_batch,
            lr=self.warm_start_lr,
            schedule=self.warm_start_schedule,
            copy_steps=self.warm_start_copy_steps,
            seed=self.model_seed,
        )

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, max_tokens=self.max_tokens
        )

    def trainer(self, estimator: EstimatorSettings | None = None) -> TrainerConfig:
        if self.qat and self.quant_format == "none":
            raise ValueError(f"qat trains for NVFP4 deployments; quant_format is {self.quant_format!r}")
        if self.trainer_image and self.trainer_processes < 1:
            raise ValueError("trainer_image runs torchrun in a pod: set trainer_processes (its GPUs) >= 1")
        return TrainerConfig(
            steps=self.steps,
            batch_size=self.batch_size,
            lr=self.lr,
            warmup_steps=self.warmup_steps,
            grad_clip=self.grad_clip,
            estimator=(estimator or self.estimator).resolve(),
            microbatch_calls=self.microbatch_calls,
            seed=self.seed,
            qat=self.qat,
            device=self.trainer_device,
            resume_every=self.resume_every,
            tokens=self.tokens,
        )

    def tokenizer_path(self) -> str:
        """The base checkpoint's tokenizer (production), else the lab's shipped one for the mode."""
        return str(Path(self.base_checkpoint or Path(self.data_dir) / TOKENIZER_DIRS[self.mode]))

    def tokenizer(self) -> PreTrainedTokenizerBase:
        return _tokenizer(self.tokenizer_path())

    def pad_id(self) -> int:
        """The tokenizer's pad id, else its end-of-sequence id (`prodrl_pipeline.model.pad_id`)."""
        return pad_id(self.tokenizer())

    def evaluated(self) -> bool:
        """Whether deployments are evaluated on the held-out puzzles and gated on them: in the lab
        only (production gates on a canary, `canary_gate`)."""
        return self.source == "lab"

    def canary_gate(self) -> CanaryConfig | None:
        """The production gate's settings when candidates go live through a canary (None: the lab,
        or the canary is off). A vLLM server swapped in place serves one deployment: refused."""
        cfg = self.canary.resolve()
        if self.source != "production" or cfg.type == "off":
            return None
        if self.vllm_url:
            raise ValueError(
                "a canary serves the candidate beside live; the vLLM server at vllm_url is swapped in "
                "place and serves one deployment: set canary.type off, or leave vllm_url empty"
            )
        return cfg

    def puzzles(self, split: Literal["train", "warmup", "heldout"]) -> tuple[Puzzle, ...]:
        return _puzzles(self.data_dir, split)

    def engine(self, deployment_path: str | Path, quant_format: QuantFormat) -> TorchEngine:
        """The embedded engine serving a deployment export as its registry row's `quant_format` says."""
        tok = self.tokenizer()
        return TorchEngine(
            load_deployment(deployment_path, quant_format),
            tok.eos_token_id,
            pad_id(tok),
            self.top_logprobs,
            self.extra_samples,
        )
