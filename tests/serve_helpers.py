"""Helpers of the `txl serve` tests: a streamed generation's events, an error response's message, a real server."""

from __future__ import annotations

import contextlib
import json
import time


def engine_tokens(model, prompt: list[int], max_new_tokens: int, mem_len: int) -> list[int]:
    """The tokens txl serve's engine (batched one-token steps, 2 rows) generates greedily for ``prompt`` alone."""
    import threading

    from txl.serve.engine import Engine, Generation

    got, done = [], threading.Event()
    engine = Engine(model, max_batch=2)
    try:
        emit = lambda t: done.set() if t is None else got.append(t)  # noqa: E731
        engine.submit(Generation(prompt, max_new_tokens, emit, mem_len=mem_len, temperature=0.0))
        assert done.wait(60)
    finally:
        engine.shutdown()
    return got


def events(client, body: dict) -> list[dict]:
    """The events of a streamed /v1/generate, which ends with data: [DONE] (not among them)."""
    with client.stream("POST", "/v1/generate", json=body | {"stream": True}) as res:
        assert res.status_code == 200 and res.headers["content-type"].startswith("text/event-stream")
        lines = [line[6:] for line in res.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]" and "[DONE]" not in lines[:-1]
    return [json.loads(line) for line in lines[:-1]]


def error_of(res, status: int = 400) -> str:
    """The message of an error response (OpenAI's shape), checking its status and layout."""
    body = res.json()
    assert res.status_code == status and set(body) == {"error"}, (res.status_code, body)
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]["message"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(run, *extra: str, **popen):
    """`txl serve` as a process on a free port; returns (process, base URL) once /health answers."""
    import httpx

    from train_helpers import txl_process

    port = free_port()
    proc = txl_process(["serve", "--model", str(run), "--port", str(port), *extra], **popen)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
        assert proc.poll() is None, "txl serve exited"
    proc.kill()
    raise AssertionError("txl serve did not answer /health")


@contextlib.contextmanager
def page_in_chromium(run, *server_args: str, browser_args: tuple[str, ...] = ()):
    """`txl serve` of ``run`` (:func:`start_server`) and a :func:`headless_chromium` to read its page: yields
    (browser, base URL); both end with the block."""
    browser = headless_chromium(*browser_args)
    try:
        proc, url = start_server(run, *server_args)
    except BaseException:
        browser.quit()
        raise
    try:
        yield browser, url
    finally:
        browser.quit()
        proc.terminate()
        proc.wait(timeout=30)


def headless_chromium(*extra_args: str):
    """Debian's headless Chromium (`make browser`) at phone width, its console logged; skips the test where it is
    missing, unless TXL_REQUIRE_BROWSER asks for it (CI)."""
    import os
    import shutil

    import pytest

    webdriver = pytest.importorskip("selenium.webdriver")
    chromium, driver_bin = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver_bin):
        if os.environ.get("TXL_REQUIRE_BROWSER"):
            raise AssertionError("chromium and chromedriver are missing: run `make browser`")
        pytest.skip("no chromium/chromedriver (make browser installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=390,900", *extra_args):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver_bin))
