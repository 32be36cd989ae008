"""Chess puzzles in the Lichess puzzle CSV format: load, save, and generate locally.

Lichess convention: `fen` is the position *before* the opponent's move; `moves[0]` (UCI) is that
opponent move; the player's moves are at odd indices and the opponent's replies at even indices
>= 2. On the player's last move any move that delivers checkmate is accepted (puzzle rules).
"""

from __future__ import annotations

import csv
import hashlib
import io
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from multiprocessing import Pool
from pathlib import Path

import chess

LICHESS_COLUMNS = [
    "PuzzleId",
    "FEN",
    "Moves",
    "Rating",
    "RatingDeviation",
    "Popularity",
    "NbPlays",
    "Themes",
    "GameUrl",
    "OpeningTags",
]


@dataclass(frozen=True)
class Puzzle:
    """One puzzle row; `moves` are UCI strings, `themes` space-separated as in Lichess."""

    puzzle_id: str
    fen: str
    moves: tuple[str, ...]
    rating: int = 1500
    rating_deviation: int = 75
    popularity: int = 0
    nb_plays: int = 0
    themes: str = ""
    game_url: str = ""
    opening_tags: str = ""
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def n_player_moves(self) -> int:
        return len(self.moves) // 2

    def start_board(self) -> chess.Board:
        """The position the player faces: `fen` with the opponent's setup move `moves[0]` played."""
        board = chess.Board(self.fen)
        board.push_uci(self.moves[0])
        return board


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".zst":
        import zstandard

        raw = zstandard.ZstdDecompressor().stream_reader(path.open("rb"))
        return io.TextIOWrapper(raw, encoding="utf-8", newline="")
    return path.open(encoding="utf-8", newline="")


def read_puzzles(path: str | Path, limit: int | None = None, themes: str | None = None) -> list[Puzzle]:
    """Read a Lichess puzzle CSV (`lichess_db_puzzle.csv` or `.csv.zst`), optionally keeping only
    rows whose Themes contain `themes` (e.g. "mateIn1"). Raises ValueError on a malformed header."""
    path = Path(path)
    out: list[Puzzle] = []
    with _open_text(path) as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in LICHESS_COLUMNS[:3] if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: not a Lichess puzzle CSV, missing columns {missing}")
        for row in reader:
            if themes and themes not in row.get("Themes", "").split():
                continue
            out.append(
                Puzzle(
                    puzzle_id=row["PuzzleId"],
                    fen=row["FEN"],
                    moves=tuple(row["Moves"].split()),
                    rating=int(row.get("Rating") or 1500),
                    rating_deviation=int(row.get("RatingDeviation") or 75),
                    popularity=int(row.get("Popularity") or 0),
                    nb_plays=int(row.get("NbPlays") or 0),
                    themes=row.get("Themes", ""),
                    game_url=row.get("GameUrl", ""),
                    opening_tags=row.get("OpeningTags", ""),
                )
            )
            if limit is not None and len(out) >= limit:
                break
    return out


