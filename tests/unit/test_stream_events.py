"""The check of a pod's stream, event by event (gateway/proxy/events.py)."""

from __future__ import annotations

import pytest

from gateway.proxy.events import EventCheck

OK = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
ERROR = b'data: {"error": {"message": "engine failed", "code": 500}}\n\n'


def test_whole_events_pass_as_they_complete_and_a_cut_one_waits_for_its_end():
    check = EventCheck()
    assert check.chunk(OK + OK[:10]) == OK
    assert check.chunk(OK[10:] + b"data: [DONE]\n\n") == OK + b"data: [DONE]\n\n"
    assert not check.engine_error and not check.malformed


@pytest.mark.parametrize("error", [
    ERROR,  # vLLM's, on an OpenAI route
    b'event: error\ndata: {"type": "error", "error": {"type": "api_error", "message": "x"}}\n\n',  # Anthropic's
    b'data: {"type": "error", "message": "x"}\n\n',  # the Responses API's
])
def test_an_engines_error_event_is_passed_on_and_told(error):
    check = EventCheck()
    assert check.chunk(OK + error + b"data: [DONE]\n\n") == OK + error + b"data: [DONE]\n\n"
    assert check.engine_error and not check.malformed


@pytest.mark.parametrize("bad", [b"data: {not json\n\n", b"data: x\r\n\r\n", b'data: {"a":\ndata: 1\n\n'])
def test_an_event_that_is_not_json_is_held_back_with_everything_after_it(bad):
    check = EventCheck()
    assert check.chunk(OK + bad + OK) == OK
    assert check.malformed


def test_a_multi_line_data_event_is_joined_as_sse_says_and_a_last_unfinished_event_is_checked():
    check = EventCheck()
    assert check.chunk(b'data: {"a":\ndata: 1}\n\n') == b'data: {"a":\ndata: 1}\n\n'
    assert check.chunk(b'data: {"b": 2}') == b""
    assert check.rest() == b'data: {"b": 2}' and not check.malformed
    assert check.chunk(b"data: {oops") == b"" and check.rest() == b"" and check.malformed


def test_a_chunk_of_many_events_with_both_line_ends_is_cut_event_by_event():
    crlf = OK.replace(b"\n", b"\r\n")
    events = [OK, crlf] * 300 + [ERROR]
    check = EventCheck()
    assert check.chunk(b"".join(events) + b"data: {cut") == b"".join(events)
    assert check.engine_error and not check.malformed
    # A malformed event deep in such a chunk still stops it exactly there.
    check = EventCheck()
    assert check.chunk(b"".join(events[:401]) + b"data: {bad\r\n\r\n" + OK) == b"".join(events[:401])
    assert check.malformed
