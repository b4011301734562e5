"""The dashboard in a real browser (headless Chromium through chromedriver).

Starts the quickstart system (examples/edge.toml and examples/node.toml on free ports,
with an admin key and a short heartbeat), opens /ui, and checks what an operator relies
on: a wrong key shows the login again; the right key shows the node, its providers and a
live request; a broken provider beside a healthy one shows ejected, and the feed says
so; the named client key the requests use shows with its limits and today's usage; the node killed mid-test turns disconnected within the heartbeat timeout and the
lifecycle feed says it was fenced. Saves target/dashboard.png. Then, with 1,000
configured nodes, paging, search and sort (target/dashboard-1000.png).
"""

import json
import os
import pathlib
import re
import shutil
import sys
import threading
import time
import urllib.request

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "py"))
from iop_system import ROOT, Checks, System  # noqa: E402

ADMIN = "sk-admin-dashboard-0001"
CLIENT = "sk-client-dashboard-0001"
HEARTBEAT_TIMEOUT_S = 1.5


def wait(what, predicate, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if predicate():
                return
        except Exception:  # noqa: BLE001 - the page may be mid-render
            pass
        time.sleep(0.1)
    raise AssertionError(f"{what} within {timeout} s")


def browser():
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000"):
        options.add_argument(arg)
    for path in ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome"):
        if os.path.exists(path):
            options.binary_location = path
            break
    driver = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    return webdriver.Chrome(service=Service(driver), options=options)


def configure(edge):
    edge = edge.replace("admin_keys = []", f'admin_keys = ["{ADMIN}"]')
    # A named client key with limits; every request of this test uses it.
    edge += (f'\n[[auth.keys]]\nname = "team-ui"\nkey = "{CLIENT}"\nrequests_per_minute = 1000\n'
             'token_budget = 1000000\nbudget_period = "month"\n')
    edge = edge.replace("interval_ms = 2000\ntimeout_ms = 6000", "interval_ms = 300\ntimeout_ms = 1500")
    assert "timeout_ms = 1500" in edge, "the example's heartbeat section changed"
    # Slow tokens, so a request is in flight across a few dashboard refreshes.
    edge = edge.replace('token_delay_ms = "15"', 'token_delay_ms = "250"')
    assert 'token_delay_ms = "250"' in edge, "the example's mock options changed"
    # A provider that fails every run right after its start, beside a fast healthy mock in
    # a model of their own: routing retries its callers on the healthy one and ejects it.
    broken = ('[[nodes.adapters]]\nname = "fast"\ntype = "mock"\ncapacity = 4\n'
              'targets = ["mock-small"]\n[nodes.adapters.options]\ntokens = "2"\n'
              'token_delay_ms = "1"\n\n'
              '[[nodes.adapters]]\nname = "broken"\ntype = "mock"\ncapacity = 4\n'
              'targets = ["mock-small"]\n[nodes.adapters.options]\nfail = "always"\n\n'
              '[[models]]\nname = "half-broken"\nproviders = ['
              '{ node = "node-1", adapter = "fast", target = "mock-small" }, '
              '{ node = "node-1", adapter = "broken", target = "mock-small" }]\n\n')
    assert "\n[[models]]\n" in edge, "the example's models changed"
    edge = edge.replace("\n[[models]]\n", "\n" + broken + "[[models]]\n", 1)
    return edge


FLEET = 999


def with_fleet(edge):
    """The example plus 999 configured nodes that never connect: a 1,000-node table."""
    extra = "".join(
        f'\n[[nodes]]\nid = "fleet-{i:04}"\ntoken = "fleet-token-{i:04}-long-enough"\n'
        for i in range(1, FLEET + 1))
    return configure(edge) + extra


def fleet_of_1000(driver, base):
    """Paging, search and sort over 1,000 nodes; the one connected node can be found."""
    # Another port is another origin: its session storage has no key yet.
    driver.get(f"{base}/ui")
    wait("the login form", lambda: driver.find_element(By.ID, "key").is_displayed(), 10)
    driver.find_element(By.ID, "key").send_keys(ADMIN)
    driver.find_element(By.ID, "login-button").click()
    wait("the dashboard", lambda: driver.find_element(By.ID, "app").is_displayed(), 10)
    page = lambda: driver.find_element(By.ID, "page").text  # noqa: E731
    rows = lambda: driver.find_elements(By.CSS_SELECTOR, "#nodes tbody tr")  # noqa: E731
    wait("1,000 nodes in 20 pages of 50", lambda: page() == f"1 / 20 ({FLEET + 1})" and len(rows()) == 50, 10)
    driver.find_element(By.ID, "next").click()
    wait("page 2", lambda: page().startswith("2 / 20")
         and rows()[0].get_attribute("data-node") == "fleet-0051", 5)
    search = driver.find_element(By.ID, "node-search")
    search.send_keys("fleet-0999")
    wait("search narrows to one", lambda: page() == "1 / 1 (1)"
         and rows()[0].get_attribute("data-node") == "fleet-0999", 5)
    search.clear()
    search.send_keys("site=local")
    wait("search by label finds the connected node", lambda: page() == "1 / 1 (1)"
         and rows()[0].get_attribute("data-node") == "node-1", 5)
    search.clear()
    driver.execute_script("document.getElementById('node-search').dispatchEvent(new Event('input'))")
    state = driver.find_element(By.CSS_SELECTOR, '#nodes th[data-k="state"]')
    state.click()
    state.click()  # descending: "ready" before "offline"
    wait("sorted by state, the ready node first", lambda: rows()[0].get_attribute("data-node") == "node-1", 5)
    out = ROOT / "target" / "dashboard-1000.png"
    assert driver.save_screenshot(str(out)), "screenshot"


def main():
    system = System(configure, ready_key=ADMIN)
    base = system.base
    checks = Checks()
    driver = None
    try:
        driver = browser()

        def login(key):
            driver.get(f"{base}/ui")
            wait("the login form", lambda: driver.find_element(By.ID, "key").is_displayed(), 10)
            driver.find_element(By.ID, "key").send_keys(key)
            driver.find_element(By.ID, "login-button").click()

        def wrong_key():
            login("sk-not-the-admin-key")
            wait("the login again, with an error",
                 lambda: driver.find_element(By.ID, "login").is_displayed()
                 and "not an admin key" in driver.find_element(By.ID, "login-error").text, 10)
            assert not driver.find_element(By.ID, "app").is_displayed()
            assert "sk-not" not in driver.current_url

        def fleet():
            login(ADMIN)
            wait("the dashboard", lambda: driver.find_element(By.ID, "app").is_displayed(), 10)
            assert ADMIN not in driver.current_url, "the key is never in a URL"
            wait("node-1 ready", lambda: driver.find_element(
                By.CSS_SELECTOR, 'tr[data-node="node-1"] [data-state="ready"]'), 10)
            wait("its provider healthy", lambda: "healthy" in driver.find_element(
                By.CSS_SELECTOR, 'tr[data-provider="node-1/mock"]').text, 10)
            row = lambda: driver.find_element(By.CSS_SELECTOR, 'tr[data-node="node-1"]').text  # noqa: E731
            # The table is re-rendered on every refresh: a row read mid-render is read again.
            wait("the node's TLS version", lambda: "TLS" in row(), 10)
            # The feed opens with what happened before the page did (Last-Event-ID: 0).
            wait("the node's earlier events in the feed", lambda: driver.find_elements(
                By.CSS_SELECTOR, '#feed div[data-type="node.ready"]'), 10)
            wait("the node's labels", lambda: "site=local" in row(), 10)
            # The version the node registered with, and the Edge's heartbeat round trip.
            wait("the node's version and heartbeat RTT", lambda: re.search(r"\d+\.\d+\.\d+", row())
                 and re.search(r"(<1|\d+) ms", row()), 10)

        def live_request():
            # A streamed request in flight shows in the provider's in-flight column, and the
            # request rate moves once it is done.
            body = json.dumps({"model": "mock-chat", "stream": True,
                               "messages": [{"role": "user", "content": "Hello"}]}).encode()
            done = threading.Event()

            def call():
                req = urllib.request.Request(f"{base}/v1/chat/completions", data=body,
                                             headers={"content-type": "application/json",
                                                      "authorization": f"Bearer {CLIENT}"})
                with urllib.request.urlopen(req, timeout=60) as r:
                    r.read()
                done.set()
            threading.Thread(target=call, daemon=True).start()
            wait("the request in flight", lambda: "1/" in driver.find_element(
                By.CSS_SELECTOR, 'tr[data-provider="node-1/mock"]').text, 15)
            wait("the request done", done.is_set, 60)
            wait("a request rate above zero", lambda: float(driver.find_element(By.ID, "rate").text) > 0, 10)

        def broken_provider():
            # Callers of the half-broken model all succeed; its broken provider is ejected
            # within a few of them, and the dashboard and its feed say so.
            body = json.dumps({"model": "half-broken",
                               "messages": [{"role": "user", "content": "Hello"}]}).encode()
            for _ in range(8):
                req = urllib.request.Request(f"{base}/v1/chat/completions", data=body,
                                             headers={"content-type": "application/json",
                                                      "authorization": f"Bearer {CLIENT}"})
                with urllib.request.urlopen(req, timeout=60) as r:
                    assert r.status == 200, r.status
            wait("the broken provider shown ejected", lambda: driver.find_element(
                By.CSS_SELECTOR, 'tr[data-provider="node-1/broken"] [data-ejected="ejected"]'), 10)
            wait("the feed says ejected", lambda: driver.find_elements(
                By.CSS_SELECTOR, '#feed div[data-type="provider.ejected"]'), 5)
            healthy = driver.find_element(By.CSS_SELECTOR, 'tr[data-provider="node-1/fast"]')
            assert not healthy.find_elements(By.CSS_SELECTOR, "[data-ejected]"), healthy.text

        def client_keys():
            row = lambda: driver.find_element(By.CSS_SELECTOR, 'tr[data-key="team-ui"]')  # noqa: E731
            wait("today's requests of the key", lambda: int(row().find_elements(By.TAG_NAME, "td")[5].text) >= 9, 10)
            assert "of 1000" in row().text and "this month" in row().text, row().text
            assert CLIENT not in driver.page_source

        def node_killed():
            system.node.kill()
            killed = time.time()
            wait("node-1 disconnected", lambda: driver.find_element(
                By.CSS_SELECTOR, 'tr[data-node="node-1"] [data-state="disconnected"]'), HEARTBEAT_TIMEOUT_S + 3)
            took = time.time() - killed
            wait("the feed says fenced", lambda: driver.find_elements(
                By.CSS_SELECTOR, '#feed div[data-type="node.fenced"]'), 5)
            print(f"     node-1 shown disconnected {took:.1f} s after the kill "
                  f"(heartbeat timeout {HEARTBEAT_TIMEOUT_S} s)")

        def screenshot():
            out = ROOT / "target" / "dashboard.png"
            out.parent.mkdir(exist_ok=True)
            assert driver.save_screenshot(str(out)), "screenshot"
            assert out.stat().st_size > 10_000, out.stat().st_size

        for name, fn in [
            ("a wrong key shows the login again", wrong_key),
            ("the admin key shows the node and its providers", fleet),
            ("a live request shows in flight and in the request rate", live_request),
            ("a broken provider beside a healthy one shows ejected", broken_provider),
            ("the named client key shows with its limits and today's usage", client_keys),
            ("screenshot saved to target/dashboard.png", screenshot),
            ("a killed node turns disconnected within the heartbeat timeout", node_killed),
        ]:
            checks.run(name, fn)
        system.stop()
        system = System(with_fleet, ready_key=ADMIN)
        checks.run(f"{FLEET + 1} nodes: paged, searchable and sortable",
                   lambda: fleet_of_1000(driver, system.base))
    finally:
        if driver is not None:
            driver.quit()
        system.stop()
        if checks.failed:
            print(system.log_tails())
    print(f"ui: {checks.passed} passed, {checks.failed} failed")
    sys.exit(1 if checks.failed else 0)


if __name__ == "__main__":
    main()
