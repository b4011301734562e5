"""Conformance of the IOP Edge with the official OpenAI Python SDK.

Starts the quickstart system (examples/edge.toml and examples/node.toml, on free ports,
with a client API key and an extra OpenAI-compatible provider for embeddings served by a
tiny local fake), then drives it with the `openai` package: chat completions with and
without streaming, with tools, embeddings, completions and embeddings on the quickstart's
own `mock-api` model, model listing, and the SDK's error classes for an unknown model and
a bad API key. A named key limited to one request per minute shows that the SDK, with its
default retries, reads the Edge's 429 (`Retry-After`, `retry-after-ms`) and succeeds once
the window opens; that check runs beside the others, as it waits for a minute.
"""

import http.server
import json
import pathlib
import sys
import threading
import time

import openai

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "py"))
from iop_system import Checks, System  # noqa: E402

KEY = "sk-conformance"
LIMITED = "sk-conformance-limited"


class FakeEmbeddings(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        reply = {
            "object": "list",
            "model": body.get("model"),
            "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2, 0.3]}],
            "usage": {"prompt_tokens": 1, "total_tokens": 1},
        }
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def main():
    fake = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeEmbeddings)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    embed_port = fake.server_address[1]

    def configure(edge):
        edge = edge.replace("api_keys = []", f'api_keys = ["{KEY}"]')
        edge = edge.replace(
            "[[models]]",
            "[[nodes.adapters]]\n"
            'name = "embedder"\ntype = "openai_compat"\n'
            f'base_url = "http://127.0.0.1:{embed_port}"\n'
            'capacity = 2\ntargets = ["fake-embed"]\n\n[[models]]',
            1,
        )
        return (
            edge
            + '\n[[models]]\nname = "embed"\nproviders = [{ node = "node-1", adapter = "embedder", target = "fake-embed" }]\n'
            + f'\n[[auth.keys]]\nname = "limited"\nkey = "{LIMITED}"\nmodels = ["mock-chat"]\nrequests_per_minute = 1\n'
        )

    system = System(configure, ready_key=KEY)
    checks = Checks()
    try:
        base = f"{system.base}/v1"
        client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
        hello = [{"role": "user", "content": "Hello"}]

        # One request a minute: the second is refused with the headers the SDK reads,
        # and the SDK's own retries (two by default) get it answered a minute later.
        window = {}

        def window_opens():
            limited = openai.OpenAI(base_url=base, api_key=LIMITED)
            limited.chat.completions.create(model="mock-chat", messages=hello)
            try:
                limited.with_options(max_retries=0).chat.completions.create(model="mock-chat", messages=hello)
                raise AssertionError("the second request within a minute was answered")
            except openai.RateLimitError as err:
                headers = err.response.headers
                assert err.status_code == 429 and err.code == "rate_limit_exceeded", err
                assert 0 < int(headers["retry-after"]) <= 60, headers
                assert int(headers["retry-after-ms"]) > 0, headers
                assert headers["x-ratelimit-limit-requests"] == "1", headers
                assert headers["x-ratelimit-remaining-requests"] == "0", headers
            started = time.monotonic()
            r = limited.chat.completions.create(model="mock-chat", messages=hello)
            assert r.choices[0].message.content.startswith("Hello from IOP!"), r
            waited = time.monotonic() - started
            assert 30 < waited < 75, f"answered after {waited:.1f} s"
            assert [m.id for m in limited.models.list()] == ["mock-chat"]

        def run_window():
            try:
                window_opens()
            except Exception as err:  # noqa: BLE001 - reported by the check below
                window["error"] = err

        waiting = threading.Thread(target=run_window, daemon=True)
        waiting.start()

        def window_check():
            waiting.join(timeout=120)
            assert not waiting.is_alive(), "the limited key's retries never ended"
            if "error" in window:
                raise window["error"]

        def chat():
            r = client.chat.completions.create(model="mock-chat", messages=[{"role": "user", "content": "Hello"}])
            assert r.choices[0].message.content.startswith("Hello from IOP!"), r
            assert r.choices[0].finish_reason == "stop"
            assert r.usage.total_tokens > 0

        def chat_stream():
            stream = client.chat.completions.create(
                model="mock-chat", messages=[{"role": "user", "content": "Hello"}], stream=True,
                stream_options={"include_usage": True},
            )
            text, usage = "", None
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
                if chunk.usage:
                    usage = chunk.usage
            assert text.startswith("Hello from IOP!"), text
            assert usage is not None and usage.completion_tokens > 0

        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]

        def chat_tools():
            r = client.chat.completions.create(
                model="mock-chat", messages=[{"role": "user", "content": "Weather?"}], tools=tools
            )
            call = r.choices[0].message.tool_calls[0]
            assert r.choices[0].finish_reason == "tool_calls"
            assert call.function.name == "get_weather"
            assert json.loads(call.function.arguments) == {}

        def chat_tools_stream():
            stream = client.chat.completions.create(
                model="mock-chat", messages=[{"role": "user", "content": "Weather?"}], tools=tools, stream=True
            )
            names = [
                tc.function.name
                for chunk in stream
                for tc in (chunk.choices[0].delta.tool_calls or [] if chunk.choices else [])
            ]
            assert names == ["get_weather"], names

        def embeddings():
            r = client.embeddings.create(model="embed", input="hello")
            assert r.data[0].embedding == [0.1, 0.2, 0.3], r

        # The quickstart's own "mock-api": the mock answering as an OpenAI-compatible
        # server through a tunnel, so completions and embeddings work with no provider.
        def quickstart_completions():
            r = client.completions.create(model="mock-api", prompt="Say hello", max_tokens=3)
            assert r.object == "text_completion" and r.model == "mock-small", r
            assert r.choices[0].text == "Hello from IOP!", r.choices[0].text
            assert r.choices[0].finish_reason == "length"
            assert r.usage.completion_tokens == 3
            text = "".join(c.choices[0].text for c in client.completions.create(
                model="mock-api", prompt="Say hello", stream=True) if c.choices)
            assert text.startswith("Hello from IOP! This answer came through a raw tunnel"), text

        def quickstart_embeddings():
            # The SDK asks for base64 and decodes it; the same text gets the same vector.
            r = client.embeddings.create(model="mock-api", input=["hello", "world", "hello"], dimensions=8)
            vectors = [d.embedding for d in r.data]
            assert [len(v) for v in vectors] == [8, 8, 8], vectors
            assert vectors[0] == vectors[2] and vectors[0] != vectors[1]
            assert abs(sum(x * x for x in vectors[0]) - 1.0) < 1e-3
            floats = client.embeddings.create(model="mock-api", input="hello", dimensions=8,
                                              encoding_format="float")
            assert all(abs(a - b) < 1e-6 for a, b in zip(floats.data[0].embedding, vectors[0]))

        def quickstart_tunnel_chat():
            stream = client.chat.completions.create(
                model="mock-api", messages=[{"role": "user", "content": "Hello"}], stream=True,
                stream_options={"include_usage": True})
            chunks = list(stream)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text.startswith("Hello from IOP! This answer came through"), text
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0

        def models():
            ids = sorted(m.id for m in client.models.list())
            assert ids == ["embed", "mock-api", "mock-chat"], ids

        def retrieve_model():
            m = client.models.retrieve("mock-chat")
            assert m.id == "mock-chat" and m.object == "model", m
            try:
                client.models.retrieve("no-such-model")
            except openai.NotFoundError as err:
                assert err.status_code == 404
                return
            raise AssertionError("no NotFoundError from models.retrieve")

        def unknown_model():
            try:
                client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
            except openai.NotFoundError as err:
                assert err.status_code == 404
                return
            raise AssertionError("no NotFoundError")

        def bad_key():
            bad = openai.OpenAI(base_url=base, api_key="sk-wrong", max_retries=0)
            try:
                bad.models.list()
            except openai.AuthenticationError as err:
                assert err.status_code == 401
                return
            raise AssertionError("no AuthenticationError")

        for name, fn in [
            ("chat.completions.create", chat),
            ("chat.completions.create(stream=True)", chat_stream),
            ("chat.completions.create(tools=...)", chat_tools),
            ("chat.completions.create(tools=..., stream=True)", chat_tools_stream),
            ("embeddings.create", embeddings),
            ("completions.create on the quickstart's mock-api", quickstart_completions),
            ("embeddings.create on the quickstart's mock-api (base64 and float)", quickstart_embeddings),
            ("chat.completions.create(stream=True) through the mock-api tunnel", quickstart_tunnel_chat),
            ("models.list", models),
            ("models.retrieve", retrieve_model),
            ("NotFoundError for an unknown model", unknown_model),
            ("AuthenticationError for a bad API key", bad_key),
            ("a key at one request a minute: 429 with Retry-After, then the SDK's retries succeed",
             window_check),
        ]:
            checks.run(name, fn)
    finally:
        system.stop()
        if checks.failed:
            print(system.log_tails(100_000))
    print(f"sdk: {checks.passed} passed, {checks.failed} failed")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
