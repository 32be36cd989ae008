import random

import chess

from prodrl_pipeline.envs.chess_env import ChessEpisode, legal_moves_by_text, move_text, tool_call_message
from prodrl_pipeline.envs.puzzles import Puzzle


def _puzzle(fen: str, moves: str) -> Puzzle:
    return Puzzle(puzzle_id="t", fen=fen, moves=tuple(moves.split()))


def _two_mates_puzzle() -> Puzzle:
    board = chess.Board("6k1/p4ppp/8/8/8/8/5PPP/3QR1K1 b - - 0 1")
    board.push_uci("a7a6")
    mates = sorted(m.uci() for m in board.legal_moves if board.gives_check(m) and _mates(board, m))
    assert mates == ["d1d8", "e1e8"]
    return _puzzle("6k1/p4ppp/8/8/8/8/5PPP/3QR1K1 b - - 0 1", "a7a6 e1e8")


def _mates(board: chess.Board, move: chess.Move) -> bool:
    board.push(move)
    try:
        return board.is_checkmate()
    finally:
        board.pop()


def _play(episode: ChessEpisode, uci: str) -> None:
    episode.step(tool_call_message(move_text(episode.board, chess.Move.from_uci(uci))))


def test_setup_move_is_the_opponents():
    ep = ChessEpisode(_two_mates_puzzle())
    assert ep.board.turn == chess.WHITE  # FEN has Black to move; Black's a7a6 was played for us
    assert ep.board.piece_at(chess.A6) == chess.Piece(chess.PAWN, chess.BLACK)
    assert "White to move" in ep.messages[1]["content"] and "Qd8+" in ep.messages[1]["content"]


def test_recorded_mate_solves():
    ep = ChessEpisode(_two_mates_puzzle())
    _play(ep, "e1e8")
    assert ep.done and ep.reward == 1.0


def test_alternate_mate_on_last_move_is_accepted():
    ep = ChessEpisode(_two_mates_puzzle())
    _play(ep, "d1d8")  # not the recorded move, but it mates: Lichess accepts it
    assert ep.done and ep.reward == 1.0


def test_wrong_and_illegal_moves_end_with_zero():
    ep = ChessEpisode(_two_mates_puzzle())
    _play(ep, "g2g3")
    assert ep.done and ep.reward == 0.0
    ep = ChessEpisode(_two_mates_puzzle())
    ep.step(tool_call_message("Ke9"))
    assert ep.done and ep.reward == 0.0 and "Illegal" in ep.messages[-1]["content"]
    ep = ChessEpisode(_two_mates_puzzle())
    ep.step({"role": "assistant", "content": "I resign"})
    assert ep.done and ep.reward == 0.0


def test_mate_in_two_is_multi_turn(train_puzzles):
    puzzle = next(p for p in train_puzzles if "mateIn2" in p.themes)
    ep = ChessEpisode(puzzle)
    _play(ep, puzzle.moves[1])
    assert (
        not ep.done and ep.messages[-1]["role"] == "tool" and "Opponent played" in ep.messages[-1]["content"]
    )
    # the opponent's recorded reply was played
    assert ep.board.move_stack[-1] == chess.Move.from_uci(puzzle.moves[2])
    _play(ep, puzzle.moves[3])
    assert ep.done and ep.reward == 1.0


def test_partial_credit(train_puzzles):
    puzzle = next(p for p in train_puzzles if "mateIn2" in p.themes)
    ep = ChessEpisode(puzzle, partial_credit=True)
    _play(ep, puzzle.moves[1])
    wrong = next(m for m in ep.board.legal_moves if not _mates(ep.board, m))
    _play(ep, wrong.uci())
    assert ep.done and ep.reward == 0.5


def _positions(games: int, seed: int = 0) -> list[chess.Board]:
    """Every position of random games: castling, en passant, promotions (several queens too) and
    ambiguous moves by file, by rank and by both all occur."""
    rng, boards = random.Random(seed), []
    for _ in range(games):
        board = chess.Board()
        while not board.is_game_over() and board.ply() < 300:
            boards.append(board.copy(stack=False))
            board.push(rng.choice(list(board.legal_moves)))
    return boards


