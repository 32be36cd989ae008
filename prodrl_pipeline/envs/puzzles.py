"""Chess puzzles in the Lichess puzzle CSV format: the row type, reading, writing, statistics.

Lichess convention: `fen` is the position *before* the opponent's move; `moves[0]` (UCI) is that
opponent move; the player's moves are at odd indices and the opponent's replies at even indices
>= 2. On the player's last move any move that delivers checkmate is accepted (puzzle rules).
The lab generates its own puzzles in this format (`puzzle_gen`); docs/puzzles.md describes them.
"""

from __future__ import annotations

import csv
import hashlib
import io
import logging
import math
import os
import stat
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import chess

log = logging.getLogger(__name__)
# What a "validated" mark vouches for: bump the number when `_puzzle`'s checks change.
RULES = f"puzzle rules 1, python-chess {chess.__version__}"
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


class _Digesting(io.RawIOBase):
    """A binary file that feeds every byte read from it to `digest`."""

    def __init__(self, raw: io.RawIOBase, digest: hashlib._Hash):
        self.raw, self.digest = raw, digest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:
        n = self.raw.readinto(buffer)
        self.digest.update(memoryview(buffer)[:n])
        return n


def read_puzzles(
    path: str | Path, limit: int | None = None, themes: str | None = None, skipped: list[str] | None = None
) -> list[Puzzle]:
    """Read a Lichess puzzle CSV (`lichess_db_puzzle.csv` or `.csv.zst`), optionally keeping only
    rows whose Themes contain `themes` (e.g. "mateIn1"). Raises ValueError on a malformed header.
    A malformed row (no id, an unreadable FEN, moves that are not a legal UCI line from it, a
    non-integer count) raises ValueError naming its line, or, with `skipped`, is left out and
    described there ("line N: reason").

    Replaying every row's moves is most of the cost (0.3 ms a row). A regular file read in full
    without a malformed row is marked as validated (`validated_mark`); a later full read of a
    marked file checks only what is not chess (the id, the move count, the integers), and checks
    everything again if the bytes it parsed are not the ones marked (the file changed meanwhile)."""
    path = Path(path)
    mark = validated_mark(path) if limit is None else None
    marked = mark is not None and _is_mark(mark)
    reasons: list[str] = []
    out, digest = _read(path, limit, themes, reasons if skipped is not None else None, not marked)
    if marked and digest != mark.name:
        reasons.clear()
        out, digest = _read(path, limit, themes, reasons if skipped is not None else None, True)
        marked = False
    if mark is not None and digest is not None and not marked and not reasons and not themes:
        _write_mark(mark.with_name(digest))  # the bytes checked, whatever the file holds now
    if skipped is not None:
        skipped.extend(reasons)
    return out


