import chess
import zstandard

from prodrl_pipeline.envs.puzzles import generate, read_puzzles, write_puzzles

# A real row of the Lichess puzzle database (format reference): FEN before the opponent's move.
LICHESS_ROW = (
    "PuzzleId,FEN,Moves,Rating,RatingDeviation,Popularity,NbPlays,Themes,GameUrl,OpeningTags\n"
    "00008,r6k/pp2r2p/4Rp1Q/3p4/8/1N1P2R1/PqP2bPP/7K b - - 0 24,f2g3 e6e7 b2b1 b3c1 b1c1 h6c1,"
    "1913,75,94,6230,crushing hangingPiece long middlegame,https://lichess.org/787zsVup/black#47,\n"
)


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


def test_generated_puzzles_follow_the_convention():
    train, heldout = generate(12, seed=7, processes=1)
    for p in train + heldout:
        board = chess.Board(p.fen)
        board.push_uci(p.moves[0])  # the opponent's setup move is legal from FEN
        for uci in p.moves[1:]:
            board.push_uci(uci)
        assert board.is_checkmate(), p  # the solution line ends in mate
        assert ("mateIn1" in p.themes) == (len(p.moves) == 2)


def test_shipped_split_is_disjoint(train_puzzles, heldout):
    assert len(train_puzzles) >= 5000 and len(heldout) >= 500
    games = lambda ps: {p.game_url for p in ps}  # noqa: E731
    positions = lambda ps: {" ".join(p.start_board().fen().split()[:4]) for p in ps}  # noqa: E731
    assert not games(train_puzzles) & games(heldout)
    assert not positions(train_puzzles) & positions(heldout)
    for split in (train_puzzles, heldout):
        themes = {t for p in split for t in p.themes.split()}
        assert {"mateIn1", "mateIn2"} <= themes
