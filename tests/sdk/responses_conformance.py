"""Conformance of the IOP Edge with the official OpenAI Python SDK's Responses API
(`client.responses`, `POST /v1/responses`).

Starts the quickstart system (examples/edge.toml and examples/node.toml, on free ports)
with a client key, a second key, and a mock adapter that fails mid-answer. Then drives
both example models with `client.responses.create` and `client.responses.stream`: text,
instructions, item input, a multi-turn transcript with `store: false`, a function tool
round trip (streamed argument deltas included), `max_output_tokens` -> incomplete,
errors mapped to the SDK's exceptions, a three-turn `previous_response_id` chain, and
retrieve and delete. Every stream is also read raw and checked against the rules Codex
relies on: `event:` equal to `type`, sequence numbers from 0 without gaps, one
`response.created`, one terminal event, every `output_item.done` equal to its entry in
the terminal response's output, no `[DONE]`.
"""

import json
import pathlib
import sys
import urllib.request

import openai

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "py"))
from iop_system import Checks, System  # noqa: E402

KEY = "sk-responses-conformance"
OTHER = "sk-responses-other"
MODELS = ["mock-chat", "mock-api"]
REPLY = "Hello from IOP!"
TOOLS = [{
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]},
}]
TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def configure(edge):
    edge = edge.replace("api_keys = []", f'api_keys = ["{KEY}"]')
    flaky = (
        '[[nodes.adapters]]\nname = "flaky"\ntype = "mock"\ncapacity = 4\ntargets = ["mock-small"]\n'
        '[nodes.adapters.options]\nreply = "one two three four five six"\ntoken_delay_ms = "5"\nfail = "after:3"\n\n'
        "[[models]]"
    )
    edge = edge.replace("[[models]]", flaky, 1)
    return edge + (
        '\n[[models]]\nname = "mock-flaky"\nproviders = [{ node = "node-1", adapter = "flaky", target = "mock-small" }]\n'
        f'\n[[auth.keys]]\nname = "other"\nkey = "{OTHER}"\n'
    )


