"""The lab's puzzle generator: seeded games of a randomized heuristic player, a puzzle at every
position where the side to move mates in one or has a unique mate in two, split by source game
into train, warmup and heldout (docs/puzzles.md).
"""

from __future__ import annotations

import hashlib
import math
import multiprocessing
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import chess

from prodrl_pipeline.envs.mates import (
    KingTarget,
    has_check,
    king_target,
    mates_in_one,
    may_check,
    piece_attacks,
    unique_mate_in_two,
)
from prodrl_pipeline.envs.puzzles import Puzzle

SPLITS = ("train", "warmup", "heldout")
VALUE = {chess.PAWN: 1, chess.KNIGHT: 3, chess.BISHOP: 3, chess.ROOK: 5, chess.QUEEN: 9, chess.KING: 0}
# As an attacker the king only takes undefended pieces: it never makes a square "cheaply attacked".
_ATTACKER_VALUE = {**VALUE, chess.KING: 100}


def split_of(game: int) -> str:
    """The split of a source game: heldout if game % 10 == 0, warmup if it is 1-4, else train."""
    rest = game % 10
    return "heldout" if rest == 0 else "warmup" if rest <= 4 else "train"


# ---- the heuristic player -----------------------------------------------------------------------


def _risk(board: chess.Board, square: int, piece: int, vacated: int = 0) -> float:
    """What a `piece` of the side to move stands to lose on `square`: the gap to the cheapest enemy
    attacker, or its whole value when attacked and not defended (defenders on `vacated` excluded)."""
    us = board.turn
    attackers = board.attackers_mask(not us, square)
    if not attackers:
        return 0.0
    cheapest = min(_ATTACKER_VALUE[board.piece_type_at(sq)] for sq in chess.scan_forward(attackers))
    value = VALUE[piece]
    if cheapest < value:
        return float(value - cheapest)
    return 0.0 if board.attackers_mask(us, square) & ~vacated else float(value)


@dataclass(frozen=True)
class HeuristicPlayer:
    """A cheap randomized player. Each legal move gets a score in pawn units (capture value
    MVV-LVA style, promotion, check, mate, opening development, rescuing an attacked piece, minus
    the piece's value at risk on its target square) plus Gaussian noise, and a move is sampled
    from softmax(score / temperature)."""

    temperature: float = 0.5
    noise: float = 0.5
    check: float = 1.0
    mate: float = 2.0
    king_zone: float = 0.4  # per square of the enemy king's zone the moved piece attacks
    risk: float = 0.5
    develop: float = 0.6
    castle: float = 1.2
    center_pawn: float = 0.5
    opening_moves: int = 10

    def choose(self, board: chess.Board, rng: random.Random, mates: Iterable[chess.Move] = ()) -> chess.Move:
        """Sample a move for the side to move; `mates` are its mates in one, if known."""
        mating = set(mates)
        target = king_target(board)
        zone = chess.BB_KING_ATTACKS[target.king] | chess.BB_SQUARES[target.king]
        opening = board.fullmove_number <= self.opening_moves
        at_risk: dict[int, float] = {}
        moves, scores = list(board.generate_legal_moves()), []
        for move in moves:
            score = self._score(board, move, move in mating, target, zone)
            if opening:
                score += self._opening(board, move)
            if move.from_square not in at_risk:
                piece = board.piece_type_at(move.from_square)
                at_risk[move.from_square] = (
                    0.0 if piece == chess.KING else _risk(board, move.from_square, piece)
                )
            # Moving an attacked piece saves what it risked.
            scores.append(score + self.risk * at_risk[move.from_square] + rng.gauss(0.0, self.noise))
        top = max(scores)
        weights = [math.exp((s - top) / self.temperature) for s in scores]
        return rng.choices(moves, weights)[0]

    def _score(
        self,
        board: chess.Board,
        move: chess.Move,
        is_mate: bool,
        target: KingTarget,
        zone: int,
    ) -> float:
        piece = board.piece_type_at(move.from_square)
        assert piece is not None
        victim = chess.PAWN if board.is_en_passant(move) else board.piece_type_at(move.to_square)
        score = VALUE[victim] - 0.1 * VALUE[piece] if victim else 0.0
        if move.promotion:
            score += VALUE[move.promotion] - 1
        if is_mate:
            score += self.mate
        elif may_check(board, move, target) and board.gives_check(move):
            score += self.check
        if piece != chess.KING:
            moved = move.promotion or piece
            occ = board.occupied & ~chess.BB_SQUARES[move.from_square]
            score += self.king_zone * chess.popcount(
                piece_attacks(moved, board.turn, move.to_square, occ) & zone
            )
            score -= self.risk * _risk(board, move.to_square, moved, chess.BB_SQUARES[move.from_square])
        return score

    def _opening(self, board: chess.Board, move: chess.Move) -> float:
        piece = board.piece_type_at(move.from_square)
        back = 0 if board.turn == chess.WHITE else 7
        from_rank, from_file = chess.square_rank(move.from_square), chess.square_file(move.from_square)
        if board.is_castling(move):
            return self.castle
        if piece in (chess.KNIGHT, chess.BISHOP) and from_rank == back:
            return self.develop
        if piece == chess.PAWN and from_file in (3, 4) and from_rank == (1 if back == 0 else 6):
            return self.center_pawn
        return 0.0


