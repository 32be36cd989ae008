"""A family's tool-call format read off its template: replies parsed so that, re-sent as history, they
render as they were generated."""

from types import SimpleNamespace
from unittest.mock import patch

from prodrl_pipeline.chat import tool_calls
from prodrl_pipeline.chat.render import render_ids
from prodrl_pipeline.chat.tool_calls import _DECODER, call_ids, tool_call_format
from tests.families import family_tokenizer


def test_a_qwen3_reply_with_text_and_two_calls_re_renders_as_generated():
    tok = family_tokenizer("qwen3")
    fmt = tool_call_format(tok)
    assert fmt is not None and fmt.separator == "\n" and fmt.open_marker == "<tool_call>"
    generated = (
        'Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>'
        '\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
    )
    message = fmt.parse(generated)
    assert message["content"] == "Sure."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("a", '{"x": 1}'),
        ("b", "{}"),
    ]
    history = [
        {"role": "user", "content": "u"},
        message,
        {"role": "tool", "tool_call_id": "call_0", "content": "r"},
    ]
    rendered = tok.apply_chat_template(history, tokenize=False)
    assert f"<|im_start|>assistant\n{generated}<|im_end|>" in rendered


def test_a_call_that_does_not_match_the_format_keeps_its_text_with_no_name():
    fmt = tool_call_format(family_tokenizer("qwen3"))
    message = fmt.parse("<tool_call>\nnot json\n</tool_call>")
    assert message["tool_calls"][0]["function"] == {
        "name": "",
        "arguments": "<tool_call>\nnot json\n</tool_call>",
    }


def test_a_call_nested_past_the_recursion_limit_keeps_its_text():
    fmt = tool_call_format(family_tokenizer("qwen3"))
    deep = "<tool_call>\n" + "[" * 100_000 + "\n</tool_call>"
    assert fmt.parse(deep)["tool_calls"][0]["function"] == {"name": "", "arguments": deep}


def test_a_llama3_call_is_bare_json_whose_nested_braces_stay_inside_it():
    """Llama 3.2's format has no marker: `{"name": ..., "parameters": {...}}`. A call ends at the
    closing brace after which it is whole JSON; text that does not match stays content."""
    tok = family_tokenizer("llama3_2")
    fmt = tool_call_format(tok)
    assert fmt is not None and fmt.open_marker is None and fmt.call_start == '{"name": "'
    the_call = '{"name": "get_weather", "parameters": {"city": "Oslo", "at": {"h": 9}}}'
    generated = f'On it. {the_call} {{"name": "x"}}'
    message = fmt.parse(generated)
    assert message["content"] == 'On it.  {"name": "x"}'
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo", "at": {"h": 9}}'}
    history = [{"role": "user", "content": "u"}, {**message, "content": None}]
    forced = call_ids(tok, "get_weather", call["function"]["arguments"])
    assert tok.decode(forced) == the_call + "<|eot_id|>"
    assert fmt.parse(tok.decode(forced[:-1]))["tool_calls"][0]["function"] == call["function"]
    assert render_ids(tok, history, add_generation_prompt=False)[-len(forced) :] == list(forced)


def test_bare_json_that_is_not_a_whole_call_stays_content():
    """A call cut short (max_tokens), JSON that only has "name" and "parameters" keys among others,
    or a name that is not a plain name, is no call: the text stays content, whole."""
    fmt = tool_call_format(family_tokenizer("llama3_2"))
    for text in (
        '{"name": "get_weather", "parameters": {"city": "Oslo"}',
        'Result: {"name": "Ann", "parameters": {"age": 3}, "x": [1]}',
        '{"name": "a\\"b", "parameters": {}}',
        '{"name": "get_weather", "parameters":  {}}',
    ):
        assert fmt.parse(text) == {"role": "assistant", "content": text}, text


def test_parsing_is_linear_in_the_reply():
    """A long reply full of call starts that are not calls (a JSON list of records with a "name"
    key) is parsed with work linear in its length: the JSON decoder's characters read, counted."""
    fmt = tool_call_format(family_tokenizer("llama3_2"))
    reads = []
    decode = _DECODER.raw_decode

    def counted(text, start):  # noqa: ANN001, ANN202
        obj, end = decode(text, start)
        reads.append(end - start)
        return obj, end

    for n in (200, 800):
        reads.clear()
        records = ", ".join(f'{{"name": "r{i}", "parameters": {{"k": [{i}]}}, "x": 1}}' for i in range(n))
        text = f"[{records}]"
        with patch.object(tool_calls, "_DECODER", SimpleNamespace(raw_decode=counted)):
            assert fmt.parse(text) == {"role": "assistant", "content": text}
        assert len(reads) == n and sum(reads) < 2 * len(text)  # each record's arguments read once
