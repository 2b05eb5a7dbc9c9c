"""``edgeprune chat`` on the tiny llama export: answers equal the runtime's for the same
conversation, later turns reuse the KV rows of the earlier ones (and recompute with
--no-prefix-reuse), /reset and /system, old exchanges dropped when the context is full."""

from __future__ import annotations

import io
import json
import re
import shutil

import pytest

import edgeprune_runtime as runtime
from edgeprune.cli.chat import Conversation
from edgeprune_runtime.errors import GenerationError

from _cli import one_line_error, run_cli
from tiny import export_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder, _, _ = export_tiny_llama(tmp_path_factory.mktemp("chat") / "llama", max_length=512)
    return folder


def _chat(tiny, lines, capsys, monkeypatch, *args):
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(x + "\n" for x in lines)))
    return run_cli(["chat", tiny, "--max-new-tokens", 12, "--threads", 1, *args], capsys)


def _reused(err):
    return [int(m) for m in re.findall(r"\((\d+) reused", err)]


def test_chat_turns_match_the_runtime_and_reuse_the_prefix(tiny, capsys, monkeypatch):
    code, out, err = _chat(tiny, ["How are you?", "", "Why?", "/reset", "How are you?", "/quit",
                                  "never read"], capsys, monkeypatch, "--system", "Be brief.")
    assert code == 0, err
    with runtime.load(tiny, threads=1) as s:
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How are you?"}]
        a1 = s.generate(msgs, max_new_tokens=12).text
        msgs += [{"role": "assistant", "content": a1}, {"role": "user", "content": "Why?"}]
        a2 = s.generate(msgs, max_new_tokens=12).text
    assert out == f"{a1}\n{a2}\n{a1}\n"
    reused = _reused(err)
    assert len(reused) == 3 and reused[0] == 0 and reused[1] > 0 and reused[2] > 0
    assert "new conversation" in err and "tok/s" in err and "first token" in err
    code, out2, err = _chat(tiny, ["How are you?", "Why?"], capsys, monkeypatch,
                            "--system", "Be brief.", "--no-prefix-reuse")
    assert code == 0 and out2 == f"{a1}\n{a2}\n" and _reused(err) == [0, 0]
    # /system sets a new prompt (and a new conversation); unknown commands print the help
    code, out, err = _chat(tiny, ["/system Answer in French.", "/what", "Hello"], capsys, monkeypatch)
    assert code == 0 and "system prompt set" in err and "/reset" in err
    with runtime.load(tiny, threads=1) as s:
        ref = s.generate([{"role": "system", "content": "Answer in French."},
                          {"role": "user", "content": "Hello"}], max_new_tokens=12).text
    assert out == ref + "\n"


def test_old_exchanges_are_dropped_when_the_context_is_full(tiny):
    with runtime.load(tiny, threads=1, max_length=96) as s:
        conv = Conversation(s, "Be brief.", 40)
        for i in range(4):
            conv.add(f"question {i} " * 3, f"answer {i} " * 3)
        msgs, n, dropped = conv.fit("next question")
        assert dropped >= 1 and msgs[0]["role"] == "system" and msgs[-1]["content"] == "next question"
        assert 1 <= n <= 40 and len(conv.turns) == 8 - 2 * dropped
        with pytest.raises(GenerationError, match="no room"):
            conv.fit("word " * 200)


def test_chat_needs_a_chat_template(tiny, tmp_path, capsys, monkeypatch):
    bare = tmp_path / "bare"
    shutil.copytree(tiny, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    code, _, err = _chat(bare, ["hi"], capsys, monkeypatch)
    one_line_error(code, err, "no chat template", "--no-chat")
