"""The free-text mode's base (docs/lab.md#the-free-text-mode): warm-start a variant and measure it.

Builds the lab's model (LabResource(mode="free_text") with the given overrides), warm-starts it on
the free-text demonstrations, exports its NVFP4 deployment as `base_model` does, and plays the first
`--heldout` held-out puzzles once greedily and once at temperature 1 (`max_tokens` as the lab's).
Reports per call the share that parses to a move call and the share that names a legal move, the
puzzles solved, and the teacher-forced negative log-likelihood of the demonstrated move's tokens
in the call (summed over its tokens; mean over `--nll-turns` held-out solution turns), with the
first token's part apart. `--reasoning` demonstrates an earlier format instead of the mode's
(`<think>Checks: ... Play <move></think>`): `checks_only`, the checks alone (the format before
the played move was named), or `chosen_first`, the checks with the played move first (both under
the mode's current system prompt and tokenizer, which were built for its format). `--save`
keeps the warm-started model. Options left out keep the
free-text mode's defaults. Run: `.venv/bin/python -m bench.free_text_base --puzzles 0` (the
warm start is nearly all of it: ~6 min on 2 idle cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from prodrl_pipeline.engine.processing import SamplingParams
from prodrl_pipeline.engine.sampler import TorchEngine
from prodrl_pipeline.envs.chat import parse_assistant_text
from prodrl_pipeline.envs.chess_env import (
    CHECKS,
    THINK_CLOSE,
    THINK_OPEN,
    checks_text,
    parse_move_call,
    tool_call_message,
)
from prodrl_pipeline.envs.lab_data import LEGAL_MOVES
from prodrl_pipeline.envs.rollout import play
from prodrl_pipeline.model import build_model, pad_id
from prodrl_pipeline.quant.nvfp4 import export_deployment, load_deployment
from prodrl_pipeline.rl import warmstart
from prodrl_pipeline.rl.warmstart import Turn, solved_turns, warm_start
from resources.lab import LabResource

OVERRIDES = {  # option: LabResource setting
    "steps": "warm_start_steps",
    "batch": "warm_start_batch",
    "lr": "warm_start_lr",
    "schedule": "warm_start_schedule",
    "puzzles": "warm_start_puzzles",
    "hidden": "hidden_size",
    "layers": "num_layers",
    "heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "intermediate": "intermediate_size",
    "copy_steps": "warm_start_copy_steps",
}


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for option in OVERRIDES:
        parser.add_argument(f"--{option.replace('_', '-')}", default=None)
    parser.add_argument("--heldout", type=int, default=200, help="held-out puzzles played")
    parser.add_argument("--nll-turns", type=int, default=100)
    parser.add_argument("--reasoning", choices=("default", "checks_only", "chosen_first"), default="default")
    parser.add_argument("--save", default="", help="save the warm-started model here")
    parser.add_argument("--name", default="")
    parser.add_argument("--json", default="", help="append the result as one JSON line to this file")
    return parser


def move_nll(model: torch.nn.Module, tokenizer, turns: list[Turn]) -> tuple[float, float]:
    """Mean over turns of the summed NLL of the call's move tokens, and of its first token alone."""
    close = tokenizer.convert_tokens_to_ids("</tool_call>")
    total, first = [], []
    with torch.no_grad():
        for t in turns:
            ids = t.prompt_ids + t.completion_ids
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
            text = tokenizer.decode(t.completion_ids, skip_special_tokens=False)
            move = parse_move_call(parse_assistant_text(tokenizer, text))
            canonical = tokenizer.encode(move, add_special_tokens=False)
            comp = t.completion_ids
            end = comp.index(close)
            at = max(i for i in range(end) if comp[i : i + len(canonical)] == canonical)
            nll = [-float(logp[len(t.prompt_ids) + at + k - 1, comp[at + k]]) for k in range(len(canonical))]
            total.append(sum(nll))
            first.append(nll[0])
    return statistics.mean(total), statistics.mean(first)


