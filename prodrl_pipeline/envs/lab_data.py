"""The lab's shipped data: generated puzzles and the tokenizer trained on the environment's text.

Regenerate with `python -m prodrl_pipeline.envs.lab_data data/` (about 8 minutes on 2 cores, see
docs/puzzles.md); the result is deterministic for a given seed and committed, so nothing is
generated at run time. Splits: `train` (RL), `warmup` (supervised warm start) and `heldout`
(evaluation); each mode's tokenizer (`TOKENIZER_DIRS`) is trained on train + warmup only.
`--tokenizers-only` rebuilds the tokenizers from the shipped puzzles (about 15 s).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Iterable, Iterator
from functools import partial
from pathlib import Path

import chess
from transformers import PreTrainedTokenizerBase

from prodrl_pipeline.envs.chat import train_free_text_tokenizer, train_tokenizer
from prodrl_pipeline.envs.chess_env import ChessEpisode, Mode, answer_message, legal_move_texts, move_text
from prodrl_pipeline.envs.puzzle_gen import balance_kinds, generate, spawned_map
from prodrl_pipeline.envs.puzzles import Puzzle, puzzle_stats, read_puzzles, write_puzzles

TRAIN_CSV, WARMUP_CSV, HELDOUT_CSV = "puzzles/train.csv", "puzzles/warmup.csv", "puzzles/heldout.csv"
TOKENIZER_DIRS: dict[Mode, str] = {"structured": "tokenizer", "free_text": "tokenizer_free_text"}
SPLIT_CSV = {"train": TRAIN_CSV, "warmup": WARMUP_CSV, "heldout": HELDOUT_CSV}
TOKENIZER_SPLITS = ("train", "warmup")
LEGAL_MOVES = "Legal moves: "  # how `render_board` introduces the list


def solved_transcript(puzzle: Puzzle, mode: Mode = "structured") -> tuple[list[dict], set[str]]:
    """The conversation of a solved episode in `mode` and every move string shown in it."""
    episode = ChessEpisode(puzzle, mode=mode)
    while not episode.done:
        move = move_text(episode.board, chess.Move.from_uci(episode.puzzle.moves[episode.ply]))
        episode.step(answer_message(episode.allowed_moves(), move, mode))
    moves: set[str] = set()
    for message in episode.messages:
        for line in (message.get("content") or "").splitlines():
            if line.startswith(LEGAL_MOVES):
                moves.update(line.removeprefix(LEGAL_MOVES).split())
    return episode.messages, moves


def _corpus(puzzles: list[Puzzle], mode: Mode, processes: int = 2) -> tuple[list[str], set[str]]:
    """The texts of every solved transcript in `mode` and the move strings they show (in puzzle order)."""
    transcripts = spawned_map(partial(solved_transcript, mode=mode), puzzles, processes, chunksize=64)
    texts, moves = [], set()
    for messages, shown in transcripts:
        moves |= shown
        texts.extend(f"{m['role']}\n{m.get('content') or ''}" for m in messages)
        texts.extend(
            f'<tool_call>{{"name": "move", "arguments": {tc["function"]["arguments"]}}}</tool_call>'
            for m in messages
            for tc in m.get("tool_calls", [])
        )
    return texts, moves


def enumerated_move_strings() -> set[str]:
    """Every SAN move string without disambiguation, as the environment shows it ('#' as '+'):
    piece moves and captures to any square (Nf3, Nxf3), pawn pushes and captures (e4, exd5),
    promotions (e8=Q, exd8=N), castling; each with and without a trailing '+'."""
    files = "abcdefgh"
    squares = [f + r for f in files for r in "12345678"]
    plain = [f"{p}{x}{sq}" for p in "NBRQK" for x in ("", "x") for sq in squares]
    for i, f in enumerate(files):
        captures_from = [files[j] for j in (i - 1, i + 1) if 0 <= j < 8]
        for rank in "12345678":
            suffixes = [f"={p}" for p in "QRBN"] if rank in "18" else [""]
            plain += [f"{f}{rank}{s}" for s in suffixes]
            plain += [f"{c}x{f}{rank}{s}" for c in captures_from for s in suffixes]
    plain += ["O-O", "O-O-O"]
    return {m + check for m in plain for check in ("", "+")}


def _player_boards(puzzle: Puzzle) -> Iterator[chess.Board]:
    """The positions the player faces in a solved episode."""
    board = puzzle.start_board()
    for i in range(1, len(puzzle.moves), 2):
        yield board.copy(stack=False)
        board.push_uci(puzzle.moves[i])
        if i + 1 < len(puzzle.moves):
            board.push_uci(puzzle.moves[i + 1])


def single_token_share(tokenizer: PreTrainedTokenizerBase, puzzles: Iterable[Puzzle]) -> float:
    """The share of the legal-move strings shown in `puzzles` (each occurrence counted) that the
    tokenizer encodes as one token when written as the `move` tool argument."""
    single: dict[str, bool] = {}
    ones = total = 0
    for puzzle in puzzles:
        for board in _player_boards(puzzle):
            for move in legal_move_texts(board):
                if move not in single:
                    ids = tokenizer.encode(json.dumps({"move": move}), add_special_tokens=False)
                    single[move] = move in tokenizer.convert_ids_to_tokens(ids)
                ones += single[move]
                total += 1
    return ones / total if total else 0.0


def base_inputs_digest(data_dir: str | Path, mode: Mode = "structured") -> str:
    """sha256 over the files the lab's base model is built from: the mode's tokenizer and the warmup split."""
    digest = hashlib.sha256()
    for name in (f"{TOKENIZER_DIRS[mode]}/tokenizer.json", "puzzles/warmup.csv"):
        digest.update((Path(data_dir) / name).read_bytes())
    return digest.hexdigest()


def iter_lab_puzzles(data_dir: str | Path, split: str) -> Iterator[Puzzle]:
    """The shipped puzzles of `split` (train, warmup or heldout); raises ValueError otherwise."""
    if split not in SPLIT_CSV:
        raise ValueError(f"unknown split {split!r}: expected one of {sorted(SPLIT_CSV)}")
    yield from read_puzzles(Path(data_dir) / SPLIT_CSV[split])


def _format_stats(stats: dict[str, float]) -> str:
    return (
        f"{stats['count']} puzzles, mate-in-1 {stats['mate_in_1']} ({stats['mate_in_1_share']:.1%}), "
        f"mate-in-2 {stats['mate_in_2']} ({stats['mate_in_2_share']:.1%}); start move q1/median/q3 "
        f"{stats['start_move_q1']:g}/{stats['start_move_median']:g}/{stats['start_move_q3']:g}; "
        f"quiet mate-in-2 {stats['quiet_mate_in_2_share']:.1%}; promoted pieces {stats['promoted_share']:.1%}"
    )


def build(data_dir: Path, n_games: int, seed: int, vocab_size: int, processes: int = 2) -> None:
    """Generate the three splits (each balanced to as many mate-in-1 as mate-in-2 puzzles) and the
    tokenizer into `data_dir`, printing what was found and kept."""
    (data_dir / "puzzles").mkdir(parents=True, exist_ok=True)
    found = generate(n_games, seed=seed, balance=False, processes=processes)
    for split, puzzles in found.items():
        kept = balance_kinds(puzzles)
        stats = puzzle_stats(puzzles)
        print(f"{split}: found {stats['mate_in_1']} mate-in-1 and {stats['mate_in_2']} mate-in-2 puzzles")
        write_puzzles(kept, data_dir / SPLIT_CSV[split])
        print(f"{split}: {_format_stats(puzzle_stats(kept))}")
    for mode in TOKENIZER_DIRS:
        build_tokenizer(data_dir, vocab_size, processes, mode)


def build_tokenizer(data_dir: Path, vocab_size: int, processes: int = 2, mode: Mode = "structured") -> None:
    """Train `mode`'s tokenizer on the train and warmup transcripts only. Structured: its move
    tokens are every enumerated SAN string plus the (disambiguated) ones those transcripts show;
    free_text: no move tokens (chat.py)."""
    puzzles = [p for split in TOKENIZER_SPLITS for p in iter_lab_puzzles(data_dir, split)]
    texts, shown = _corpus(puzzles, mode, processes)
    if mode == "free_text":
        tokenizer = train_free_text_tokenizer(texts, vocab_size)
        print(f"{mode} tokenizer: {len(tokenizer)} tokens")
    else:
        moves = enumerated_move_strings() | shown
        tokenizer = train_tokenizer(texts, moves, vocab_size)
        print(f"{mode} tokenizer: {len(tokenizer)} tokens, {len(moves)} of them moves")
    tokenizer.save_pretrained(data_dir / TOKENIZER_DIRS[mode])
    share = single_token_share(tokenizer, iter_lab_puzzles(data_dir, "heldout"))
    print(f"{mode}: held-out legal-move strings that are one token: {share:.2%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("--games", type=int, default=8400)
    parser.add_argument("--seed", type=int, default=2027)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument(
        "--tokenizers-only", action="store_true", help="rebuild the tokenizers from the shipped puzzles"
    )
    args = parser.parse_args()
    if args.tokenizers_only:
        for mode in TOKENIZER_DIRS:
            build_tokenizer(args.data_dir, args.vocab_size, args.processes, mode)
    else:
        build(args.data_dir, args.games, args.seed, args.vocab_size, args.processes)


if __name__ == "__main__":
    main()
