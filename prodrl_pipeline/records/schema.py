"""Arrow schemas of every table (docs/tables.md). Token ids int32, log-probs float32: both
round-trip bit-exactly through Delta. Per-round tables are partitioned by `round` (int64)."""

from __future__ import annotations

import base64
from datetime import datetime

import numpy as np
import pyarrow as pa

TS = pa.timestamp("us", tz="UTC")
IDS = pa.list_(pa.int32())
LOGPROBS = pa.list_(pa.float32())

SAMPLING = pa.struct(
    [
        ("temperature", pa.float64()),
        ("top_p", pa.float64()),
        ("top_k", pa.int32()),
        ("max_tokens", pa.int32()),
        ("seed", pa.int64()),
        # OpenAI's logit_bias: added to the logits before everything else (empty: none)
        ("logit_bias", pa.list_(pa.struct([("token_id", pa.int32()), ("bias", pa.float32())]))),
    ]
)

# a grammar-constrained call's constraint, recorded once (records/grammar_masks.py recomputes its
# GRAMMAR supports from it): the llguidance grammar, the sha256 of llguidance's view of the tokenizer
# (vocabulary size, end id, each token's bytes and specialness), the end id, "llguidance <version>"
GRAMMAR = pa.struct(
    [
        ("grammar", pa.string()),
        ("tokenizer_sha256", pa.string()),
        ("eos_id", pa.int32()),
        ("library", pa.string()),
    ]
)

CALLS = pa.schema(
    [
        ("call_id", pa.string()),
        ("trajectory_id", pa.string()),
        ("call_index", pa.int32()),
        ("round", pa.int64()),
        ("deployment_id", pa.string()),
        # the canary that routed the call's trajectory (null outside one) and its arm there:
        # candidate or control (docs/gateway.md, "Canaries")
        ("canary_id", pa.string()),
        ("arm", pa.string()),
        ("prompt_token_ids", IDS),
        ("completion_token_ids", IDS),
        # log mu(a_t|h_t) of each sampled id under the processed (actually sampled) distribution
        ("completion_logprobs", LOGPROBS),
        # the top-K head of mu per position, sorted by log-prob (forced tokens: one entry, 0.0)
        ("topk_token_ids", pa.list_(IDS)),
        ("topk_logprobs", pa.list_(LOGPROBS)),
        # kept support per position (records/support.py): its size (vocab size when unrestricted),
        # its form (a small enum) and that form's payload, ids (kept, or not kept) or a bitmask over
        # the vocabulary; a null form: a call recorded before forms, its ids listed only when
        # larger than the head and smaller than the vocabulary
        ("support_size", IDS),
        ("support_form", pa.list_(pa.int8())),
        ("support_token_ids", pa.list_(IDS)),
        ("support_mask", pa.list_(pa.binary())),
        # M extra tokens per position sampled from the same mu (score centering's samples form)
        ("extra_token_ids", pa.list_(IDS)),
        ("vocab_size", pa.int32()),
        ("grammar", GRAMMAR),  # null: no grammar, every support recorded per position
        ("sampling", SAMPLING),
        ("finish_reason", pa.string()),
        ("messages_json", pa.string()),
        ("created_at", TS),
    ]
)

TRAJECTORIES = pa.schema(
    [
        ("trajectory_id", pa.string()),
        ("round", pa.int64()),
        ("deployment_id", pa.string()),
        ("task_id", pa.string()),
        ("reward", pa.float64()),  # null until feedback arrives
        ("n_calls", pa.int32()),
        ("n_completion_tokens", pa.int32()),
        ("started_at", TS),
        ("finished_at", TS),
        ("source", pa.string()),  # lab | production
    ]
)

ADVANTAGES = pa.schema(
    [
        ("trajectory_id", pa.string()),
        ("round", pa.int64()),
        ("minibatch", pa.int64()),
        ("reward", pa.float64()),
        ("baseline", pa.float64()),
        ("advantage", pa.float64()),
    ]
)

TRAIN_STEPS = pa.schema(
    [
        ("round", pa.int64()),
        ("step", pa.int64()),  # global optimizer step of the run
        ("experiment", pa.string()),
        ("estimator", pa.string()),
        ("n_trajectories", pa.int64()),
        ("n_tokens", pa.int64()),
        ("reward_mean", pa.float64()),
        ("loss", pa.float64()),
        ("lr", pa.float64()),  # the step's learning rate (after warm-up)
        ("grad_norm", pa.float64()),
        ("entropy", pa.float64()),
        ("engine_mismatch", pa.float64()),  # mean |log pi_k - log mu| over sampled tokens
        ("staleness", pa.float64()),  # mean |log pi - log pi_k|
        ("total_mismatch", pa.float64()),  # mean |log pi - log mu|
        ("clip_fraction", pa.float64()),
        ("rho_truncated_fraction", pa.float64()),
        ("kl", pa.float64()),
        ("dropped_trajectories", pa.int64()),
        # optimizer steps between the checkpoint that sampled the tokens and the policy trained now
        ("policy_lag_steps", pa.int64()),
        ("seconds", pa.float64()),
    ]
)