def write_puzzles(puzzles: Iterable[Puzzle], path: str | Path) -> None:
    with Path(path).open("w", encoding="utf-8", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(LICHESS_COLUMNS)
        for p in puzzles:
            writer.writerow(
                [
                    p.puzzle_id,
                    p.fen,
                    " ".join(p.moves),
                    p.rating,
                    p.rating_deviation,
                    p.popularity,
                    p.nb_plays,
                    p.themes,
                    p.game_url,
                    p.opening_tags,
                ]
            )


# ---- generation -------------------------------------------------------------------------------


def _mates_in_one(board: chess.Board) -> list[chess.Move]:
    mates = []
    for move in board.legal_moves:
        if board.gives_check(move):
            board.push(move)
            if board.is_checkmate():
                mates.append(move)
            board.pop()
    return mates


def _forces_mate_in_two(board: chess.Board, first: chess.Move) -> bool:
    """After `first`, every opponent reply allows a mate in one (and some reply exists)."""
    board.push(first)
    try:
        replies = list(board.legal_moves)
        if not replies:
            return False
        for reply in replies:
            board.push(reply)
            mated = bool(_mates_in_one(board))
            board.pop()
            if not mated:
                return False
        return True
    finally:
        board.pop()


def _mate_in_two(board: chess.Board) -> tuple[chess.Move, chess.Move, chess.Move] | None:
    """A unique forcing mate in two: exactly one first move forces mate (searched among checks
    first, then confirmed unique over all moves). Returns (first, reply, mate) or None."""
    checks = sorted((m for m in board.legal_moves if board.gives_check(m)), key=lambda m: m.uci())
    winning = [m for m in checks if _forces_mate_in_two(board, m)]
    if len(winning) != 1:
        return None
    first = winning[0]
    for move in board.legal_moves:
        if move != first and not board.gives_check(move) and _forces_mate_in_two(board, move):
            return None
    board.push(first)
    # The opponent's reply: the one leaving the fewest mating answers (the toughest defence).
    replies = []
    for reply in sorted(board.legal_moves, key=lambda m: m.uci()):
        board.push(reply)
        mates = sorted(_mates_in_one(board), key=lambda m: m.uci())
        board.pop()
        replies.append((len(mates), reply, mates[0]))
    board.pop()
    _, reply, mate = min(replies, key=lambda r: r[0])
    return first, reply, mate


def _puzzle_id(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:8]


def _position_key(board: chess.Board) -> str:
    return " ".join(board.fen().split()[:4])


def _puzzles_from_game(game: int, seed: int, max_plies: int, mate_in_two: bool) -> list[Puzzle]:
    """Play one random game and emit a puzzle at every position where the side to move mates."""
    rng = random.Random(seed * 1_000_003 + game)
    board = chess.Board()
    out = []
    for _ in range(max_plies):
        moves = list(board.legal_moves)
        if not moves:
            break
        before = board.fen()
        setup = rng.choice(moves)
        board.push(setup)
        if board.is_game_over():
            break
        mates = sorted(_mates_in_one(board), key=lambda m: m.uci())
        if mates:
            line, themes, rating = [setup, mates[0]], "mate mateIn1 oneMove", 900
        elif mate_in_two and (found := _mate_in_two(board)):
            line, themes, rating = [setup, *found], "mate mateIn2 short", 1300
        else:
            continue
        uci = [m.uci() for m in line]
        out.append(
            Puzzle(
                puzzle_id=_puzzle_id(f"{before} {' '.join(uci)}"),
                fen=before,
                moves=tuple(uci),
                rating=rating,
                themes=themes,
                game_url=f"local://seed{seed}/game{game}",
                extra={"game": game, "key": _position_key(board)},
            )
        )
    return out


def _worker(args: tuple[list[int], int, int, bool]) -> list[Puzzle]:
    games, seed, max_plies, mate_in_two = args
    return [p for g in games for p in _puzzles_from_game(g, seed, max_plies, mate_in_two)]


def generate(
    n_games: int,
    seed: int = 0,
    heldout_every: int = 10,
    max_plies: int = 160,
    mate_in_two: bool = True,
    processes: int = 2,
) -> tuple[list[Puzzle], list[Puzzle]]:
    """Generate (train, heldout) puzzles from `n_games` seeded random games. Games with
    index % heldout_every == 0 are held out, and positions are de-duplicated globally, so the two
    sets share neither a source game nor a position."""
    chunks = [list(range(i, n_games, processes * 8)) for i in range(processes * 8)]
    with Pool(processes) as pool:
        results = pool.map(_worker, [(c, seed, max_plies, mate_in_two) for c in chunks])
    seen: set[str] = set()
    train, heldout = [], []
    for p in sorted((p for r in results for p in r), key=lambda p: (p.extra["game"], p.puzzle_id)):
        if p.extra["key"] in seen:
            continue
        seen.add(p.extra["key"])
        (heldout if p.extra["game"] % heldout_every == 0 else train).append(p)
    return train, heldout