def test_legal_moves_are_rendered_as_python_chess_san_with_mate_shown_as_check():
    boards = [*_positions(12), chess.Board("k7/8/K7/8/7Q/8/8/4Q2Q w - - 0 1")]  # Qh1e4: file and rank
    rendered = {}
    for board in boards:
        expected = {move_text(board, m): m for m in board.legal_moves}
        got = legal_moves_by_text(board)
        assert got == expected and list(got) == sorted(expected), board.fen()
        rendered.update(got)
    texts = "".join(rendered)
    for feature in ("O-O", "O-O-O", "=Q", "=N", "x", "+"):
        assert feature in texts, feature  # the positions did exercise every rule
    assert any(t[1] in "abcdefgh" and t[2] in "abcdefghx" for t in rendered if t[0] in "NRQB"), "by file"
    assert any(t[1] in "12345678" for t in rendered if t[0] in "NRQB"), "by rank"
    assert {"Qh1e4+", "Q4e4+", "Qee4+"} <= set(rendered), "by file and rank, by rank, by file"
    assert any(board.has_legal_en_passant() for board in boards)


def _check_kind(board: chess.Board, move: chess.Move) -> str | None:
    """How `move` checks (None: it does not), decided by playing it."""
    board.push(move)
    try:
        if not board.is_check():
            return None
        direct = bool(board.attacks_mask(move.to_square) & chess.BB_SQUARES[board.king(board.turn)])
    finally:
        board.pop()
    if board.is_castling(move):
        return "castling"
    if board.is_en_passant(move):
        return "en passant"
    if move.promotion:
        return "promotion"
    return "direct" if direct else "discovered"


def test_check_marks_agree_with_python_chess_on_every_kind_of_check():
    """SAN's '+' (a bitboard test) against python-chess playing each move, on every position of 40
    random games and on positions built for the rarer kinds of check."""
    built = [
        "5k2/8/8/8/8/8/8/4K2R w K - 0 1",  # O-O+ (the rook checks)
        "4k3/8/8/8/2pP4/8/8/4K2B b - d3 0 1",  # cxd3 e.p., no check
        "8/8/8/R2pP2k/8/8/8/4K3 w - d6 0 1",  # exd6+ e.p.: both pawns leave the rank of the rook
        "7k/8/8/3pP3/8/8/8/B3K3 w - d6 0 1",  # exd6+ and e6+ uncover the bishop
        "1n2k3/P7/8/8/8/8/8/4K3 w - - 0 1",  # axb8=Q+ and axb8=R+, a8=Q blocked by the knight
        "4k3/8/4N3/8/8/8/8/4R1K1 w - - 0 1",  # every knight move uncovers the rook
        "8/8/8/8/8/8/8/k1K5 w - - 0 1",  # kings only
        # boards python-chess (and a puzzle file) accepts though no game reaches them:
        "4k3/8/8/8/B7/8/4R3/K7 w - - 0 1",  # the king to be taken is in check: Rxe8, Bxe8
        "8/8/3n4/R2bP2k/8/8/8/K7 w - d6 0 1",  # an en passant square with a knight on it
        "8/8/8/8/R2n3k/8/3P4/K7 w - d3 0 1",  # an en passant square for the side to move
        "k3k3/8/8/8/8/8/4R3/K7 w - - 0 1",  # two kings: Rxe8 takes one and checks the other
        "3P4/8/1k6/R1PP4/Rq2n3/2q5/2krP3/B1Q5 w - c6 0 1",  # dxc6 e.p. takes our own pawn on c5
    ]
    kinds = set()
    for board in [*_positions(40, seed=1), *(chess.Board(fen) for fen in built)]:
        text = {move: t for t, move in legal_moves_by_text(board).items()}
        for move in board.legal_moves:
            kind = _check_kind(board, move)
            kinds.add(kind)
            assert text[move].endswith("+") == (kind is not None), (board.fen(), move.uci(), kind)
    assert {"castling", "en passant", "promotion", "direct", "discovered", None} <= kinds