# pi_k (and the ref_is reference) per call, computed once per round before the first step
POLICY_LOGPROBS = pa.schema(
    [
        ("call_id", pa.string()),
        ("round", pa.int64()),
        ("experiment", pa.string()),
        ("round_start_logprobs", LOGPROBS),
        ("reference_logprobs", LOGPROBS),  # null unless the estimator needs it
    ]
)

CHECKPOINTS = pa.schema(
    [
        ("checkpoint_id", pa.string()),
        ("round", pa.int64()),
        ("experiment", pa.string()),
        ("parent_id", pa.string()),
        ("path", pa.string()),
        ("step", pa.int64()),
        ("created_at", TS),
    ]
)

DEPLOYMENTS = pa.schema(
    [
        ("deployment_id", pa.string()),
        ("round", pa.int64()),
        ("checkpoint_id", pa.string()),
        ("path", pa.string()),
        ("quant_format", pa.string()),
        ("sampling_json", pa.string()),
        ("live", pa.bool_()),
        ("created_at", TS),
    ]
)

# The production gate's canaries (records/canaries.py): one row per canary, its decision once made.
CANARIES = pa.schema(
    [
        ("canary_id", pa.string()),
        ("deployment_id", pa.string()),  # the candidate
        ("round", pa.int64()),
        ("control_id", pa.string()),  # the live deployment it is compared with
        ("share", pa.float64()),
        ("config_json", pa.string()),  # the gate's settings (evals/canary.py CanaryConfig)
        ("opened_at", TS),
        ("status", pa.string()),  # open | promoted | rolled_back
        ("decided_at", TS),
        ("decided_by", pa.string()),  # "rule", or the operator who overrode it
        ("reason", pa.string()),
        ("verdict_json", pa.string()),  # what the gate measured
    ]
)

EVAL_RESULTS = pa.schema(
    [
        ("round", pa.int64()),
        ("deployment_id", pa.string()),
        ("puzzle_id", pa.string()),
        ("themes", pa.string()),
        ("reward", pa.float64()),
        ("solved", pa.bool_()),
        ("n_calls", pa.int32()),
    ]
)

REJECTS = pa.schema(
    [
        ("table_name", pa.string()),
        ("round", pa.int64()),
        ("record_id", pa.string()),
        ("reason", pa.string()),
        ("record_json", pa.string()),
        ("rejected_at", TS),
    ]
)

# The gateway's append-only landing tables (production traffic): calls as served, and reward events.
LANDING_CALLS = pa.schema([f for f in CALLS if f.name != "round"])
LANDING_FEEDBACK = pa.schema(
    [
        ("feedback_id", pa.string()),
        ("trajectory_id", pa.string()),
        ("reward", pa.float64()),
        ("comment", pa.string()),
        ("overwrite", pa.bool_()),
        ("received_at", TS),
    ]
)

TABLES: dict[str, pa.Schema] = {
    "calls": CALLS,
    "trajectories": TRAJECTORIES,
    "advantages": ADVANTAGES,
    "train_steps": TRAIN_STEPS,
    "policy_logprobs": POLICY_LOGPROBS,
    "checkpoints": CHECKPOINTS,
    "deployments": DEPLOYMENTS,
    "canaries": CANARIES,
    "eval_results": EVAL_RESULTS,
    "rejects": REJECTS,
    "landing_calls": LANDING_CALLS,
    "landing_feedback": LANDING_FEEDBACK,
}


def json_value(value: object) -> object:
    """A record's value that JSON has no type for, as JSON writes it (`json.dumps(default=...)`):
    an array (the engine's per-position ids and log-probs, engine/rows.py) as a list, bytes (a
    support's bitmask) in base64 (`from_json` reads them back), a timestamp in ISO 8601; TypeError
    for anything else."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"cannot serialize {type(value).__name__}")


def from_json(table: str, row: dict) -> dict:
    """A row of `table` as `json_value` wrote it, with its JSON-less values restored: timestamps
    and bytes (in lists of bytes too)."""
    out = dict(row)
    for field in TABLES[table]:
        value = out.get(field.name)
        if pa.types.is_timestamp(field.type) and isinstance(value, str):
            out[field.name] = datetime.fromisoformat(value)
        elif pa.types.is_list(field.type) and pa.types.is_binary(field.type.value_type) and value:
            out[field.name] = [base64.b64decode(v) if isinstance(v, str) else v for v in value]
    return out
