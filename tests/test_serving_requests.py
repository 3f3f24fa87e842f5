"""Request bodies as pydantic models (tasks/serving/requests.py): each bad field is a 400 in OpenAI's shape that
names the field in `param` and in the message, without a server (tests/test_serving.py runs them over HTTP)."""

from __future__ import annotations

import pytest

from tasks.serving.requests import ApiError, ChatRequest, CompletionRequest, parse_body

BASE = {"model": "m", "prompt": "Hi"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}

BAD = [
    # (body, chat, param, words in the message)
    ({**BASE, "n": 0}, False, "n", "between 1 and 16, got 0"),
    ({**BASE, "n": 2.5}, False, "n", "integer"),
    ({**BASE, "seed": "x"}, False, "seed", "integer, got a string"),
    ({**BASE, "seed": True}, False, "seed", "integer, got a boolean"),
    ({**BASE, "temperature": float("nan")}, False, "temperature", "finite"),
    ({**BASE, "temperature": 3}, False, "temperature", "between 0 and 2"),
    ({**BASE, "top_p": 0}, False, "top_p", "above 0 and at most 1"),
    ({**BASE, "top_k": -2}, False, "top_k", "at least -1"),
    ({**BASE, "logprobs": 21}, False, "logprobs", "between 0 and 20"),
    ({**BASE, "stream": "yes"}, False, "stream", "true or false"),
    ({**BASE, "stop": 3}, False, "stop", "string or an array of strings"),
    ({**BASE, "stop": ["a", "b", "c", "d", "e"]}, False, "stop", "at most 4"),
    ({**BASE, "stream_options": {"include_usage": True}}, False, "stream_options", "stream: true"),
    ({**BASE, "stream": True, "stream_options": 3}, False, "stream_options", "object"),
    ({**BASE, "presence_penalty": 0.5}, False, "presence_penalty", "not supported"),
    ({**BASE, "response_format": {"type": "json_object"}}, False, "response_format", "text"),
    ({**CHAT, "messages": []}, True, "messages", "non-empty"),
    ({**CHAT, "messages": [3]}, True, "messages[0]", "object"),
    ({**CHAT, "messages": [{"role": "robot", "content": "x"}]}, True, "messages[0].role", "'robot'"),
    ({**CHAT, "messages": [{"role": "user", "content": 5}]}, True, "messages[0].content", "a number"),
    (
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        True,
        "messages[0].content[0]",
        "text parts",
    ),
    (
        {**CHAT, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
        True,
        "messages[1].role",
        "the user's",
    ),
    ({**CHAT, "echo": True}, True, "echo", "chat"),
    ({**CHAT, "top_logprobs": 2}, True, "top_logprobs", "logprobs: true"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, True, "top_logprobs", "between 0 and 20"),
    ({"prompt": "x"}, False, "model", "required"),
]


@pytest.mark.parametrize("body,chat,param,words", BAD, ids=[b[2] + "-" + b[3][:12] for b in BAD])
def test_a_bad_field_is_a_400_naming_it(body, chat, param, words):
    with pytest.raises(ApiError) as exc:
        parse_body(body, chat=chat)
    e = exc.value
    assert (e.status, e.param, e.type) == (400, param, "invalid_request_error")
    assert words in e.message and param in e.message, e.message
    assert e.body()["error"]["param"] == param


def test_good_bodies_parse_and_null_is_the_default():
    req = parse_body(
        {
            **BASE,
            "n": 2.0,
            "temperature": 0,
            "top_p": None,
            "stop": ["\n", ""],
            "user": "u",
            "presence_penalty": 0,
            "tool_choice": "none",
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        chat=False,
    )
    assert isinstance(req, CompletionRequest)
    assert (req.n, req.temperature, req.top_p, req.stops, req.stream_options.include_usage) == (
        2,
        0.0,
        1.0,
        ["\n"],
        True,
    )
    chat = parse_body(
        {
            **CHAT,
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "user", "content": "q"},
            ],
            "logprobs": True,
            "top_logprobs": 3,
        },
        chat=True,
    )
    assert isinstance(chat, ChatRequest)
    assert [m.turn for m in chat.messages] == [("system", "ab"), ("user", "q")] and chat.top_logprobs == 3


def test_a_body_that_is_not_an_object():
    with pytest.raises(ApiError, match="JSON object, got an array"):
        parse_body([1, 2], chat=False)