def call_stats(tokenizer, rollouts) -> dict[str, float]:
    parsed = legal = 0
    for call in rollouts.calls:
        text = tokenizer.decode(list(call["completion_token_ids"]), skip_special_tokens=False)
        move = parse_move_call(parse_assistant_text(tokenizer, text))
        messages = json.loads(call["messages_json"])
        board = next(m["content"] for m in reversed(messages) if m["role"] == "user")
        moves = next(line for line in board.splitlines() if line.startswith(LEGAL_MOVES)).split()[2:]
        parsed += move is not None
        legal += move in moves
    n = len(rollouts.calls)
    solved = [t["reward"] for t in rollouts.trajectories]
    return {
        "calls": n,
        "parse": 100 * parsed / n,
        "legal": 100 * legal / n,
        "solved": 100 * statistics.mean(solved),
    }


def _progress(row: dict) -> None:
    if row["step"] % 50 == 0:
        print(f"step {row['step']}: loss {row['loss']:.2f}, {time.strftime('%X')}", flush=True)


def chosen_first(moves: list[str], move: str, mode: str) -> dict:
    """The checks with the played move first (when it is one), then the others in list order."""
    return _checks_reasoning([move] + [m for m in moves if m != move], move)


def checks_only(moves: list[str], move: str, mode: str) -> dict:
    """The format before the played move was named: the checks alone, in list order."""
    return _checks_reasoning(moves, move)


def _checks_reasoning(moves: list[str], move: str) -> dict:
    """The call playing `move` after a reasoning of the checks among `moves` alone."""
    message = tool_call_message(move)
    message["content"] = f"{THINK_OPEN}{CHECKS}{checks_text(moves)}{THINK_CLOSE}"
    return message


def measure(args: argparse.Namespace) -> dict:
    if args.reasoning != "default":
        warmstart.answer_message = {"chosen_first": chosen_first, "checks_only": checks_only}[args.reasoning]
    settings = {OVERRIDES[k]: v for k, v in vars(args).items() if k in OVERRIDES and v is not None}
    lab = LabResource(mode="free_text", **settings)
    tok = lab.tokenizer()
    cfg = lab.warm_start()
    turns = solved_turns(tok, cfg.demonstrations(lab.puzzles("warmup")), "free_text")
    model = build_model(lab.tiny_model(), len(tok), tok.pad_token_id)
    t0 = time.perf_counter()
    rows = warm_start(model, turns, cfg, tok.pad_token_id, _progress)
    seconds = time.perf_counter() - t0
    if args.save:
        model.save_pretrained(args.save)
    heldout = list(lab.puzzles("heldout"))[: args.heldout]
    nll, nll_first = move_nll(model, tok, solved_turns(tok, heldout, "free_text")[: args.nll_turns])
    result = {
        "name": args.name,
        "settings": settings,
        "reasoning": args.reasoning,
        "turns": len(turns),
        "warm_start_s": round(seconds, 1),
        "final_loss": rows[-1]["loss"] if rows else None,
        "tf_move_nll": round(nll, 2),
        "tf_move_nll_first": round(nll_first, 2),
    }
    with tempfile.TemporaryDirectory() as folder:
        export_deployment(model, folder, lab.quant_format)
        engine = TorchEngine(load_deployment(folder, lab.quant_format), tok.eos_token_id, pad_id(tok), 1)
        for label, temperature in (("greedy", 0.0), ("t1", 1.0)):
            params = SamplingParams(temperature=temperature, max_tokens=lab.max_tokens)
            t0 = time.perf_counter()
            rollouts = play(
                engine,
                tok,
                heldout,
                params,
                deployment_id="b",
                round_=0,
                seed=0,
                mode="free_text",
                constrain=False,
            )
            stats = call_stats(tok, rollouts)
            stats["s"] = round(time.perf_counter() - t0, 1)
            result[label] = {k: round(v, 1) for k, v in stats.items()}
    return result


def main() -> None:
    args = arguments().parse_args()
    torch.set_num_threads(2)
    result = measure(args)
    print(json.dumps(result), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
