"""The lab's shipped data: generated puzzles and the tokenizer trained on the environment's text.

Regenerate with `python -m prodrl_pipeline.envs.lab_data data/` (about 2 minutes on 2 cores);
the result is deterministic for a given seed and committed, so nothing is generated at run time.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import chess

from prodrl_pipeline.envs.chat import train_tokenizer
from prodrl_pipeline.envs.chess_env import ChessEpisode, legal_move_texts, move_text, tool_call_message
from prodrl_pipeline.envs.puzzles import Puzzle, generate, read_puzzles, write_puzzles

TRAIN_CSV, HELDOUT_CSV, TOKENIZER_DIR = "puzzles/train.csv", "puzzles/heldout.csv", "tokenizer"


def solved_transcript(puzzle: Puzzle) -> tuple[list[dict], set[str]]:
    """The conversation of a solved episode and every move string shown in it."""
    episode = ChessEpisode(puzzle)
    moves: set[str] = set()
    while not episode.done:
        moves.update(legal_move_texts(episode.board))
        uci = episode.puzzle.moves[episode.ply]
        episode.step(tool_call_message(move_text(episode.board, chess.Move.from_uci(uci))))
    return episode.messages, moves


def _corpus(puzzles: list[Puzzle]) -> tuple[list[str], set[str]]:
    texts, moves = [], set()
    for p in puzzles:
        messages, shown = solved_transcript(p)
        moves |= shown
        texts.extend(f"{m['role']}\n{m.get('content') or ''}" for m in messages)
        texts.extend(
            f'<tool_call>{{"name": "move", "arguments": {tc["function"]["arguments"]}}}</tool_call>'
            for m in messages
            for tc in m.get("tool_calls", [])
        )
    return texts, moves


def iter_lab_puzzles(data_dir: str | Path, split: str) -> Iterator[Puzzle]:
    yield from read_puzzles(Path(data_dir) / (TRAIN_CSV if split == "train" else HELDOUT_CSV))


def build(data_dir: Path, n_games: int, seed: int, vocab_size: int) -> None:
    (data_dir / "puzzles").mkdir(parents=True, exist_ok=True)
    train, heldout = generate(n_games, seed=seed)
    write_puzzles(train, data_dir / TRAIN_CSV)
    write_puzzles(heldout, data_dir / HELDOUT_CSV)
    print(f"{len(train)} train / {len(heldout)} held-out puzzles")
    build_tokenizer(data_dir, vocab_size)


def build_tokenizer(data_dir: Path, vocab_size: int) -> None:
    puzzles = [*iter_lab_puzzles(data_dir, "train"), *iter_lab_puzzles(data_dir, "heldout")]
    texts, moves = _corpus(puzzles)
    tokenizer = train_tokenizer(texts, moves, vocab_size)
    tokenizer.save_pretrained(data_dir / TOKENIZER_DIR)
    print(f"tokenizer: {len(tokenizer)} tokens, {len(moves)} of them moves")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("--games", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--vocab-size", type=int, default=1024)
    args = parser.parse_args()
    build(args.data_dir, args.games, args.seed, args.vocab_size)


if __name__ == "__main__":
    main()