def _read(
    path: Path, limit: int | None, themes: str | None, skipped: list[str] | None, chess_rules: bool
) -> tuple[list[Puzzle], str | None]:
    """read_puzzles' rows, and the digest (`validated_mark`'s) of the bytes they were parsed from
    (None for a read stopped by `limit`)."""
    digest = hashlib.sha256(RULES.encode())
    out: list[Puzzle] = []
    with path.open("rb", buffering=0) as raw:
        binary: io.IOBase = io.BufferedReader(_Digesting(raw, digest))
        if path.suffix == ".zst":
            import zstandard

            binary = zstandard.ZstdDecompressor().stream_reader(binary)
        fh = io.TextIOWrapper(binary, encoding="utf-8", newline="")
        reader = csv.DictReader(fh)
        missing = [c for c in LICHESS_COLUMNS[:3] if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: not a Lichess puzzle CSV, missing columns {missing}")
        for row in reader:
            if themes and themes not in (row.get("Themes") or "").split():
                continue
            try:
                out.append(_puzzle(row, chess_rules))
            except ValueError as e:
                reason = f"line {reader.line_num}: {e}"
                if skipped is None:
                    raise ValueError(f"{path} {reason}") from e
                skipped.append(reason)
                continue
            if limit is not None and len(out) >= limit:
                return out, None  # a partial read: no digest of the file
    return out, digest.hexdigest()  # of what the parser read, not of bytes added after its end


def validated_mark(path: Path) -> Path | None:
    """The file whose existence says that `path`'s exact bytes passed every check: named by the
    sha256 of the rules and the bytes, in `$PRODRL_CACHE_DIR` or `~/.cache/prodrl`, under
    `validated-puzzles`: a folder of this user's that no one else may write (not the data's: a
    shipped data folder cannot vouch for itself). None for what is not a regular file (a pipe
    is read once), or when there is no such folder to use (every read then checks in full)."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            return None
        root = os.environ.get("PRODRL_CACHE_DIR") or Path(
            os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "prodrl"
        )
        folder = Path(root, "validated-puzzles")
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        owner = folder.stat()
        digest = hashlib.sha256(RULES.encode())
        with path.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    except (OSError, RuntimeError) as e:  # RuntimeError: no home folder to be found
        log.debug("puzzles: no validated mark for %s (%s)", path, e)
        return None
    if owner.st_uid != os.geteuid() or owner.st_mode & 0o022:
        log.warning("puzzles: %s is not this user's alone; its marks are not trusted", folder)
        return None
    return folder / digest.hexdigest()


def _is_mark(mark: Path) -> bool:
    try:
        found = mark.lstat()
    except OSError:
        return False
    return stat.S_ISREG(found.st_mode) and found.st_uid == os.geteuid()


def _write_mark(mark: Path) -> None:
    try:
        os.close(os.open(mark, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))
    except OSError as e:  # a read-only cache: every read checks in full, nothing else changes
        log.debug("puzzles: cannot write the validated mark %s (%s)", mark, e)


def _puzzle(row: dict, chess_rules: bool = True) -> Puzzle:
    """One CSV row as a Puzzle, checked (ValueError says what is wrong); `chess_rules`: whether
    its FEN is parsed and its moves replayed (False: a row of a validated file, read_puzzles)."""
    puzzle_id, fen, moves = (row.get(c) or "" for c in ("PuzzleId", "FEN", "Moves"))
    if not puzzle_id.strip():
        raise ValueError("no PuzzleId")
    try:
        board = chess.Board(fen) if chess_rules else None
    except ValueError as e:
        raise ValueError(f"FEN {fen[:100]!r} does not parse ({e})") from e
    line = moves.split()
    if len(line) < 2:
        raise ValueError("Moves needs the opponent's move and at least one reply")
    for uci in line if board is not None else ():
        try:
            board.push(board.parse_uci(uci))
        except ValueError as e:
            raise ValueError(f"move {uci[:20]!r} is not legal in the line {moves[:200]!r}") from e

    def integer(column: str, default: int) -> int:
        value = row.get(column) or ""
        try:
            return int(value) if value.strip() else default
        except ValueError:
            raise ValueError(f"{column} {value[:40]!r} is not an integer") from None

    return Puzzle(
        puzzle_id=puzzle_id,
        fen=fen,
        moves=tuple(line),
        rating=integer("Rating", 1500),
        rating_deviation=integer("RatingDeviation", 75),
        popularity=integer("Popularity", 0),
        nb_plays=integer("NbPlays", 0),
        themes=row.get("Themes") or "",
        game_url=row.get("GameUrl") or "",
        opening_tags=row.get("OpeningTags") or "",
    )


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


def _has_promoted_pieces(board: chess.Board) -> bool:
    """More than one queen, or more than two rooks, bishops or knights, for either side."""
    return any(
        len(board.pieces(chess.QUEEN, color)) > 1
        or any(len(board.pieces(p, color)) > 2 for p in (chess.ROOK, chess.BISHOP, chess.KNIGHT))
        for color in chess.COLORS
    )


def _quartiles(values: list[int]) -> tuple[float, float, float]:
    if not values:
        return (math.nan,) * 3
    if len(values) == 1:
        return (float(values[0]),) * 3
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def puzzle_stats(puzzles: Iterable[Puzzle]) -> dict[str, float]:
    """Summary of a puzzle set: `count`; `mate_in_1`, `mate_in_2` (by theme) and their `_share`s of
    the count; `start_move_q1`, `start_move_median`, `start_move_q3`: quartiles (linear
    interpolation, as numpy's default) of the full-move number of `fen`; `quiet_mate_in_2_share`:
    the share of mate-in-2 puzzles whose first solution move gives no check; `promoted_share`: the
    share of `fen` positions with promoted pieces (more than one queen, or more than two rooks,
    bishops or knights, for a side). Shares of an empty set are 0."""
    puzzles = list(puzzles)
    m1 = [p for p in puzzles if "mateIn1" in p.themes.split()]
    m2 = [p for p in puzzles if "mateIn2" in p.themes.split()]
    quiet = 0
    for p in m2:
        board = p.start_board()
        quiet += not board.gives_check(chess.Move.from_uci(p.moves[1]))
    q1, median, q3 = _quartiles([chess.Board(p.fen).fullmove_number for p in puzzles])
    n = len(puzzles)
    return {
        "count": n,
        "mate_in_1": len(m1),
        "mate_in_2": len(m2),
        "mate_in_1_share": len(m1) / n if n else 0.0,
        "mate_in_2_share": len(m2) / n if n else 0.0,
        "start_move_q1": q1,
        "start_move_median": median,
        "start_move_q3": q3,
        "quiet_mate_in_2_share": quiet / len(m2) if m2 else 0.0,
        "promoted_share": sum(_has_promoted_pieces(chess.Board(p.fen)) for p in puzzles) / n if n else 0.0,
    }
