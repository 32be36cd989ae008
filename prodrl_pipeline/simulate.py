"""Simulated production traffic: lab puzzles played as users would, through the real `openai`
client against a capture gateway, with rewards posted late and out of order.

Each of `users` concurrent users takes the next puzzle, asks for the `move` tool at every turn
(`tool_choice` naming it, its enum the legal moves: the gateway's structured output, as the lab
plays) and sends its trajectory id in `X-Prodrl-Trajectory-Id`. An episode's reward (1 solved,
else 0) is due `reward_delay` to twice that seconds after it ends; once as many rewards are due as
there are users (or play is over) they are posted newest first, so rewards trail the traffic and
arrive out of the order episodes finished. Bounded by `episodes` and `max_seconds`; loopback
gateways only (a simulator must not load someone else's server).

    PRODRL_API_KEYS=... PRODRL_FEEDBACK_KEYS=... python -m prodrl_pipeline.simulate \
        --url http://127.0.0.1:8000 --users 8 --episodes 64
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import random
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx
import openai

from prodrl_pipeline.envs.chess_env import MOVE_TOOL, ChessEpisode
from prodrl_pipeline.envs.lab_data import iter_lab_puzzles
from prodrl_pipeline.envs.puzzles import Puzzle

TRAJECTORY_HEADER = "X-Prodrl-Trajectory-Id"


@dataclass(frozen=True)
class SimulationConfig:
    users: int = 8
    """Concurrent users, each playing one episode at a time."""
    episodes: int = 64
    """Episodes in all; the puzzles given are played in order and again from the first when
    there are fewer (users repeat tasks: each episode is a new trajectory)."""
    max_seconds: float = 600.0
    """Play stops after this (episodes still running are abandoned, unrewarded); then the rewards
    of the finished ones are posted."""
    reward_delay: float = 0.5
    """Seconds between an episode's end and its reward being due (plus a random extra of up to
    the same again)."""
    think_seconds: float = 0.0
    """A user pauses up to this long (uniformly drawn) before each episode, as between tasks."""
    max_tokens: int = 64
    seed: int = 0
    model: str = "live"
    prefix: str = "sim"
    """Trajectory ids are `{prefix}-{run}-{episode}`, `run` drawn fresh for each run."""

    def __post_init__(self) -> None:
        if self.users < 1 or self.episodes < 1 or self.max_seconds <= 0:
            raise ValueError("need users >= 1, episodes >= 1 and max_seconds > 0")
        if self.reward_delay < 0 or self.think_seconds < 0:
            raise ValueError("reward_delay and think_seconds are seconds >= 0")


@dataclass
class SimulationReport:
    episodes: int = 0
    solved: int = 0
    calls: int = 0
    rewards_posted: int = 0
    errors: list[str] = field(default_factory=list)
    abandoned: list[str] = field(default_factory=list)  # trajectory ids of episodes that failed
    finished: list[str] = field(default_factory=list)  # trajectory ids, in the order episodes ended
    rewarded: list[str] = field(default_factory=list)  # trajectory ids, in the order rewards went
    rewards: dict[str, float] = field(default_factory=dict)


def check_loopback(url: str) -> None:
    """ValueError unless `url` names this machine (localhost, 127.0.0.0/8, ::1)."""
    parsed = urlparse(url)
    if parsed.username is not None or parsed.password is not None:
        raise ValueError("the simulator's URL must not carry user info")
    host = (parsed.hostname or "").rstrip(".")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"the simulator only plays against a loopback gateway, not {host!r}")


def _move_tool(episode: ChessEpisode) -> dict:
    """The lab's `move` tool with this turn's legal moves as its enum."""
    params = {**MOVE_TOOL["function"]["parameters"]}
    params["properties"] = {"move": {"type": "string", "enum": episode.allowed_moves()}}
    return {**MOVE_TOOL, "function": {**MOVE_TOOL["function"], "parameters": params}}


async def simulate(
    url: str,
    serve_key: str,
    feedback_key: str,
    puzzles: Sequence[Puzzle],
    cfg: SimulationConfig,
    progress: Callable[[SimulationReport], None] | None = None,
    stop: Callable[[], bool] | None = None,
) -> SimulationReport:
    """Play `cfg.episodes` of `puzzles` against the gateway at `url` (its base, without /v1);
    `progress` sees the report after each episode; once `stop()` is true no episode starts. Calls
    are not retried (a retried call would be recorded twice); a failed episode is reported and
    left unrewarded, as a user who gives up."""
    check_loopback(url)
    url = url.rstrip("/").removesuffix("/v1")
    run = uuid.uuid4().hex[:8]  # trajectory ids never collide with an earlier run's
    report, rng = SimulationReport(), random.Random(cfg.seed)
    if not puzzles:
        raise ValueError("no puzzles to play")
    started = 0  # episodes started
    pending: list[tuple[int, float, str, float]] = []  # (finish order, due, trajectory id, reward)
    client = openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key=serve_key, max_retries=0, timeout=min(cfg.max_seconds, 120.0)
    )

    async def play(tid: str, puzzle: Puzzle) -> None:
        episode = ChessEpisode(puzzle)
        while not episode.done:
            reply = await client.chat.completions.create(
                model=cfg.model,
                messages=episode.messages,
                tools=[_move_tool(episode)],
                tool_choice={"type": "function", "function": {"name": "move"}},
                max_tokens=cfg.max_tokens,
                extra_headers={TRAJECTORY_HEADER: tid},
            )
            report.calls += 1
            message = reply.choices[0].message
            episode.step(
                {
                    **message.model_dump(include={"role", "tool_calls"}, exclude_none=True),
                    "content": message.content or "",
                },
                cut_off=reply.choices[0].finish_reason == "length",
            )
            if message.tool_calls and episode.messages[-1]["role"] == "tool":  # answer the call made
                episode.messages[-1]["tool_call_id"] = message.tool_calls[0].id
        report.episodes += 1
        report.solved += episode.reward == 1.0
        report.finished.append(tid)
        report.rewards[tid] = episode.reward
        due = time.monotonic() + cfg.reward_delay * (1 + rng.random())
        pending.append((len(report.finished), due, tid, episode.reward))
        if progress:
            progress(report)

    async def user() -> None:
        nonlocal started
        stopped = lambda: started >= cfg.episodes or (stop is not None and stop())  # noqa: E731
        while not stopped():
            await asyncio.sleep(cfg.think_seconds * rng.random())  # a user between tasks
            if stopped():
                return
            i, started = started, started + 1
            puzzle = puzzles[i % len(puzzles)]
            tid = f"{cfg.prefix}-{run}-{i}"
            try:
                await play(tid, puzzle)
            except asyncio.CancelledError:  # max_seconds: the episode stays unrewarded
                report.abandoned.append(tid)
                raise
            except Exception as e:  # noqa: BLE001 - reported; the other users go on
                report.abandoned.append(tid)
                report.errors.append(f"{tid}: {type(e).__name__}: {str(e)[:200]}")

    async def post(http: httpx.AsyncClient, tid: str, reward: float) -> None:
        try:
            r = await http.post(
                f"{url}/v1/feedback",
                json={"trajectory_id": tid, "reward": reward},
                headers={"Authorization": f"Bearer {feedback_key}"},
            )
        except httpx.HTTPError as e:
            report.errors.append(f"reward for {tid}: {type(e).__name__}: {e}")
            return
        if r.status_code == 200:
            report.rewards_posted += 1
            report.rewarded.append(tid)
        else:
            report.errors.append(f"reward for {tid}: {r.status_code} {r.text[:200]}")

    async def poster(users_done: asyncio.Event) -> None:
        batch_size = max(2, cfg.users)  # at least two: a batch posted newest first is out of order
        async with httpx.AsyncClient(timeout=10) as http:
            while not (users_done.is_set() and not pending):
                due = [p for p in pending if p[1] <= time.monotonic()]
                batch = list(pending) if users_done.is_set() else due if len(due) >= batch_size else []
                if not batch:
                    await asyncio.sleep(0.05)  # the poster's polling period, not a synchronisation
                for item in sorted(batch, reverse=True):  # newest first
                    pending.remove(item)
                    await post(http, item[2], item[3])

    users_done = asyncio.Event()
    posting = asyncio.create_task(poster(users_done))
    try:
        await asyncio.wait_for(asyncio.gather(*(user() for _ in range(cfg.users))), cfg.max_seconds)
    except TimeoutError:
        report.errors.append(f"stopped after max_seconds = {cfg.max_seconds}")
    finally:
        users_done.set()
        await posting
        await client.close()
    return report


def _progress(report: SimulationReport) -> None:
    if report.episodes % 10 == 0:  # every 10th episode
        print(f"  {report.episodes} episodes, {report.solved} solved, {report.calls} calls", flush=True)


def main() -> int:
    """0 when every episode was played and every reward posted, else 1 (the errors are printed);
    bad arguments exit 2."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's base URL (loopback)")
    p.add_argument("--data", default="data", help="lab data folder (puzzles)")
    p.add_argument(
        "--split",
        default="train",
        choices=["train", "heldout"],
        help="puzzles played (train: what rounds may learn from; heldout is what the deploy gate measures)",
    )
    defaults = SimulationConfig()
    names = ("users", "episodes", "max_seconds", "reward_delay", "think_seconds", "max_tokens", "seed")
    for name in (*names, "model", "prefix"):
        value = getattr(defaults, name)
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = p.parse_args()
    serve_key = os.environ.get("PRODRL_API_KEYS", "").split(",")[0]
    feedback_key = os.environ.get("PRODRL_FEEDBACK_KEYS", "").split(",")[0]
    if not (serve_key and feedback_key):
        p.error("set PRODRL_API_KEYS and PRODRL_FEEDBACK_KEYS (the gateway's keys)")
    try:
        check_loopback(args.url)
        cfg = SimulationConfig(
            **{k: v for k, v in vars(args).items() if k in SimulationConfig.__dataclass_fields__}
        )
    except ValueError as e:
        p.error(str(e))
    if not os.path.isdir(args.data):
        p.error(f"no lab data folder {args.data!r} (run from the repository root, or pass --data)")
    puzzles = list(iter_lab_puzzles(args.data, args.split))
    random.Random(cfg.seed).shuffle(puzzles)
    if len(puzzles) < cfg.episodes:
        print(f"the {args.split} split holds {len(puzzles)} puzzles: they are played again in turn")
    t0 = time.monotonic()
    report = asyncio.run(simulate(args.url, serve_key, feedback_key, puzzles, cfg, progress=_progress))
    seconds = time.monotonic() - t0
    print(
        f"{report.episodes} episodes ({report.solved} solved), {report.calls} calls, "
        f"{report.rewards_posted} rewards posted, {len(report.errors)} errors in {seconds:.1f} s"
    )
    for error in report.errors[:10]:
        print("  ", error)
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
