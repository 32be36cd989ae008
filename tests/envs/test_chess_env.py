import chess

from prodrl_pipeline.envs.chess_env import ChessEpisode, move_text, tool_call_message
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
