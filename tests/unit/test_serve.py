"""``edgeprune serve``'s OpenAI-compatible server driven by the official ``openai`` client on
localhost, over the tiny llama export: chat, completions, streaming (SSE as the client
parses it), usage and the reused prefix, two concurrent clients, the queue and its 503, a
body over the size limit (413), bad requests (400), a client that disconnects mid-stream
(generation stopped, KV freed, the server keeps serving), and no torch on its imports."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import edgeprune_runtime as runtime  # noqa: E402
from edgeprune_runtime.serve import create_app, load_slots  # noqa: E402
from edgeprune_runtime.serve.app import ServerThread  # noqa: E402

from tiny import export_tiny_llama  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How are you?"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder, _, _ = export_tiny_llama(tmp_path_factory.mktemp("serve") / "llama", max_length=512)
    return folder


def _slow(slot, delay: float, active: dict):
    """Make each decode step of ``slot`` take ``delay`` s more; ``active`` counts the steps
    running at once (``max``: the most seen)."""
    orig, lock = slot._decode_step, threading.Lock()

    def step(st, feed):
        with lock:
            active["now"] += 1
            active["max"] = max(active["max"], active["now"])
        try:
            time.sleep(delay)
            return orig(st, feed)
        finally:
            with lock:
                active["now"] -= 1

    slot._decode_step = step


@contextmanager
def serving(folder, slots: int = 1, queue: int = 4, max_bytes: int = 1 << 16, delay: float = 0.0):
    """A server over ``slots`` sessions of ``folder`` in a thread; yields ``(server, sessions,
    client, active)``."""
    sessions = load_slots(folder, slots, threads=1)
    active = {"now": 0, "max": 0}
    for s in sessions:
        s.eos_token_ids = []              # random model: never stop early
        if delay:
            _slow(s, delay, active)
    app = create_app(sessions, "tiny", queue_size=queue, max_request_bytes=max_bytes)
    try:
        with ServerThread(app) as srv:
            yield srv, sessions, openai.OpenAI(base_url=srv.url + "/v1", api_key="unused",
                                               max_retries=0, timeout=60), active
    finally:
        for s in sessions:
            s.close()


def _get(srv, path):
    with urllib.request.urlopen(srv.url + path, timeout=30) as r:
        return json.loads(r.read())


def _post_raw(srv, path, data: bytes, headers=None):
    req = urllib.request.Request(srv.url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _wait_idle(srv, timeout=30.0):
    t0 = time.monotonic()
    while True:
        h = _get(srv, "/health")
        if not h["running"] and not h["waiting"]:
            return h
        assert time.monotonic() - t0 < timeout, h
        time.sleep(0.02)


def _reference(folder, prompt, n):
    with runtime.load(folder, threads=1) as s:
        s.eos_token_ids = []
        return s.generate(prompt, max_new_tokens=n)


def test_chat_completions_streaming_and_models(tiny):
    ref = _reference(tiny, USER, 12)
    with serving(tiny) as (srv, sessions, client, _):
        assert [m.id for m in client.models.list().data] == ["tiny"]
        assert client.models.retrieve("tiny").id == "tiny"
        r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=12, temperature=0)
        choice = r.choices[0]
        assert choice.message.role == "assistant" and choice.message.content == ref.text
        assert choice.finish_reason == "length" and r.object == "chat.completion"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref.prompt_tokens[0], 12)
        assert r.usage.total_tokens == ref.prompt_tokens[0] + 12
        # streamed: role first, the pieces, finish_reason, then usage
        chunks = list(client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == ref.text and len(chunks) > 4
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
        # the same prompt again: all but its last token came from the cache
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == ref.prompt_tokens[0] - 1
        # the next turn of the conversation reuses the previous one's rows
        turn2 = USER + [{"role": "assistant", "content": text}, {"role": "user", "content": "Why?"}]
        r2 = client.chat.completions.create(model="tiny", messages=turn2, max_tokens=8, temperature=0)
        ref2 = _reference(tiny, turn2, 8)
        assert r2.choices[0].message.content == ref2.text
        assert r2.usage.prompt_tokens_details.cached_tokens >= ref.prompt_tokens[0]
        # seeded sampling is reproducible
        kw = dict(model="tiny", messages=USER, max_tokens=10, temperature=0.9, seed=3)
        assert client.chat.completions.create(**kw).choices[0].message.content == \
            client.chat.completions.create(**kw).choices[0].message.content


def test_completions_text_and_token_ids(tiny):
    ref = _reference(tiny, "Small language models", 16)
    with serving(tiny) as (srv, sessions, client, _):
        r = client.completions.create(model="tiny", prompt="Small language models", temperature=0)
        assert r.choices[0].text == ref.text and r.usage.completion_tokens == 16     # default 16
        ids = sessions[0].tokenizer.encode("Small language models")
        chunks = list(client.completions.create(model="tiny", prompt=ids, max_tokens=16,
                                                temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == ref.text
        assert chunks[-1].choices[0].finish_reason == "length"
        stop = ref.text[4:6]
        r = client.completions.create(model="tiny", prompt="Small language models", temperature=0,
                                      stop=stop)
        assert r.choices[0].text == ref.text[:ref.text.find(stop)]
        assert r.choices[0].finish_reason == "stop"


def test_two_concurrent_clients(tiny):
    prompts = [[{"role": "user", "content": "one two three"}],
               [{"role": "user", "content": "The quick brown fox"}]]
    refs = [_reference(tiny, p, 40).text for p in prompts]
    with serving(tiny, slots=2, delay=0.004) as (srv, sessions, client, active):
        got = [None, None]

        def ask(i):
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            got[i] = c.chat.completions.create(model="tiny", messages=prompts[i], max_tokens=40,
                                               temperature=0).choices[0].message.content

        ts = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        [t.start() for t in ts]
        [t.join(60) for t in ts]
        assert got == refs
        assert active["max"] == 2                  # the two generated at the same time
        assert [s["cached_tokens"] > 0 for s in _wait_idle(srv)["slots"]] == [True, True]


def test_queue_and_503_when_full(tiny):
    with serving(tiny, slots=1, queue=1, delay=0.005) as (srv, sessions, client, _):
        long_ = client.chat.completions.create(model="tiny", messages=USER, max_tokens=300,
                                               temperature=0, stream=True)
        it = iter(long_)
        next(it)                                        # generating now
        queued = {}
        t = threading.Thread(target=lambda: queued.update(r=client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=3, temperature=0)))
        t.start()
        t0 = time.monotonic()
        while _get(srv, "/health")["waiting"] != 1:
            assert time.monotonic() - t0 < 30
            time.sleep(0.01)
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(model="tiny", messages=USER, max_tokens=3)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
        assert e.value.body["code"] == "server_busy" and "busy" in e.value.body["message"]
        long_.close()                                   # the queued request runs next
        t.join(60)
        assert queued["r"].choices[0].finish_reason == "length"
        assert len(client.chat.completions.create(model="tiny", messages=USER, max_tokens=2,
                                                  temperature=0).choices[0].message.content) > 0


def test_size_limit_and_bad_requests(tiny):
    with serving(tiny, max_bytes=4096) as (srv, sessions, client, _):
        big = [{"role": "user", "content": "x" * 100_000}]
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(model="tiny", messages=big, max_tokens=2)
        assert e.value.status_code == 413 and "4,096" in e.value.body["message"]
        # without a Content-Length the body is counted as it arrives
        data = json.dumps({"messages": big}).encode()
        req = urllib.request.Request(srv.url + "/v1/chat/completions", method="POST",
                                     data=iter([data[i:i + 1000] for i in range(0, len(data), 1000)]),
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as h:
            urllib.request.urlopen(req, timeout=30)
        assert h.value.code == 413
        long_prompt = [{"role": "user", "content": "word " * 600}]
        with serving(tiny, max_bytes=1 << 20) as (_, _, roomy, _):
            with pytest.raises(openai.BadRequestError) as e:
                roomy.chat.completions.create(model="tiny", messages=long_prompt, max_tokens=2)
            assert e.value.body["code"] == "context_length_exceeded"
        for bad, needle in (({"n": 2}, "'n'"), ({"temperature": -1}, "temperature"),
                            ({"presence_penalty": 0.5}, "presence_penalty"),
                            ({"max_tokens": 0}, "max_tokens"), ({"stop": 3}, "stop"),
                            ({"tools": [{"type": "function"}]}, "tools"),
                            ({"max_tokens": 600}, "context")):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="tiny", messages=USER, **bad)
            assert needle in e.value.body["message"], (bad, e.value.body)
        assert _post_raw(srv, "/v1/chat/completions", b"{not json")[0] == 400
        assert _post_raw(srv, "/v1/chat/completions", b"[1, 2]")[0] == 400
        status, body = _post_raw(srv, "/v1/chat/completions", json.dumps({"messages": []}).encode())
        assert status == 400 and body["error"]["param"] == "messages"
        status, body = _post_raw(srv, "/v1/completions", json.dumps({"prompt": ["a", "b"]}).encode())
        assert status == 400 and body["error"]["param"] == "prompt"
        with pytest.raises(urllib.error.HTTPError) as h:
            _get(srv, "/v1/nothing")
        assert h.value.code == 404 and "error" in json.loads(h.value.read())
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("other")
        # the server kept serving through all of it
        r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3


def _cancelled_lines(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == "edgeprune_runtime.serve" and "cancelled" in r.getMessage()]


def test_client_disconnect_stops_the_generation_and_frees_kv(tiny, caplog):
    caplog.set_level(logging.INFO, logger="edgeprune_runtime.serve")
    with serving(tiny, slots=1, delay=0.005) as (srv, sessions, client, _):
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=4, temperature=0)
        assert sessions[0].kv_cache_state()["cached_tokens"] > 0
        stream = client.chat.completions.create(model="tiny", messages=USER, max_tokens=400,
                                                temperature=0, stream=True)
        it = iter(stream)
        next(it), next(it), next(it)
        stream.close()                                  # the client goes away mid-stream
        h = _wait_idle(srv)
        assert h["slots"] == [{"busy": False, "cached_tokens": 0, "kv_bytes": 0}]
        assert sessions[0].kv_cache_state() == {"allocated_bytes": 0, "cached_tokens": 0}
        lines = _cancelled_lines(caplog)
        assert lines and int(lines[-1].split(" generated")[0].rsplit(" ", 1)[1]) < 400
        # a non-streaming request whose client leaves: stopped too (polled)
        body = json.dumps({"messages": USER, "max_tokens": 400, "temperature": 0}).encode()
        sock = socket.create_connection((srv.host, srv.port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.3)
        sock.close()
        time.sleep(0.1)
        _wait_idle(srv)
        assert len(_cancelled_lines(caplog)) == len(lines) + 1
        assert sessions[0].kv_cache_state() == {"allocated_bytes": 0, "cached_tokens": 0}
        # and the server keeps serving
        r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=5, temperature=0)
        assert r.usage.completion_tokens == 5


def test_server_imports_no_torch_and_names_the_missing_extra(tiny):
    code = (
        "import importlib.abc, json, sys, urllib.request\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in sys.argv[2].split(','):\n"
        "            raise ImportError(f'{name} is blocked', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from edgeprune_runtime.serve import create_app, load_slots\n"
        "try:\n"
        "    app = create_app(load_slots(sys.argv[1]), 'tiny')\n"
        "except Exception as e:\n"
        "    print(json.dumps({'error': type(e).__name__, 'text': str(e)})); raise SystemExit\n"
        "from edgeprune_runtime.serve.app import ServerThread\n"
        "with ServerThread(app) as srv:\n"
        "    req = urllib.request.Request(srv.url + '/v1/completions', method='POST',\n"
        "        data=json.dumps({'prompt': 'hello', 'max_tokens': 3}).encode(),\n"
        "        headers={'Content-Type': 'application/json'})\n"
        "    out = json.loads(urllib.request.urlopen(req).read())\n"
        "ours = ('torch', 'transformers', 'edgeprune', 'edgeprune_exporters', 'edgeprune_devices', 'onnx')\n"
        "print(json.dumps({'tokens': out['usage']['completion_tokens'],\n"
        "                  'loaded': sorted(m for m in sys.modules if m.split('.')[0] in ours)}))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    blocked = "torch,transformers,edgeprune,edgeprune_exporters,edgeprune_devices"
    out = subprocess.run([sys.executable, "-c", code, str(tiny), blocked], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"tokens": 3, "loaded": []}
    out = subprocess.run([sys.executable, "-c", code, str(tiny), blocked + ",starlette"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["error"] == "ConfigError" and "edgeprune[serve]" in got["text"], out.stderr


def test_serve_verb(tiny, capsys):
    from _cli import one_line_error, run_cli

    for args, needle in ((["--max-concurrency", 0], "max_concurrency"),
                         (["--queue-size", -1], "queue_size"),
                         (["--max-request-bytes", 0], "max_request_bytes")):
        code, _, err = run_cli(["serve", tiny, *args], capsys)
        one_line_error(code, err, needle)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, _, err = run_cli(["serve", tiny, "--port", port, "--log-level", "critical"], capsys)
        one_line_error(code, err, f"cannot listen on 127.0.0.1:{port}", "--port")
    proc = subprocess.Popen([sys.executable, "-m", "edgeprune.cli", "serve", str(tiny), "--port",
                             str(port), "--threads", "1", "--max-concurrency", "2",
                             "--model-name", "tiny-cli"], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=30)
        t0 = time.monotonic()
        while True:
            try:
                assert [m.id for m in client.models.list().data] == ["tiny-cli"]
                break
            except openai.APIConnectionError:
                assert proc.poll() is None and time.monotonic() - t0 < 90, proc.communicate()
                time.sleep(0.2)
        r = client.chat.completions.create(model="tiny-cli", messages=USER, max_tokens=4)
        assert r.usage.completion_tokens <= 4 and r.model == "tiny-cli"
    finally:
        proc.send_signal(2)                 # Ctrl-C: uvicorn shuts down, the sessions close
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "2 slot(s), queue 8" in err and "prompt tokens" in err and "Traceback" not in err


def test_shutdown_cancels_running_answers(tiny):
    sessions = load_slots(tiny, 1, threads=1)
    sessions[0].eos_token_ids = []
    _slow(sessions[0], 0.01, {"now": 0, "max": 0})
    srv = ServerThread(create_app(sessions, "tiny")).start()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model="tiny", messages=USER, max_tokens=450,
                                            stream=True)
    it = iter(stream)
    next(it)
    got = []

    def drain():
        try:
            got.extend(it)
        except openai.APIError as e:
            got.append(e)

    t = threading.Thread(target=drain)
    t.start()
    srv.stop()
    t.join(30)
    assert isinstance(got[-1], openai.APIError) and "shutting down" in str(got[-1])
    assert sessions[0].kv_cache_state() == {"allocated_bytes": 0, "cached_tokens": 0}
    sessions[0].close()
