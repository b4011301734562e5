"""The quickstart system for the Python checks (SDK conformance, the dashboard): the example
configs on free loopback ports with a fresh node-link certificate, the real binaries from
target/debug, a wait until every node is ready, and named checks counted for the summary
line ./scripts/test reads.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = ROOT / "target" / "debug"

_next_port = 32000 - (os.getpid() * 7919) % 12000


def free_port():
    """A loopback port free when checked, below the kernel's ephemeral range (32768 and
    up) so no outgoing connection can take it before the binary binds it."""
    global _next_port
    for _ in range(12000):
        _next_port = 20000 + (_next_port - 20000 + 1) % 12000
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", _next_port))
            except OSError:
                continue
            return _next_port
    raise RuntimeError("no free loopback port between 20000 and 32000")


class Checks:
    """Named checks; each prints `ok   name` or `FAIL name: why`."""

    def __init__(self):
        self.passed = 0
        self.failed = 0

    def run(self, name, fn):
        try:
            fn()
            self.passed += 1
            print(f"ok   {name}")
        except Exception as err:  # noqa: BLE001 - report every failure by name
            self.failed += 1
            print(f"FAIL {name}: {type(err).__name__}: {err}")


class System:
    """An Edge and a Node from examples/, on free ports; `edit_edge` may rewrite the
    Edge's config text (it gets the text and returns it). Stop it with `stop()`."""

    def __init__(self, edit_edge=lambda text: text, ready_key=None):
        self.http_port, self.node_port = free_port(), free_port()
        self.base = f"http://127.0.0.1:{self.http_port}"
        edge = (ROOT / "examples" / "edge.toml").read_text()
        edge = edge.replace("127.0.0.1:8080", f"127.0.0.1:{self.http_port}")
        edge = edge.replace("127.0.0.1:7100", f"127.0.0.1:{self.node_port}")
        edge = edit_edge(edge)
        node = (ROOT / "examples" / "node.toml").read_text()
        node = node.replace("127.0.0.1:7100", f"127.0.0.1:{self.node_port}")

        self.tmp = pathlib.Path(tempfile.mkdtemp(prefix="iop-py-"))
        # The example configs name tls/edge-cert.pem beside them, as the quickstart makes it.
        (self.tmp / "tls").mkdir()
        subprocess.run(
            [BIN / "iop-edge", "gen-cert", "--name", "localhost", "--name", "127.0.0.1",
             "--cert", self.tmp / "tls" / "edge-cert.pem", "--key", self.tmp / "tls" / "edge-key.pem"],
            check=True, stdout=subprocess.DEVNULL,
        )
        (self.tmp / "edge.toml").write_text(edge)
        (self.tmp / "node.toml").write_text(node)
        self.logs = [open(self.tmp / "edge.log", "w"), open(self.tmp / "node.log", "w")]
        self.edge = subprocess.Popen([BIN / "iop-edge", "--config", self.tmp / "edge.toml"], stderr=self.logs[0])
        self.node = subprocess.Popen([BIN / "iop-node", "--config", self.tmp / "node.toml"], stderr=self.logs[1])
        self._wait_ready(ready_key)

    def _wait_ready(self, key):
        headers = {"authorization": f"Bearer {key}"} if key else {}
        deadline = time.time() + 30
        while True:
            try:
                req = urllib.request.Request(f"{self.base}/v1/status", headers=headers)
                with urllib.request.urlopen(req, timeout=1) as r:
                    # The example's own node; a test may configure more that never connect.
                    if any(n["node_id"] == "node-1" and n["connected"] for n in json.load(r)["nodes"]):
                        return
            except OSError:
                pass
            if time.time() > deadline:
                self.stop()
                sys.exit("the system did not become ready\n" + self.log_tails(2000))
            time.sleep(0.1)

    def log_tails(self, chars=3000):
        for log in self.logs:
            log.flush()
        return "".join(
            f"----- {name} -----\n{(self.tmp / name).read_text()[-chars:]}\n"
            for name in ("edge.log", "node.log")
        )

    def stop(self):
        for p in (self.node, self.edge):
            if p.poll() is None:
                p.terminate()
        for p in (self.node, self.edge):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
