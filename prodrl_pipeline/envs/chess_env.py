"""Multi-turn chess puzzle environment: the model plays the puzzle through a `move` tool.

Each turn the model sees the board as text (side to move, FEN, the legal moves; in free_text mode
also the checking moves) and answers with one `move` tool call. The environment checks the move
against the puzzle solution (Lichess rules: any mate is accepted on the last move), plays the
opponent's reply and continues. Reward 1 for a solved puzzle, else 0 (`partial_credit` gives the
fraction of player moves found). An illegal or malformed move ends the episode with the reward
earned so far.

Two modes (`Mode`). `structured`: the answer is the call alone and the next position comes in the
call's result. `free_text`: the answer is a short reasoning segment,
`<think>Checks: ... Play ...</think>` (the checking moves, since a mate is among them, and the move
played), then the call; the result says only how the move went and the next position comes as a
user message, so a template that keeps reasoning only after the last user message (Qwen3's) drops
the earlier turns' reasoning from history.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

import chess

from prodrl_pipeline.envs.puzzles import Puzzle

MOVE_TOOL = {
    "type": "function",
    "function": {
        "name": "move",
        "description": "Play one move, written exactly as in the list of legal moves.",
        "parameters": {
            "type": "object",
            "properties": {"move": {"type": "string"}},
            "required": ["move"],
        },
    },
}
SYSTEM_PROMPT = "Solve the chess puzzle with the move tool."
FREE_TEXT_SYSTEM_PROMPT = (
    "Solve the chess puzzle. In <think></think>, list the checks and the move you play; then call "
    "the move tool with it."
)
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CHECKS = "Checks: "  # introduces the free-text prompt's line of checking moves, and the reasoning
Mode = Literal["structured", "free_text"]
"""How the model answers a turn (module docstring)."""


def move_text(board: chess.Board, move: chess.Move) -> str:
    """SAN with checkmate shown as check ('#' -> '+'): the model must find which check mates."""
    return board.san(move).replace("#", "+")


def legal_moves_by_text(board: chess.Board) -> dict[str, chess.Move]:
    """Every legal move under its `move_text`, sorted by text. SAN is the costly part of a turn:
    render it once per position and share it between the prompt, the constraint and the step.
    All moves are rendered in one pass: a move is disambiguated against the other legal moves of
    the same piece type to the same square (by file if that suffices, else by rank, else both),
    and the check test reads bitboards (`board.san` also searches for mate and regenerates the
    legal moves per move, ~3x the cost; the two agree on every move, tests/envs)."""
    moves = list(board.legal_moves)
    rivals: dict[tuple[int, int], list[int]] = defaultdict(list)  # (piece, to) -> from squares
    for m in moves:
        rivals[board.piece_type_at(m.from_square), m.to_square].append(m.from_square)
    king = board.king(not board.turn)
    return dict(sorted((_san(board, m, rivals, king), m) for m in moves))


def _gives_check(board: chess.Board, move: chess.Move, piece: int, king: int) -> bool:
    """What `board.push(move); board.is_check()` says for a move that is not castling, from the
    position's bitboards (a quarter of the time): the king on `king` is attacked, through the
    occupancy after the move, by the moved piece on its new square or by any other piece of ours
    (a discovered check; en passant also clears the captured pawn's square)."""
    us = board.turn
    origin, target = chess.BB_SQUARES[move.from_square], chess.BB_SQUARES[move.to_square]
    occupied = board.occupied & ~origin | target
    if piece == chess.PAWN and board.is_en_passant(move):
        occupied &= ~chess.BB_SQUARES[move.to_square ^ 8]  # the pawn taken en passant
    diagonal = chess.BB_DIAG_ATTACKS[king][chess.BB_DIAG_MASKS[king] & occupied]
    straight = (
        chess.BB_RANK_ATTACKS[king][chess.BB_RANK_MASKS[king] & occupied]
        | chess.BB_FILE_ATTACKS[king][chess.BB_FILE_MASKS[king] & occupied]
    )
    pawn, knight, ring = (
        chess.BB_PAWN_ATTACKS[not us][king],
        chess.BB_KNIGHT_ATTACKS[king],
        chess.BB_KING_ATTACKS[king],
    )
    reach = {  # piece type: the squares from which it attacks the king
        chess.PAWN: pawn,
        chess.KNIGHT: knight,
        chess.BISHOP: diagonal,
        chess.ROOK: straight,
        chess.QUEEN: diagonal | straight,
        chess.KING: ring,
    }
    if reach[move.promotion or piece] & target:
        return True
    ours = board.occupied_co[us] & occupied  # not the origin, nor a pawn taken en passant
    return bool(
        (pawn & board.pawns | knight & board.knights | ring & board.kings) & ours
        or diagonal & (board.bishops | board.queens) & ours
        or straight & (board.rooks | board.queens) & ours
    )


def _san(
    board: chess.Board, move: chess.Move, rivals: dict[tuple[int, int], list[int]], king: int | None
) -> str:
    piece = board.piece_type_at(move.from_square)
    if board.is_castling(move):
        text = "O-O-O" if chess.square_file(move.to_square) < chess.square_file(move.from_square) else "O-O"
        return text + "+" if _played_checks(board, move) else text
    capture = board.is_capture(move)
    text = ""
    if piece == chess.PAWN:
        if capture:
            text = chess.FILE_NAMES[chess.square_file(move.from_square)]
    else:
        text = chess.piece_symbol(piece).upper()
        others = [s for s in rivals[piece, move.to_square] if s != move.from_square]
        if others:
            file, rank = chess.square_file(move.from_square), chess.square_rank(move.from_square)
            if all(chess.square_file(s) != file for s in others):
                text += chess.FILE_NAMES[file]
            elif all(chess.square_rank(s) != rank for s in others):
                text += chess.RANK_NAMES[rank]
            else:
                text += chess.FILE_NAMES[file] + chess.RANK_NAMES[rank]
    text += ("x" if capture else "") + chess.square_name(move.to_square)
    if move.promotion:
        text += "=" + chess.piece_symbol(move.promotion).upper()
    if board.kings & chess.BB_SQUARES[move.to_square]:  # a king taken: only an invalid board allows it
        return text + "+" if _played_checks(board, move) else text
    return text + "+" if king is not None and _gives_check(board, move, piece, king) else text


def _played_checks(board: chess.Board, move: chess.Move) -> bool:
    """Whether `move` checks, by playing it: castling (the rook may check), and a move taking a
    king (the king checked after it is another one, or none)."""
    board.push(move)
    check = board.is_check()
    board.pop()
    return check


def legal_move_texts(board: chess.Board) -> list[str]:
    return list(legal_moves_by_text(board))


def render_board(board: chess.Board, moves: list[str] | None = None, mode: Mode = "structured") -> str:
    """Side to move, FEN and the legal moves (FEN rather than a drawn board: a third of the
    tokens, and prompt length is what a CPU round pays for); in free_text mode then a line of the
    checking moves, which the reasoning copies (`reasoning`). `moves`: the board's
    `legal_move_texts`, when already rendered."""
    side = "White" if board.turn == chess.WHITE else "Black"
    shown = legal_move_texts(board) if moves is None else moves
    text = f"{side} to move. FEN: {board.fen()}\nLegal moves: " + " ".join(shown)
    return f"{text}\n{CHECKS}{checks_text(shown)}" if mode == "free_text" else text


def checks_text(moves: list[str]) -> str:
    """The checking moves of `moves` in list order, space-separated, or 'none'."""
    return " ".join(m for m in moves if m.endswith("+")) or "none"


def tool_call_message(move: str, call_id: str = "call_0") -> dict:
    """An OpenAI-style assistant message holding one `move` tool call."""
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": "move", "arguments": json.dumps({"move": move})},
            }
        ],
    }


