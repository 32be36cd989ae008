"""Tokenizer and chat template: a small byte-level BPE trained locally, one token per move string.

The chat template renders system/user/assistant/tool turns with ChatML-style special tokens and
tool calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; an assistant turn ends
with `<|im_end|>`, the engine's stop token. Move strings are added tokens (`single_word`), so a
move in the legal-move list and the same move as a tool argument are the same token id.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

IM_START, IM_END, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END, TOOL_CALL_OPEN, TOOL_CALL_CLOSE]

CHAT_TEMPLATE = (
    # No whitespace control: every newline below is part of the rendering.
    "{% if tools and messages[0].role != 'system' %}"
    "<|im_start|>system\n# Tools\n<tools>{{ tools | tojson }}</tools><|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}"
    "<|im_start|>system\n{{ m.content }}"
    "{% if tools %}\n\n# Tools\n<tools>{{ tools | tojson }}</tools>{% endif %}"
    "<|im_end|>\n"
    "{% elif m.role == 'assistant' %}"
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


def train_tokenizer(
    texts: Iterable[str], move_strings: Iterable[str], vocab_size: int = 1024
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts`, then add one token per move string."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken(m, single_word=True, normalized=False) for m in sorted(set(move_strings))])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=IM_END,
        pad_token=PAD,
        additional_special_tokens=[IM_START, TOOL_CALL_OPEN, TOOL_CALL_CLOSE],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def tool_call_prefix(tool_name: str) -> str:
    """The text the template renders before a tool call's argument object's first value."""
    return f'{TOOL_CALL_OPEN}{{"name": "{tool_name}", "arguments": '


def parse_assistant_text(text: str, call_id_prefix: str = "call") -> dict:
    """An OpenAI-style assistant message from completion text: content plus any tool calls
    (ids `<call_id_prefix>_<i>`). A tool call whose JSON does not parse keeps its raw text as arguments."""
    text = text.removesuffix(IM_END)
    content, calls = text, []
    while TOOL_CALL_OPEN in content and TOOL_CALL_CLOSE in content:
        head, _, rest = content.partition(TOOL_CALL_OPEN)
        body, _, tail = rest.partition(TOOL_CALL_CLOSE)
        content = head + tail
        try:
            obj = json.loads(body)
            name, args = obj["name"], json.dumps(obj.get("arguments", {}))
        except (json.JSONDecodeError, KeyError, TypeError):
            name, args = "", body
        calls.append(
            {
                "id": f"{call_id_prefix}_{len(calls)}",
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
        )
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message
