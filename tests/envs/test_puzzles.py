import math
import os
import random
import subprocess
import sys
from pathlib import Path

import chess
import pytest
import zstandard

from prodrl_pipeline.envs.mates import mates_in_one, unique_mate_in_two
from prodrl_pipeline.envs.puzzle_gen import SPLITS, balance_kinds, generate, play_game, split_of
from prodrl_pipeline.envs.puzzles import Puzzle, puzzle_stats, read_puzzles, validated_mark, write_puzzles

# A real row of the Lichess puzzle database (format reference): FEN before the opponent's move.
LICHESS_ROW = (
    "PuzzleId,FEN,Moves,Rating,RatingDeviation,Popularity,NbPlays,Themes,GameUrl,OpeningTags\n"
    "00008,r6k/pp2r2p/4Rp1Q/3p4/8/1N1P2R1/PqP2bPP/7K b - - 0 24,f2g3 e6e7 b2b1 b3c1 b1c1 h6c1,"
    "1913,75,94,6230,crushing hangingPiece long middlegame,https://lichess.org/787zsVup/black#47,\n"
)
# Found by the generator: after 1...Kg8 White's only mate in two is the quiet 2.Rd1.
QUIET_MATE_IN_TWO = "6k1/6P1/1p6/pP2B1N1/P4p2/7P/5P2/2K3R1 w - - 0 46"


def test_reads_lichess_csv_and_zst(tmp_path):
    plain = tmp_path / "lichess_db_puzzle.csv"
    plain.write_text(LICHESS_ROW)
    packed = tmp_path / "lichess_db_puzzle.csv.zst"
    packed.write_bytes(zstandard.ZstdCompressor().compress(LICHESS_ROW.encode()))
    for path in (plain, packed):
        (p,) = read_puzzles(path)
        assert p.puzzle_id == "00008" and p.rating == 1913 and len(p.moves) == 6
        # Lichess convention: moves[0] is the opponent's move played from FEN; then the player moves.
        board = p.start_board()
        assert board.turn == chess.WHITE
        assert board.piece_at(chess.G3) == chess.Piece(chess.BISHOP, chess.BLACK)


def test_csv_round_trip(tmp_path):
    src = tmp_path / "src.csv"
    src.write_text(LICHESS_ROW)
    puzzles = read_puzzles(src)
    write_puzzles(puzzles, tmp_path / "out.csv")
    assert read_puzzles(tmp_path / "out.csv") == puzzles