def reasoning(moves: list[str], move: str) -> str:
    """The free-text mode's reasoning before playing `move` in a position with legal moves `moves`:
    its checks, in list order, then the move it plays, which the call repeats (a copy that an
    induction circuit makes: `rl.warmstart.copy_pretrain`)."""
    return f"{CHECKS}{checks_text(moves)}. Play {move}"


def answer_message(moves: list[str], move: str, mode: Mode) -> dict:
    """The assistant message that plays `move` in a position with legal moves `moves`: the call
    alone (structured), or the reasoning then the call (free_text)."""
    message = tool_call_message(move)
    if mode == "free_text":
        message["content"] = f"{THINK_OPEN}{reasoning(moves, move)}{THINK_CLOSE}"
    return message


def parse_move_call(message: dict) -> str | None:
    """The `move` argument of the message's single tool call, or None if malformed."""
    calls = message.get("tool_calls") or []
    if len(calls) != 1 or calls[0].get("function", {}).get("name") != "move":
        return None
    try:
        args = json.loads(calls[0]["function"].get("arguments") or "")
    except (json.JSONDecodeError, TypeError):
        return None
    move = args.get("move") if isinstance(args, dict) else None
    return move if isinstance(move, str) else None


@dataclass
class ChessEpisode:
    """The state of one puzzle attempt. `messages` is the conversation the model is shown."""

    puzzle: Puzzle
    partial_credit: bool = False
    mode: Mode = "structured"
    board: chess.Board = field(init=False)
    """The position (changed by `step` alone: the legal moves are rendered once per position)."""
    messages: list[dict] = field(init=False)
    ply: int = 1  # index into puzzle.moves of the move the player must find next
    done: bool = False
    reward: float = 0.0
    found: int = 0

    def __post_init__(self) -> None:
        self.board = self.puzzle.start_board()
        self._legal = legal_moves_by_text(self.board)
        system = FREE_TEXT_SYSTEM_PROMPT if self.mode == "free_text" else SYSTEM_PROMPT
        self.messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": render_board(self.board, self.allowed_moves(), self.mode)},
        ]

    def allowed_moves(self) -> list[str]:
        """The strings the structured-output constraint allows as the `move` argument."""
        return list(self._legal)

    def step(self, assistant_message: dict, cut_off: bool = False) -> None:
        """Apply the model's answer and the opponent's reply; appends to `messages`. An answer
        `cut_off` (by max_tokens) is malformed, whatever call it holds."""
        if self.done:
            raise RuntimeError("step() on a finished episode")
        self.messages.append(assistant_message)
        text = parse_move_call(assistant_message)
        move = self._legal.get(text) if text is not None and not cut_off else None
        if move is None:
            return self._finish("Illegal or malformed move.", solved=False)
        expected = chess.Move.from_uci(self.puzzle.moves[self.ply])
        last = self.ply == len(self.puzzle.moves) - 1
        self.board.push(move)
        if last and self.board.is_checkmate():
            self.found += 1
            return self._finish("Checkmate. Puzzle solved.", solved=True)
        if move != expected:
            return self._finish("Wrong move.", solved=False)
        self.found += 1
        if last:
            return self._finish("Puzzle solved.", solved=True)
        reply = chess.Move.from_uci(self.puzzle.moves[self.ply + 1])
        reply_text = self.board.san(reply)
        self.board.push(reply)
        self.ply += 2
        self._legal = legal_moves_by_text(self.board)
        position = render_board(self.board, self.allowed_moves(), self.mode)
        if self.mode == "free_text":
            self._tool(f"Correct. Opponent played {reply_text}.")
            self.messages.append({"role": "user", "content": position})
        else:
            self._tool(f"Correct. Opponent played {reply_text}.\n{position}")

    def _tool(self, content: str) -> None:
        self.messages.append({"role": "tool", "tool_call_id": "call_0", "content": content})

    def _finish(self, content: str, solved: bool) -> None:
        self._tool(content)
        self.done = True
        if solved:
            self.reward = 1.0
        elif self.partial_credit:
            self.reward = self.found / self.puzzle.n_player_moves
