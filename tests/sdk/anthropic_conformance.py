"""Conformance of the IOP Edge with the official Anthropic Python SDK (`/v1/messages`).

Starts the quickstart system (examples/edge.toml and examples/node.toml, on free ports)
with a client key, a key with a spent budget, a key at one request a minute, and a few
extra mock adapters: one that fails mid-answer, one that serves the Messages API itself
(its requests pass through untranslated), and a model whose node never connects (no
capacity: 529). Then drives both example models with the `anthropic` package: create,
stream (`text_stream` equals `get_final_message()`), tools and tool results (streamed
`input_json_delta` included), system forms, multi-turn, stop sequences, max_tokens,
count_tokens, model listing, and each error mapped to its SDK exception. Every stream is
also read raw and checked against the grammar the SDKs enforce.
"""

import json
import pathlib
import sys
import urllib.request

import anthropic

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "py"))
from iop_system import Checks, System  # noqa: E402

KEY = "sk-anthropic-conformance"
SPENT = "sk-anthropic-spent"
LIMITED = "sk-anthropic-limited"
MODELS = ["mock-chat", "mock-api"]
REPLY = "Hello from IOP!"
TOOLS = [{
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                     "required": ["city"]},
}]
BILLING = "x-anthropic-billing-header: cc_version=2.0.1.abc; cc_entrypoint=cli; cch=12345;"


def configure(edge):
    edge = edge.replace("api_keys = []", f'api_keys = ["{KEY}"]')
    edge = edge.replace("wait_timeout_ms = 30000", "wait_timeout_ms = 1500")
    extra_adapters = (
        '[[nodes.adapters]]\nname = "flaky"\ntype = "mock"\ncapacity = 4\ntargets = ["mock-small"]\n'
        '[nodes.adapters.options]\nreply = "one two three four five six"\ntoken_delay_ms = "5"\nfail = "after:3"\n\n'
        '[[nodes.adapters]]\nname = "native"\ntype = "mock"\ncapacity = 4\ntargets = ["mock-small"]\n'
        '[nodes.adapters.options]\ndispatch = "tunnel"\nnative_messages = "true"\ntool_call = "get_weather"\n'
        'reply = "Hello from IOP! Passed through untranslated."\ntoken_delay_ms = "5"\n\n'
        '[[nodes]]\nid = "node-offline"\ntoken = "offline-token-never-used"\n'
        '[[nodes.adapters]]\nname = "mock"\ntype = "mock"\ncapacity = 1\ntargets = ["mock-small"]\n\n'
        "[[models]]"
    )
    edge = edge.replace("[[models]]", extra_adapters, 1)
    # The first [[nodes]] table keeps its adapters; the extra ones above went into the
    # node-1 table, the offline node follows them.
    return edge + (
        '\n[[models]]\nname = "mock-flaky"\nproviders = [{ node = "node-1", adapter = "flaky", target = "mock-small" }]\n'
        '\n[[models]]\nname = "mock-native"\ndisplay_name = "Mock (native Messages)"\n'
        'providers = [{ node = "node-1", adapter = "native", target = "mock-small" }]\n'
        '\n[[models]]\nname = "mock-offline"\nproviders = [{ node = "node-offline", adapter = "mock", target = "mock-small" }]\n'
        '\n[[models]]\nname = "mock-small-context"\ncontext_tokens = 50\n'
        'providers = [{ node = "node-1", adapter = "mock", target = "mock-small" }]\n'
        f'\n[[auth.keys]]\nname = "spent"\nkey = "{SPENT}"\ntoken_budget = 1\n'
        f'\n[[auth.keys]]\nname = "limited"\nkey = "{LIMITED}"\nrequests_per_minute = 1\n'
    )


