"""Tokenizers and chat templates of the lab's two modes (`chess_env.Mode`), small byte-level BPEs
trained locally.

Both templates render system/user/assistant/tool turns with ChatML-style special tokens and tool
calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; an assistant turn ends with
`<|im_end|>`, the engine's stop token.

- structured (`train_tokenizer`, `CHAT_TEMPLATE`): move strings are added tokens (`single_word`),
  so a move in the legal-move list and the same move as a tool argument are the same token id.
- free_text (`train_free_text_tokenizer`, `FREE_TEXT_TEMPLATE`): no move is a token. A digit is a
  piece of its own, with the check sign after it (`8+`), and so are spaces, `=`, `-` and other `+`:
  every SAN move spans at least its letters and its rank, and is spelled alike in the list, the
  checks line, the reasoning and the argument. The BPE merges letters (`Bx`, `xf`, `Bxf`), so a move
  has several spellings that decode to it. `<think>`/`</think>` are added, non-special tokens, as in
  Qwen3. The template rewrites history as Qwen3's does: an assistant turn's reasoning (split off at
  `</think>`) is kept only after the last user message, and a call's arguments are rendered from
  their parsed object (`tojson`), never as the text the model wrote.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from prodrl_pipeline.chat.tool_calls import tool_call_format
from prodrl_pipeline.envs.chess_env import THINK_CLOSE, THINK_OPEN

IM_START, IM_END, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END, TOOL_CALL_OPEN, TOOL_CALL_CLOSE]
FREE_TEXT_PIECES = Regex(r"\p{N}[+#]?|\p{L}+|[+=#-]|[^\s\p{L}\p{N}+=#-]+|\s+")
"""The free-text tokenizer's pre-tokens, within which BPE merges: a digit with the check sign after
it, a run of letters, one of `+=#-`, a run of other punctuation, a run of whitespace. A move is then
its letters (`Qxe`: one token or several) and its rank with the check (`8+`, or `8` `+`): never one
token, mostly two (castling is `O|-|O`, a promotion `e|8|=|Q`)."""

_SYSTEM_TURNS = (
    # A tools block of its own unless the first turn is a system turn, which then holds it.
    "{% if tools and messages[0].role != 'system' %}"
    "<|im_start|>system\n# Tools\n<tools>{{ tools | tojson }}</tools><|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}"
    "<|im_start|>system\n{{ m.content }}"
    "{% if tools %}\n\n# Tools\n<tools>{{ tools | tojson }}</tools>{% endif %}"
    "<|im_end|>\n"
)
"""Both templates' opening: the tools, then the turn loop and its system turns."""

CHAT_TEMPLATE = (
    # No whitespace control: every newline below is part of the rendering.
    _SYSTEM_TURNS + "{% elif m.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for tc in m.tool_calls or [] %}"
    '<tool_call>{"name": "{{ tc.function.name }}", "arguments": '
    "{% if tc.function.arguments is string %}{{ tc.function.arguments }}"
    "{% else %}{{ tc.function.arguments | tojson }}{% endif %}"
    "}</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

FREE_TEXT_TEMPLATE = (
    # CHAT_TEMPLATE with Qwen3's rules for assistant turns (module docstring).
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}"
    "{% endfor %}" + _SYSTEM_TURNS + "{% elif m.role == 'assistant' %}"
    "{% set content = m.content or '' %}{% set thought = '' %}"
    "{% if '</think>' in content %}"
    "{% set thought = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{% endif %}"
    "<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_user and thought %}<think>{{ thought }}</think>{% endif %}"
    "{{ content }}"
    "{% for tc in m.tool_calls or [] %}"
    '<tool_call>{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}'
    "</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _bpe(texts: Iterable[str], vocab_size: int, pre_tokenizer: pre_tokenizers.PreTokenizer) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def _fast(tok: Tokenizer, chat_template: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=IM_END,
        pad_token=PAD,
        additional_special_tokens=[IM_START, TOOL_CALL_OPEN, TOOL_CALL_CLOSE],
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
    )


def train_tokenizer(
    texts: Iterable[str], move_strings: Iterable[str], vocab_size: int = 1024
) -> PreTrainedTokenizerFast:
    """The structured mode's: a byte-level BPE on `texts`, then one added token per move string."""
    tok = _bpe(texts, vocab_size, pre_tokenizers.ByteLevel(add_prefix_space=False))
    tok.add_tokens([AddedToken(m, single_word=True, normalized=False) for m in sorted(set(move_strings))])
    return _fast(tok, CHAT_TEMPLATE)


def train_free_text_tokenizer(texts: Iterable[str], vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """The free-text mode's: a byte-level BPE on `texts` merging only within `FREE_TEXT_PIECES`,
    then `<think>` and `</think>` as added tokens."""
    pieces = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(FREE_TEXT_PIECES, behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok = _bpe(texts, vocab_size, pieces)
    tok.add_tokens([AddedToken(t, normalized=False) for t in (THINK_OPEN, THINK_CLOSE)])
    return _fast(tok, FREE_TEXT_TEMPLATE)


def tool_call_prefix(tool_name: str) -> str:
    """The text the template renders before a tool call's argument object's first value."""
    return f'{TOOL_CALL_OPEN}{{"name": "{tool_name}", "arguments": '


def parse_assistant_text(tokenizer: PreTrainedTokenizerBase, text: str, call_id_prefix: str = "call") -> dict:
    """An OpenAI-style assistant message from a completion's text, as the gateway parses a reply:
    the tokenizer template's own call format (`chat.tool_calls`; ids `<call_id_prefix>_<i>`). A
    call whose JSON does not parse keeps its raw text as arguments, with an empty name."""
    fmt = tool_call_format(tokenizer)
    if fmt is None:
        raise ValueError("the tokenizer's chat template renders no tool calls")
    return fmt.parse(text.removesuffix(tokenizer.eos_token), call_id_prefix)
