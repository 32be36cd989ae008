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
