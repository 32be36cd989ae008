import chess
import pytest

from prodrl_pipeline.chat.render import load_tokenizer
from prodrl_pipeline.envs import lab_data
from prodrl_pipeline.envs.chess_env import legal_move_texts
from prodrl_pipeline.envs.lab_data import (
    SPLIT_CSV,
    build_tokenizer,
    enumerated_move_strings,
    iter_lab_puzzles,
    solved_transcript,
)
from prodrl_pipeline.envs.puzzles import Puzzle, puzzle_stats, write_puzzles

# Back-rank mates in one after Black's a7a6. Train: rooks a1 and e1 (Rad1 and Red1 are shown);
# held out: knights b1 and f3 (Nbd2 and Nfd2 are shown, nowhere else).
TRAIN = Puzzle("train1", "6k1/p4ppp/8/8/8/8/5PPP/R3R1K1 b - - 0 20", ("a7a6", "e1e8"), themes="mateIn1")
WARMUP = Puzzle("warm1", "6k1/p4ppp/8/8/8/8/5PPP/4R1K1 b - - 0 20", ("a7a6", "e1e8"), themes="mateIn1")
HELDOUT = Puzzle("held1", "6k1/p4ppp/8/8/8/5N2/5PPP/1N2R1K1 b - - 0 20", ("a7a6", "e1e8"), themes="mateIn1")


@pytest.fixture
def tiny_data(tmp_path):
    (tmp_path / "puzzles").mkdir()
    for split, puzzle in (("train", TRAIN), ("warmup", WARMUP), ("heldout", HELDOUT)):
        write_puzzles([puzzle], tmp_path / SPLIT_CSV[split])
    return tmp_path


def _is_token(tokenizer, move: str) -> bool:
    ids = tokenizer.encode(f'{{"move": "{move}"}}', add_special_tokens=False)
    return move in tokenizer.convert_ids_to_tokens(ids)


def test_tokenizer_never_sees_heldout_text(tiny_data, monkeypatch):
    seen_texts = []
    train = lab_data.train_tokenizer

    def spy(texts, move_strings, vocab_size):
        seen_texts.extend(texts)
        return train(seen_texts, move_strings, vocab_size)

    monkeypatch.setattr(lab_data, "train_tokenizer", spy)
    build_tokenizer(tiny_data, vocab_size=300)
    heldout_fen = HELDOUT.start_board().fen()
    assert seen_texts and not any(heldout_fen in t for t in seen_texts)
    assert any(TRAIN.start_board().fen() in t for t in seen_texts)

    tokenizer = load_tokenizer(tiny_data / "tokenizer")
    shown = legal_move_texts(HELDOUT.start_board())
    assert "Nbd2" in shown and "Nbd2" not in legal_move_texts(TRAIN.start_board())
    assert not _is_token(tokenizer, "Nbd2")  # disambiguated, only in held-out: BPE-split
    assert _is_token(tokenizer, "Rad1")  # disambiguated, shown in a training transcript
    for move in ("Nd2", "Nxd2+", "e4", "exd5", "e8=Q", "gxh1=N+", "O-O-O"):  # enumerated
        assert _is_token(tokenizer, move), move


def test_enumeration_covers_every_undisambiguated_move():
    enumerated = enumerated_move_strings()
    assert len(enumerated) == 1900
    board, seen = chess.Board(), set()
    for fen in (TRAIN.fen, HELDOUT.fen, "r3k2r/1P6/8/3pP3/8/8/6p1/R3K2R w KQkq d6 0 1"):
        board = chess.Board(fen)
        seen |= set(legal_move_texts(board))
        board.push(next(iter(board.legal_moves)))
        seen |= set(legal_move_texts(board))
    missing = seen - enumerated
    assert missing and all(m[0] in "NBRQ" and len(m.rstrip("+").replace("x", "")) >= 4 for m in missing)


def test_iter_lab_puzzles_reads_every_split(tiny_data):
    for split, puzzle in (("train", TRAIN), ("warmup", WARMUP), ("heldout", HELDOUT)):
        assert [p.puzzle_id for p in iter_lab_puzzles(tiny_data, split)] == [puzzle.puzzle_id]
    with pytest.raises(ValueError, match="unknown split"):
        list(iter_lab_puzzles(tiny_data, "test"))


def test_solved_transcript_shows_the_legal_moves():
    messages, moves = solved_transcript(TRAIN)
    assert "Rad1" in moves and messages[-1]["content"].startswith("Checkmate")


def test_shipped_splits_are_disjoint_balanced_and_large_enough(train_puzzles, heldout):
    splits = {"train": train_puzzles, "warmup": list(iter_lab_puzzles("data", "warmup")), "heldout": heldout}
    for split, minimum in (("train", 6000), ("warmup", 4000), ("heldout", 1000)):
        stats = puzzle_stats(splits[split])
        assert stats["count"] >= minimum and stats["mate_in_1"] == stats["mate_in_2"], split
    games = {s: {p.game_url for p in ps} for s, ps in splits.items()}
    positions = {s: {" ".join(p.start_board().fen().split()[:4]) for p in ps} for s, ps in splits.items()}
    names = list(splits)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not games[a] & games[b] and not positions[a] & positions[b], (a, b)