def test_rejects_non_lichess_csv(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    try:
        read_puzzles(bad)
    except ValueError as e:
        assert "missing columns" in str(e)
    else:
        raise AssertionError("a CSV without Lichess columns must be refused")


def test_a_file_read_clean_in_full_is_marked_and_its_bytes_are_not_replayed_again(tmp_path, monkeypatch):
    monkeypatch.setenv("PRODRL_CACHE_DIR", str(tmp_path / "cache"))
    good = tmp_path / "good.csv"
    good.write_text(LICHESS_ROW)
    assert read_puzzles(good, limit=1) and not validated_mark(good).exists()  # not read in full
    assert read_puzzles(good, themes="crushing") and not validated_mark(good).exists()  # some rows only
    first = read_puzzles(good)
    assert validated_mark(good).exists() and read_puzzles(good) == first
    # an illegal line (the rook on e7 blocks e8) under a forged mark is read: the mark, not the
    # chess, vouches for those bytes
    illegal = tmp_path / "illegal.csv"
    illegal.write_text(LICHESS_ROW.replace("f2g3 e6e7", "f2g3 e6e8"))
    with pytest.raises(ValueError, match="is not legal"):
        read_puzzles(illegal)
    assert not validated_mark(illegal).exists()
    validated_mark(illegal).touch()
    assert [p.moves[1] for p in read_puzzles(illegal)] == ["e6e8"]
    # one changed byte is another file: checked again
    illegal.write_text(LICHESS_ROW.replace("f2g3 e6e7", "f2g3 e6g6"))
    with pytest.raises(ValueError, match="is not legal"):
        read_puzzles(illegal)
    # a file with a malformed row skipped is not marked; what is not chess is checked under a mark
    skipped: list[str] = []
    assert read_puzzles(illegal, skipped=skipped) == [] and len(skipped) == 1
    assert not validated_mark(illegal).exists()
    bad_count = tmp_path / "count.csv"
    bad_count.write_text(LICHESS_ROW.replace(",1913,", ",high,"))
    validated_mark(bad_count).touch()
    with pytest.raises(ValueError, match="Rating 'high' is not an integer"):
        read_puzzles(bad_count)


def test_bytes_that_changed_after_the_mark_was_looked_up_are_checked_again(tmp_path, monkeypatch):
    """The file is rewritten between the mark's lookup and the parse (simulated: the lookup is
    handed the mark of the clean bytes): the digest of what was parsed differs, so it is read again
    with the chess checks; the clean bytes' mark is not taken for the new ones."""
    import prodrl_pipeline.envs.puzzles as puzzles

    monkeypatch.setenv("PRODRL_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "puzzles.csv"
    path.write_text(LICHESS_ROW)
    read_puzzles(path)
    clean_mark = validated_mark(path)
    assert clean_mark.exists()
    path.write_text(LICHESS_ROW.replace("f2g3 e6e7", "f2g3 e6e8"))
    monkeypatch.setattr(puzzles, "validated_mark", lambda _: clean_mark)
    with pytest.raises(ValueError, match="is not legal"):
        read_puzzles(path)
    skipped: list[str] = []
    assert read_puzzles(path, skipped=skipped) == [] and len(skipped) == 1  # reported once


def test_rows_added_after_the_parser_reached_the_end_are_not_marked_with_it(tmp_path, monkeypatch):
    """The file grows after the parser's last row (simulated: the reader appends an illegal row
    when it runs out): what was checked is not the whole file, so nothing is marked."""
    import csv

    import prodrl_pipeline.envs.puzzles as puzzles

    monkeypatch.setenv("PRODRL_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "puzzles.csv"
    path.write_text(LICHESS_ROW)
    appended = LICHESS_ROW.splitlines()[1].replace("00008", "00009").replace("f2g3 e6e7", "f2g3 e6e8")

    class Appending(csv.DictReader):
        def __next__(self):
            try:
                return super().__next__()
            except StopIteration:
                with path.open("a") as fh:
                    fh.write(appended + "\n")
                raise

    monkeypatch.setattr(puzzles.csv, "DictReader", Appending)
    assert [p.puzzle_id for p in read_puzzles(path)] == ["00008"]
    monkeypatch.undo()
    monkeypatch.setenv("PRODRL_CACHE_DIR", str(tmp_path / "cache"))
    assert not validated_mark(path).exists()
    with pytest.raises(ValueError, match="line 3: move 'e6e8' is not legal"):
        read_puzzles(path)


def test_compressed_files_are_marked_and_a_planted_link_is_not_followed(tmp_path, monkeypatch):
    monkeypatch.setenv("PRODRL_CACHE_DIR", str(tmp_path / "cache"))
    packed = tmp_path / "lichess_db_puzzle.csv.zst"
    packed.write_bytes(zstandard.ZstdCompressor().compress(LICHESS_ROW.encode()))
    first = read_puzzles(packed)
    assert validated_mark(packed).exists() and read_puzzles(packed) == first
    plain = tmp_path / "plain.csv"
    plain.write_text(LICHESS_ROW)
    outside = tmp_path / "outside"
    validated_mark(plain).symlink_to(outside)  # writing the mark must not create this file
    assert read_puzzles(plain) == first and not outside.exists()


def test_marks_only_count_in_a_folder_of_this_users_alone_and_as_plain_files(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("PRODRL_CACHE_DIR", str(cache))
    illegal = tmp_path / "illegal.csv"
    illegal.write_text(LICHESS_ROW.replace("f2g3 e6e7", "f2g3 e6e8"))
    mark = validated_mark(illegal)
    target = tmp_path / "elsewhere"
    target.touch()
    mark.symlink_to(target)  # a planted link is not a mark
    with pytest.raises(ValueError, match="is not legal"):
        read_puzzles(illegal)
    mark.unlink()
    mark.touch()
    (cache / "validated-puzzles").chmod(0o777)  # others may write there: its marks vouch for nothing
    assert validated_mark(illegal) is None
    with pytest.raises(ValueError, match="is not legal"):
        read_puzzles(illegal)


def test_without_a_usable_cache_or_a_regular_file_every_read_checks_in_full(tmp_path, monkeypatch):
    import threading

    good = tmp_path / "good.csv"
    good.write_text(LICHESS_ROW)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("PRODRL_CACHE_DIR", str(blocker))
    assert validated_mark(good) is None and read_puzzles(good) == read_puzzles(good)
    monkeypatch.setenv("PRODRL_CACHE_DIR", str(tmp_path / "cache"))
    pipe = tmp_path / "pipe.csv"
    os.mkfifo(pipe)
    writer = threading.Thread(target=pipe.write_text, args=(LICHESS_ROW,))
    writer.start()
    assert [p.puzzle_id for p in read_puzzles(pipe)] == ["00008"]  # read once, not drained by a digest
    writer.join()
    monkeypatch.delenv("PRODRL_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    assert validated_mark(good) is None and len(read_puzzles(good)) == 1


# ---- generation -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sample() -> dict[str, list[Puzzle]]:
    """Unbalanced, so that every generated puzzle is checked."""
    return generate(30, seed=5, balance=False, processes=2)


def _all(sample: dict[str, list[Puzzle]]) -> list[Puzzle]:
    return [p for split in SPLITS for p in sample[split]]


def _brute_mates(board: chess.Board) -> list[chess.Move]:
    mates = []
    for move in board.legal_moves:
        board.push(move)
        if board.is_checkmate():
            mates.append(move)
        board.pop()
    return mates


def _brute_winning_first_moves(board: chess.Board) -> list[chess.Move]:
    """Every first move after which each legal reply allows a mate in one (plain search)."""
    winners = []
    for first in board.legal_moves:
        board.push(first)
        replies = list(board.legal_moves)
        wins = bool(replies)
        for reply in replies:
            board.push(reply)
            wins = bool(_brute_mates(board))
            board.pop()
            if not wins:
                break
        board.pop()
        if wins:
            winners.append(first)
    return winners


def test_heuristic_games_are_deterministic_and_varied():
    games = [play_game(g, seed=3, max_plies=60) for g in range(4)]
    assert games == [play_game(g, seed=3, max_plies=60) for g in range(4)]
    assert len({tuple(g[:8]) for g in games}) == 4  # different openings, not one fixed line
    assert play_game(0, seed=4, max_plies=60) != games[0]
    for moves in games:  # the moves are legal in sequence
        board = chess.Board()
        for uci in moves:
            board.push_uci(uci)


def test_generation_does_not_depend_on_processes():
    assert generate(6, seed=9, processes=1) == generate(6, seed=9, processes=2)


def test_the_spawned_pool_ends_where_sigterm_is_ignored():
    """A test runner's worker can ignore SIGTERM, and spawned workers inherit that: a pool ended by
    terminate's SIGTERM then waited forever on a worker still starting (about one run in two, as
    this test hung puzzle generation); `spawned_map` ends its pool by the end-of-work message."""
    code = (
        "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "from prodrl_pipeline.envs.puzzle_gen import spawned_map\n"
        "if __name__ == '__main__':\n"
        "    print([spawned_map(abs, [-k], 2, 1) for k in range(4)])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.stdout.strip() == "[[0], [1], [2], [3]]", out.stderr


def test_generated_puzzles_follow_the_convention(sample):
    for p in _all(sample):
        board = chess.Board(p.fen)
        board.push_uci(p.moves[0])  # the opponent's setup move is legal from FEN
        for uci in p.moves[1:]:
            board.push_uci(uci)
        assert board.is_checkmate(), p  # the solution line ends in mate
        assert ("mateIn1" in p.themes) == (len(p.moves) == 2)
        assert ("mateIn2" in p.themes) == (len(p.moves) == 4)


def test_mate_in_two_first_move_is_unique_and_there_is_no_mate_in_one(sample):
    mate_in_two = [p for p in _all(sample) if "mateIn2" in p.themes]
    quiet = 0
    for p in mate_in_two:
        board = p.start_board()
        assert not _brute_mates(board), p
        assert _brute_winning_first_moves(board) == [chess.Move.from_uci(p.moves[1])], p
        quiet += not board.gives_check(chess.Move.from_uci(p.moves[1]))
    assert len(mate_in_two) >= 10 and quiet >= 1


def test_mate_in_two_reply_is_the_toughest_defence(sample):
    for p in (p for p in _all(sample) if "mateIn2" in p.themes):
        board = p.start_board()
        board.push_uci(p.moves[1])
        counts = {}
        for reply in board.legal_moves:
            board.push(reply)
            counts[reply.uci()] = len(_brute_mates(board))
            board.pop()
        assert counts[p.moves[2]] == min(counts.values()), p


def test_quiet_mate_in_two_is_found():
    board = chess.Board(QUIET_MATE_IN_TWO)
    first, _, mate = unique_mate_in_two(board)
    assert board.san(first) == "Rd1" and not board.gives_check(first)
    assert _brute_winning_first_moves(board) == [first]


def test_mates_in_one_matches_plain_search(sample):
    rng = random.Random(0)
    boards = []
    for p in _all(sample)[:40]:  # generated positions: mates present
        boards.append(p.start_board())
    board = chess.Board()
    for _ in range(400):  # random play: promotions, en passant, castling, discovered checks
        moves = list(board.legal_moves)
        if not moves:
            board = chess.Board()
            continue
        board.push(rng.choice(moves))
        boards.append(board.copy())
    for b in boards:
        assert mates_in_one(b) == sorted(_brute_mates(b), key=chess.Move.uci), b.fen()


def test_splits_share_no_game_and_no_position(sample):
    games = {s: {p.game_url for p in sample[s]} for s in SPLITS}
    positions = {s: {" ".join(p.start_board().fen().split()[:4]) for p in sample[s]} for s in SPLITS}
    for i, a in enumerate(SPLITS):
        for b in SPLITS[i + 1 :]:
            assert not games[a] & games[b] and not positions[a] & positions[b]
        for p in sample[a]:
            assert split_of(int(p.game_url.rsplit("game", 1)[1])) == a
    everything = _all(sample)
    assert len({" ".join(p.start_board().fen().split()[:4]) for p in everything}) == len(everything)


def test_balancing_keeps_as_many_mate_in_one_as_mate_in_two(sample):
    puzzles = _all(sample)
    balanced = balance_kinds(puzzles)
    stats = puzzle_stats(balanced)
    assert (
        stats["mate_in_1"]
        == stats["mate_in_2"]
        == min(puzzle_stats(puzzles)[k] for k in ("mate_in_1", "mate_in_2"))
    )
    kept = iter(puzzles)  # a subsequence: the order is kept
    assert all(any(p is q for q in kept) for p in balanced)
    assert balance_kinds(list(reversed(puzzles))) == list(reversed(balanced))  # chosen by id, not order


def test_split_of():
    assert [split_of(g) for g in range(10)] == ["heldout"] + ["warmup"] * 4 + ["train"] * 5


# ---- statistics -------------------------------------------------------------------------------


def _hand_puzzle(fen: str, moves: str, themes: str) -> Puzzle:
    return Puzzle(puzzle_id=fen[:8], fen=fen, moves=tuple(moves.split()), themes=themes)


def test_puzzle_stats_on_hand_built_puzzles():
    puzzles = [
        # back-rank mate in one, move 10
        _hand_puzzle("6k1/p4ppp/8/8/8/8/5PPP/R5K1 b - - 0 10", "a7a6 a1a8", "mate mateIn1"),
        # two white queens (promoted), move 20
        _hand_puzzle("6k1/p4ppp/8/8/8/8/5PPP/1QQ3K1 b - - 0 20", "a7a6 b1b8", "mate mateIn1"),
        # mate in two with a quiet first move (Rc1), move 30
        _hand_puzzle("4Q3/8/P2k4/3p4/4P2P/1p6/1K6/1R6 b - - 5 30", "d5d4 b1c1 d4d3 c1c6", "mate mateIn2"),
        # mate in two starting with a check (Qh5+ g6 Qxg6#), move 40
        _hand_puzzle(
            "r1bqkbnr/1pppp1pp/p1n5/8/4p3/2N4P/PPPP1PPN/R1BQKB1R b KQkq - 1 40",
            "h7h6 d1h5 g7g6 h5g6",
            "mate mateIn2",
        ),
    ]
    stats = puzzle_stats(puzzles)
    assert stats == {
        "count": 4,
        "mate_in_1": 2,
        "mate_in_2": 2,
        "mate_in_1_share": 0.5,
        "mate_in_2_share": 0.5,
        "start_move_q1": 17.5,
        "start_move_median": 25.0,
        "start_move_q3": 32.5,
        "quiet_mate_in_2_share": 0.5,
        "promoted_share": 0.25,
    }
    empty = puzzle_stats([])
    assert empty["count"] == 0 and empty["mate_in_1_share"] == 0.0 and math.isnan(empty["start_move_median"])