PLAYER = HeuristicPlayer()


# ---- games, puzzles and splits ------------------------------------------------------------------


def _plies(
    game: int, seed: int, max_plies: int, player: HeuristicPlayer
) -> Iterator[tuple[chess.Board, tuple[chess.Move, ...]]]:
    """Play game `game` of `seed`; after each ply yield the (live) board and the mates in one of
    the side now to move."""
    rng = random.Random(seed * 1_000_003 + game)
    board = chess.Board()
    mates: tuple[chess.Move, ...] = ()
    for _ in range(max_plies):
        if board.is_game_over():
            return
        board.push(player.choose(board, rng, mates))
        mates = tuple(mates_in_one(board))
        yield board, mates


def play_game(game: int, seed: int, max_plies: int = 160, player: HeuristicPlayer = PLAYER) -> list[str]:
    """The UCI moves of heuristic game number `game` of `seed` (deterministic for both)."""
    return [board.peek().uci() for board, _ in _plies(game, seed, max_plies, player)]


def _puzzle_id(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:8]


def _position_key(board: chess.Board) -> str:
    return " ".join(board.fen().split()[:4])


def _puzzles_from_game(game: int, seed: int, max_plies: int, mate_in_two: bool) -> list[Puzzle]:
    """Play one heuristic game and emit a puzzle at every position where the side to move mates
    in one, or has a unique mate in two."""
    out = []
    for board, mates in _plies(game, seed, max_plies, PLAYER):
        if mates:
            line, themes, rating = [mates[0]], "mate mateIn1 oneMove", 900
        # Positions without any check are not searched: in 400 sample games they held 6 of 324
        # mates in two, but 35% of the search time.
        elif mate_in_two and has_check(board) and (found := unique_mate_in_two(board)):
            line, themes, rating = list(found), "mate mateIn2 short", 1300
        else:
            continue
        setup = board.pop()
        before = board.fen()
        board.push(setup)
        uci = [setup.uci(), *(m.uci() for m in line)]
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


def balance_kinds(puzzles: list[Puzzle]) -> list[Puzzle]:
    """Subsample the more common of mate-in-1 / mate-in-2 to the count of the other, keeping the
    order. Which ones stay is decided by puzzle id (a hash): deterministic, unrelated to game order."""
    kinds = [[i for i, p in enumerate(puzzles) if ("mateIn1" in p.themes) == one] for one in (True, False)]
    n = min(len(k) for k in kinds)
    keep = {i for k in kinds for i in sorted(k, key=lambda i: puzzles[i].puzzle_id)[:n]}
    return [p for i, p in enumerate(puzzles) if i in keep]


T = TypeVar("T")
R = TypeVar("R")


def spawned_map(fn: Callable[[T], R], args: list[T], processes: int, chunksize: int) -> list[R]:
    """`map(fn, args)` in a pool of `processes` spawned workers. Spawned, not forked: a fork of a
    process with threads (torch's, a test runner's) can inherit a lock another thread holds and wait
    on it forever. Closed and joined, not terminated: a worker exits on the pool's end-of-work
    message, whereas terminate's SIGTERM is lost on one that inherited SIGTERM ignored (a test
    runner's worker can have it so) and is still starting, and then the pool waits on it forever."""
    pool = multiprocessing.get_context("spawn").Pool(processes)
    try:
        results = pool.map(fn, args, chunksize=chunksize)
        pool.close()
        pool.join()
        return results
    finally:
        pool.terminate()


def generate(
    n_games: int,
    seed: int = 0,
    max_plies: int = 160,
    mate_in_two: bool = True,
    balance: bool = True,
    processes: int = 2,
) -> dict[str, list[Puzzle]]:
    """Puzzles from `n_games` seeded heuristic games, by split (`SPLITS`, assigned per source game
    by `split_of`). Positions are de-duplicated globally (the first game keeps a position), so no
    two splits share a source game or a position. With `balance`, each split keeps as many
    mate-in-1 as mate-in-2 puzzles. Deterministic for a seed whatever `processes` is."""
    # Many small interleaved chunks, handed out one at a time: no worker idles at the end.
    n_chunks = max(processes * 8, n_games // 20)
    chunks = [list(range(i, n_games, n_chunks)) for i in range(n_chunks)]
    args = [(c, seed, max_plies, mate_in_two) for c in chunks]
    results = (
        spawned_map(_worker, args, processes, chunksize=1) if processes > 1 else list(map(_worker, args))
    )
    seen: set[str] = set()
    splits: dict[str, list[Puzzle]] = {s: [] for s in SPLITS}
    for p in sorted((p for r in results for p in r), key=lambda p: (p.extra["game"], p.puzzle_id)):
        if p.extra["key"] not in seen:
            seen.add(p.extra["key"])
            splits[split_of(p.extra["game"])].append(p)
    return {s: balance_kinds(ps) if balance else ps for s, ps in splits.items()}