def raw_events(base, body):
    """The raw SSE frames of a streamed request: (event line, data object) pairs, in order;
    a `[DONE]` payload is kept as (event, "[DONE]")."""
    req = urllib.request.Request(
        f"{base}/v1/responses", data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream"), r.headers
        text = r.read().decode()
    frames = []
    for block in text.split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        event, data = None, None
        for line in lines:
            if line.startswith("event:"):
                event = line[len("event:"):].strip()
            elif line.startswith("data:"):
                payload = line[len("data:"):].strip()
                data = payload if payload == "[DONE]" else json.loads(payload)
        frames.append((event, data))
    return frames


def check_rules(frames):
    """The stream rules; returns the terminal response."""
    assert frames, "no events"
    assert all(data != "[DONE]" for _, data in frames), "a [DONE] in a Responses stream"
    for i, (event, data) in enumerate(frames):
        assert event == data["type"], f"event {event!r} carries type {data['type']!r}"
        assert data["sequence_number"] == i, f"sequence {data['sequence_number']} at {i}"
    kinds = [e for e, _ in frames]
    assert kinds[0] == "response.created" and kinds[1] == "response.in_progress", kinds[:2]
    assert kinds.count("response.created") == 1, kinds
    assert sum(k in TERMINAL for k in kinds) == 1 and kinds[-1] in TERMINAL, kinds
    final = frames[-1][1]["response"]
    done = [data["item"] for event, data in frames if event == "response.output_item.done"]
    added = [data for event, data in frames if event == "response.output_item.added"]
    assert [a["item"]["id"] for a in added] == [d["id"] for d in done], (added, done)
    assert done == final["output"], (done, final["output"])
    return final


def main():
    system = System(configure, ready_key=KEY)
    checks = Checks()
    base = system.base
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)

        def text(model):
            r = client.responses.create(model=model, input="Hello", store=False)
            assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed", r
            assert r.model == model and r.output_text.startswith(REPLY), r
            assert r.output[0].type == "message" and r.output[0].id.startswith("msg_"), r.output
            assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0, r.usage
            assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens, r.usage

        def stream(model):
            deltas = []
            with client.responses.stream(model=model, input="Hello", store=False) as s:
                for event in s:
                    if event.type == "response.output_text.delta":
                        deltas.append(event.delta)
                final = s.get_final_response()
            assert "".join(deltas) == final.output_text and final.output_text.startswith(REPLY), (deltas, final)
            assert final.status == "completed", final
            whole = client.responses.create(model=model, input="Hello", store=False)
            assert whole.output_text == final.output_text

        def raw_rules(model):
            for body in (
                {"model": model, "input": "Hello", "stream": True, "store": False},
                {"model": model, "input": "Weather in Paris?", "tools": TOOLS, "stream": True, "store": False},
                {"model": model, "input": "Hello", "max_output_tokens": 2, "stream": True, "store": False},
            ):
                final = check_rules(raw_events(base, body))
                whole = client.responses.create(**{k: v for k, v in body.items() if k != "stream"})
                def same(items):
                    return [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]
                assert same(o.model_dump(exclude_none=True) for o in whole.output) == \
                    same({k: v for k, v in o.items() if v is not None} for o in final["output"]), \
                    (whole.output, final["output"])
                assert whole.status == final["status"], (whole.status, final["status"])

        def instructions_and_items(model):
            r = client.responses.create(model=model, instructions="Be brief.", store=False, input=[
                {"role": "developer", "content": "Answer in English."},
                {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
            ])
            assert r.output_text.startswith(REPLY), r

        def transcript(model):
            # Codex's way: the whole transcript each turn, nothing stored.
            r = client.responses.create(model=model, store=False, input=[
                {"role": "user", "content": "Hello"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]},
                {"role": "user", "content": "Again?"},
            ])
            assert r.output_text.startswith(REPLY) and r.store is False, r

        def tools(model):
            r = client.responses.create(model=model, tools=TOOLS, input="Weather in Paris?", store=False)
            calls = [o for o in r.output if o.type == "function_call"]
            assert calls and calls[0].name == "get_weather", r.output
            call = calls[0]
            assert call.id.startswith("fc_") and call.call_id, call
            assert json.loads(call.arguments) == {"city": "example", "days": 1}, call.arguments
            pieces = []
            with client.responses.stream(model=model, tools=TOOLS, input="Weather in Paris?", store=False) as s:
                for event in s:
                    if event.type == "response.function_call_arguments.delta":
                        pieces.append(event.delta)
                final = s.get_final_response()
            assert json.loads("".join(pieces)) == json.loads(call.arguments), pieces
            streamed = [o for o in final.output if o.type == "function_call"][0]
            assert streamed.arguments == call.arguments, (streamed, call)
            # The output goes back; the model answers it with text.
            answer = client.responses.create(model=model, tools=TOOLS, store=False, input=[
                {"role": "user", "content": "Weather in Paris?"},
                {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
            ])
            assert answer.output_text.startswith(REPLY), answer
            none = client.responses.create(model=model, tools=TOOLS, tool_choice="none", input="Weather?",
                                           store=False)
            assert none.output_text.startswith(REPLY), none

        def max_output_tokens(model):
            r = client.responses.create(model=model, input="Hello", max_output_tokens=3, store=False)
            assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens", r
            assert r.output_text == REPLY, r.output_text

        def chain(model):
            first = client.responses.create(model=model, input="Hello")
            second = client.responses.create(model=model, input="Again?", previous_response_id=first.id)
            third = client.responses.create(model=model, input="Once more?", previous_response_id=second.id)
            assert third.previous_response_id == second.id and third.output_text.startswith(REPLY), third
            # The provider saw the whole conversation: the prompt grows turn by turn.
            assert first.usage.input_tokens < second.usage.input_tokens < third.usage.input_tokens, \
                (first.usage, second.usage, third.usage)
            got = client.responses.retrieve(third.id)
            assert got.id == third.id and got.output_text == third.output_text, got
            # Another key sees nothing of it.
            other = openai.OpenAI(base_url=f"{base}/v1", api_key=OTHER, max_retries=0)
            try:
                other.responses.retrieve(third.id)
                raise AssertionError("another key read a stored response")
            except openai.NotFoundError:
                pass
            try:
                other.responses.create(model=model, input="x", previous_response_id=third.id)
                raise AssertionError("another key continued a stored response")
            except openai.BadRequestError as err:
                assert err.code == "previous_response_not_found", err.body
            client.responses.delete(third.id)
            try:
                client.responses.retrieve(third.id)
                raise AssertionError("a deleted response was still there")
            except openai.NotFoundError:
                pass
            # store: false keeps nothing.
            unstored = client.responses.create(model=model, input="Hello", store=False)
            try:
                client.responses.create(model=model, input="x", previous_response_id=unstored.id)
                raise AssertionError("a store: false response was continued")
            except openai.BadRequestError as err:
                assert err.code == "previous_response_not_found", err.body

        def errors():
            for exc, call in [
                (openai.AuthenticationError,
                 lambda: openai.OpenAI(base_url=f"{base}/v1", api_key="sk-wrong", max_retries=0)
                 .responses.create(model="mock-chat", input="x")),
                (openai.NotFoundError, lambda: client.responses.create(model="no-such-model", input="x")),
                (openai.BadRequestError, lambda: client.responses.create(model="mock-chat", input=[
                    {"type": "no_such_item"}])),
                (openai.BadRequestError, lambda: client.responses.create(model="mock-chat", input="x", tools=[
                    {"type": "web_search"}])),
                (openai.BadRequestError, lambda: client.responses.create(model="mock-chat", input="x", tools=[
                    {"type": "custom", "name": "shell"}])),
                (openai.BadRequestError, lambda: client.responses.create(
                    model="mock-chat", input="x", previous_response_id="resp_nope")),
            ]:
                try:
                    call()
                except exc:
                    continue
                raise AssertionError(f"no {exc.__name__}")

        def in_stream_failure():
            frames = raw_events(base, {"model": "mock-flaky", "input": "Hello", "stream": True, "store": False})
            kinds = [e for e, _ in frames]
            assert kinds[-1] == "response.failed", kinds
            assert kinds.count("response.created") == 1, kinds
            final = check_rules(frames)
            assert final["status"] == "failed" and final["error"]["code"], final

        for model in MODELS:
            for name, fn in [
                ("responses.create: text", text),
                ("responses.stream: deltas equal get_final_response()", stream),
                ("raw stream rules, and the stream's output equals the whole answer", raw_rules),
                ("instructions and item input", instructions_and_items),
                ("a multi-turn transcript with store: false", transcript),
                ("function tools round trip (streamed argument deltas included)", tools),
                ("max_output_tokens: incomplete", max_output_tokens),
                ("a three-turn previous_response_id chain; retrieve, delete, other keys", chain),
            ]:
                checks.run(f"{name} [{model}]", lambda fn=fn, model=model: fn(model))
        for name, fn in [
            ("errors map to the SDK's exceptions (401, 404, 400)", errors),
            ("a failure after the first event is response.failed, one response.created", in_stream_failure),
        ]:
            checks.run(name, fn)
    finally:
        system.stop()
        if checks.failed:
            print(system.log_tails(20_000))
    print(f"responses: {checks.passed} passed, {checks.failed} failed")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