def raw_events(base, body, key=KEY):
    """The raw SSE frames of a streamed request: (event line, data object) pairs, in order,
    with any frame lacking an `event:` line kept as (None, data)."""
    req = urllib.request.Request(
        f"{base}/v1/messages", data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "x-api-key": key, "anthropic-version": "2023-06-01"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream"), r.headers
        text = r.read().decode()
    frames = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        event, data = None, None
        for line in block.split("\n"):
            if line.startswith("event:"):
                event = line[len("event:"):].strip()
            elif line.startswith("data:"):
                data = json.loads(line[len("data:"):].strip())
        frames.append((event, data))
    return frames


def check_grammar(frames):
    """The stream grammar the SDKs and Claude Code enforce; returns the reassembled
    message."""
    assert frames, "no frames"
    assert all(event is not None and data is not None and data["type"] == event for event, data in frames), frames
    kinds = [event for event, _ in frames if event != "ping"]
    assert kinds[0] == "message_start", kinds
    assert kinds[-2:] == ["message_delta", "message_stop"], kinds
    assert kinds.count("message_start") == 1 and kinds.count("message_delta") == 1, kinds
    assert "[DONE]" not in json.dumps(frames)
    message = frames[0][1]["message"]
    blocks, open_index, partial = [], None, {}
    for event, data in frames[1:]:
        if event == "content_block_start":
            assert open_index is None, f"block {data['index']} opened inside {open_index}"
            assert data["index"] == len(blocks), f"index {data['index']} after {len(blocks)} blocks"
            blocks.append(data["content_block"])
            open_index = data["index"]
        elif event == "content_block_delta":
            assert data["index"] == open_index, (data, open_index)
            delta = data["delta"]
            if delta["type"] == "text_delta":
                blocks[open_index]["text"] += delta["text"]
            elif delta["type"] == "input_json_delta":
                partial[open_index] = partial.get(open_index, "") + delta["partial_json"]
            elif delta["type"] == "thinking_delta":
                blocks[open_index]["thinking"] += delta["thinking"]
        elif event == "content_block_stop":
            assert data["index"] == open_index, (data, open_index)
            if open_index in partial:
                blocks[open_index]["input"] = json.loads(partial[open_index])
            open_index = None
        elif event == "message_delta":
            assert open_index is None, "message_delta inside a block"
            assert data["delta"]["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use"), data
            message["stop_reason"] = data["delta"]["stop_reason"]
            message["stop_sequence"] = data["delta"]["stop_sequence"]
            message["usage"].update(data["usage"])
    message["content"] = blocks
    return message


def main():
    system = System(configure, ready_key=KEY)
    checks = Checks()
    base = system.base
    try:
        client = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0)
        hello = [{"role": "user", "content": "Hello"}]

        def create(model):
            m = client.messages.create(model=model, max_tokens=256, messages=hello)
            assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_"), m
            assert m.model == model, m.model
            assert m.content[0].type == "text" and m.content[0].text.startswith(REPLY), m.content
            assert m.stop_reason == "end_turn" and m.stop_sequence is None, m
            assert m.usage.input_tokens > 0 and m.usage.output_tokens > 0, m.usage

        def stream(model):
            with client.messages.stream(model=model, max_tokens=256, messages=hello) as s:
                text = "".join(s.text_stream)
                final = s.get_final_message()
            assert text.startswith(REPLY), text
            assert final.content[0].text == text, (final.content, text)
            assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0, final
            whole = client.messages.create(model=model, max_tokens=256, messages=hello)
            assert whole.content[0].text == text and whole.stop_reason == final.stop_reason

        def raw_grammar(model):
            for body in (
                {"model": model, "max_tokens": 256, "messages": hello, "stream": True},
                {"model": model, "max_tokens": 256, "stream": True, "tools": TOOLS,
                 "messages": [{"role": "user", "content": "Weather in Paris?"}]},
                {"model": model, "max_tokens": 2, "messages": hello, "stream": True},
            ):
                message = check_grammar(raw_events(base, body))
                whole = client.messages.create(**{k: v for k, v in body.items() if k != "stream"})
                # Tool call ids are per request; everything else is the same.
                def same(blocks):
                    return [{k: v for k, v in b.items() if k != "id"} for b in blocks]
                assert same(b.model_dump(exclude_none=True) for b in whole.content) == same(message["content"]), \
                    (whole.content, message["content"])
                assert whole.stop_reason == message["stop_reason"], (whole, message)

        def tools(model):
            m = client.messages.create(model=model, max_tokens=256, tools=TOOLS,
                                       messages=[{"role": "user", "content": "Weather in Paris?"}])
            assert m.stop_reason == "tool_use", m
            call = [b for b in m.content if b.type == "tool_use"][0]
            assert call.name == "get_weather" and call.id, call
            assert call.input == {"city": "example", "days": 1}, call.input
            # Streamed: the input arrives as input_json_delta pieces that make the same JSON.
            pieces = []
            with client.messages.stream(model=model, max_tokens=256, tools=TOOLS,
                                        messages=[{"role": "user", "content": "Weather in Paris?"}]) as s:
                for event in s:
                    if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                        pieces.append(event.delta.partial_json)
                final = s.get_final_message()
            assert json.loads("".join(pieces)) == call.input, pieces
            streamed = [b for b in final.content if b.type == "tool_use"][0]
            assert streamed.input == call.input and final.stop_reason == "tool_use", final
            # The result goes back; the model answers it with text.
            for is_error in (False, True):
                answer = client.messages.create(model=model, max_tokens=256, tools=TOOLS, messages=[
                    {"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                  "content": "sunny, 21 C", "is_error": is_error}]},
                ])
                assert answer.stop_reason == "end_turn" and answer.content[0].text.startswith(REPLY), answer
            # tool_choice: a named tool, and none.
            forced = client.messages.create(model=model, max_tokens=256, tools=TOOLS,
                                            tool_choice={"type": "tool", "name": "get_weather"},
                                            messages=[{"role": "user", "content": "Weather?"}])
            assert forced.stop_reason == "tool_use", forced
            none = client.messages.create(model=model, max_tokens=256, tools=TOOLS, tool_choice={"type": "none"},
                                          messages=[{"role": "user", "content": "Weather?"}])
            assert none.stop_reason == "end_turn" and none.content[0].type == "text", none

        def system_forms(model):
            for system in ("You are terse.", [{"type": "text", "text": "You are terse."}],
                           [{"type": "text", "text": BILLING}, {"type": "text", "text": "You are terse.",
                                                                "cache_control": {"type": "ephemeral"}}]):
                m = client.messages.create(model=model, max_tokens=64, system=system, messages=hello)
                assert m.content[0].text.startswith(REPLY), m

        def multi_turn(model):
            m = client.messages.create(model=model, max_tokens=64, messages=[
                {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": [{"type": "text", "text": "Hi."}]},
                {"role": "user", "content": [{"type": "text", "text": "Again?"}, {"type": "text", "text": "Please."}]},
            ])
            assert m.content[0].text.startswith(REPLY), m

        def stop_sequences(model):
            m = client.messages.create(model=model, max_tokens=256, stop_sequences=["IOP", "never"], messages=hello)
            assert m.stop_reason == "stop_sequence" and m.stop_sequence == "IOP", m
            assert m.content[0].text == "Hello from ", m.content
            with client.messages.stream(model=model, max_tokens=256, stop_sequences=["IOP"], messages=hello) as s:
                text = "".join(s.text_stream)
                final = s.get_final_message()
            assert text == "Hello from " and final.stop_reason == "stop_sequence" and final.stop_sequence == "IOP"

        def max_tokens(model):
            m = client.messages.create(model=model, max_tokens=3, messages=hello)
            assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3, m
            assert m.content[0].text == REPLY, m.content

        def count_tokens(model):
            short = client.messages.count_tokens(model=model, messages=hello)
            longer = client.messages.count_tokens(model=model, messages=[
                {"role": "user", "content": "Hello " * 200}], system="You are terse.", tools=TOOLS)
            assert 0 < short.input_tokens < longer.input_tokens, (short, longer)
            # Claude Code's attribution line is dropped before any provider sees the prompt.
            plain = client.messages.count_tokens(model=model, messages=hello, system="You are terse.")
            billed = client.messages.count_tokens(model=model, messages=hello, system=[
                {"type": "text", "text": BILLING}, {"type": "text", "text": "You are terse."}])
            assert plain.input_tokens == billed.input_tokens, (plain, billed)
            if model == "mock-api":
                # Its provider tokenizes (vLLM's /tokenize): the count is exact, the figure
                # its answer's usage reports, also past the 64 KiB of token ids kept.
                for messages in (hello, [{"role": "user", "content": "Hello " * 20000}]):
                    counted = client.messages.count_tokens(model=model, messages=messages)
                    made = client.messages.create(model=model, max_tokens=4, messages=messages)
                    assert counted.input_tokens == made.usage.input_tokens, (counted, made.usage)

        def models():
            listed = {m.id: m for m in client.models.list()}
            assert "mock-chat" in listed and "mock-api" in listed, listed
            assert listed["mock-native"].display_name == "Mock (native Messages)", listed["mock-native"]
            assert listed["mock-chat"].display_name == "mock-chat"

        def native():
            m = client.messages.create(model="mock-native", max_tokens=256, messages=hello)
            assert m.id.startswith("msg_native_"), m.id
            assert m.content[0].text.startswith("Hello from IOP! Passed through"), m
            with client.messages.stream(model="mock-native", max_tokens=256, tools=TOOLS,
                                        messages=[{"role": "user", "content": "Weather?"}]) as s:
                final = s.get_final_message()
            assert final.id.startswith("msg_native_") and final.stop_reason == "tool_use", final
            check_grammar(raw_events(base, {"model": "mock-native", "max_tokens": 64, "messages": hello,
                                            "stream": True}))

        def expect(exc, fn, status, kind):
            try:
                fn()
            except exc as err:
                assert err.status_code == status, (err.status_code, err)
                assert err.type == kind, (err.type, err.body)
                assert err.request_id, "no request-id header"
                assert err.body["type"] == "error" and err.body["request_id"] == err.request_id, err.body
                return err
            raise AssertionError(f"no {exc.__name__}")

        def post(body, key=KEY):
            return client.with_options(api_key=key).post("/v1/messages", body=body,
                                                         cast_to=anthropic.types.Message)

        def errors():
            expect(anthropic.NotFoundError, lambda: client.messages.create(
                model="no-such-model", max_tokens=8, messages=hello), 404, "not_found_error")
            bad = anthropic.Anthropic(base_url=base, api_key="sk-wrong", max_retries=0)
            expect(anthropic.AuthenticationError, lambda: bad.messages.create(
                model="mock-chat", max_tokens=8, messages=hello), 401, "authentication_error")
            bearer = anthropic.Anthropic(base_url=base, auth_token=KEY, max_retries=0)
            assert bearer.messages.create(model="mock-chat", max_tokens=8, messages=hello).content
            err = expect(anthropic.BadRequestError, lambda: post({"model": "mock-chat", "messages": hello}),
                         400, "invalid_request_error")
            assert "max_tokens" in err.message, err.message
            for broken in (
                [{"role": "user", "content": [{"type": "video", "url": "x"}]}],
                [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "[1"}]}],
                [{"role": "system", "content": "hi"}],
                "not a list",
            ):
                expect(anthropic.BadRequestError,
                       lambda b=broken: post({"model": "mock-chat", "max_tokens": 8, "messages": b}),
                       400, "invalid_request_error")
            err = expect(anthropic.BadRequestError, lambda: client.messages.create(
                model="mock-small-context", max_tokens=8, messages=[{"role": "user", "content": "word " * 400}]),
                400, "invalid_request_error")
            assert err.api_message.startswith("prompt is too long: ") and err.api_message.endswith(
                " tokens > 50 maximum"), err.api_message
            expect(anthropic.APIStatusError, lambda: post(
                {"model": "mock-chat", "max_tokens": 8, "messages": [{"role": "user", "content": "x" * (9 << 20)}]}),
                413, "request_too_large")
            expect(anthropic.OverloadedError, lambda: client.messages.create(
                model="mock-offline", max_tokens=8, messages=hello), 529, "overloaded_error")

        def rate_limits():
            limited = anthropic.Anthropic(base_url=base, api_key=LIMITED, max_retries=0)
            limited.messages.create(model="mock-chat", max_tokens=8, messages=hello)
            err = expect(anthropic.RateLimitError, lambda: limited.messages.create(
                model="mock-chat", max_tokens=8, messages=hello), 429, "rate_limit_error")
            assert 0 < int(err.response.headers["retry-after"]) <= 60, err.response.headers
            spent = anthropic.Anthropic(base_url=base, api_key=SPENT, max_retries=0)
            # The first request spends the one-token budget; the next is refused.
            spent.messages.create(model="mock-chat", max_tokens=8, messages=hello)
            err = expect(anthropic.RateLimitError, lambda: spent.messages.create(
                model="mock-chat", max_tokens=8, messages=hello), 429, "rate_limit_error")
            assert err.response.headers["x-should-retry"] == "false", err.response.headers

        def in_stream_error():
            text = ""
            try:
                with client.messages.stream(model="mock-flaky", max_tokens=64, messages=hello) as s:
                    for piece in s.text_stream:
                        text += piece
            except anthropic.APIStatusError as err:
                assert err.body["type"] == "error" and err.body["error"]["type"] == "api_error", err.body
                assert text == "one two three ", text
                frames = []
                try:
                    frames = raw_events(base, {"model": "mock-flaky", "max_tokens": 64, "messages": hello,
                                               "stream": True})
                except Exception:  # noqa: BLE001 - a cut stream may end the read with an error
                    pass
                kinds = [e for e, _ in frames]
                assert kinds and kinds[-1] == "error" and "message_stop" not in kinds, kinds
                return
            raise AssertionError("the stream ended without an error")

        for model in MODELS:
            for name, fn in [
                ("messages.create", create),
                ("messages.stream: text_stream equals get_final_message()", stream),
                ("raw stream grammar, reassembled equals the whole answer", raw_grammar),
                ("tools, tool results and tool_choice (streamed input_json_delta included)", tools),
                ("system as a string, as blocks, with Claude Code's attribution line", system_forms),
                ("multi-turn", multi_turn),
                ("stop_sequences", stop_sequences),
                ("max_tokens", max_tokens),
                ("messages.count_tokens", count_tokens),
            ]:
                checks.run(f"{name} [{model}]", lambda fn=fn, model=model: fn(model))
        for name, fn in [
            ("models.list with display_name", models),
            ("a provider serving /v1/messages itself: passed through", native),
            ("errors map to the SDK's exceptions (404, 401, 400, 413, 529; Bearer works too)", errors),
            ("rate limits: 429 with an integer retry-after; a spent budget says x-should-retry: false",
             rate_limits),
            ("a failure after the first byte is an error event, never a message_stop", in_stream_error),
        ]:
            checks.run(name, fn)
    finally:
        system.stop()
        if checks.failed:
            print(system.log_tails(20_000))
    print(f"anthropic: {checks.passed} passed, {checks.failed} failed")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
