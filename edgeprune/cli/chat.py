"""``edgeprune chat``: an interactive terminal chat with an export (runtime only, no torch).

One session holds the conversation; with prefix reuse (the default) each turn keeps the KV
rows of the conversation so far and processes only the new message. Commands: ``/reset``
(new conversation, same system prompt), ``/system TEXT`` (new system prompt, new
conversation), ``/quit``; Ctrl-C stops an answer, at the prompt it ends the chat.
"""

from __future__ import annotations

import sys
from typing import Iterator, Optional

import click

from ._app import cli
from ._common import threads_option

HELP = "commands: /reset (new conversation), /system TEXT (new system prompt), /quit"
#: an answer gets at least this many tokens of room before older turns are dropped
MIN_ANSWER_TOKENS = 32


class Conversation:
    """The messages of a chat, fitted to the session's context.

    Args:
        session: a loaded ``runtime.Session`` whose tokenizer has a chat template.
        system: the system prompt (``None``: none).
        max_new_tokens: the most tokens of one answer.
    """

    def __init__(self, session, system: Optional[str], max_new_tokens: int):
        self.session, self.system, self.max_new_tokens = session, system, int(max_new_tokens)
        self.turns: list[dict] = []

    def reset(self, system: Optional[str] = None) -> None:
        """Forget the turns (and set a new system prompt when one is given)."""
        self.turns = []
        if system is not None:
            self.system = system or None

    def messages(self, user: Optional[str] = None) -> list[dict]:
        """The system prompt, the turns so far, and ``user`` if given."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        tail = [{"role": "user", "content": user}] if user is not None else []
        return head + self.turns + tail

    def fit(self, user: str) -> tuple[list[dict], int, int]:
        """``(messages, max_new_tokens, dropped turns)`` for the next answer: the oldest
        exchanges are dropped while the answer would get less than
        ``min(max_new_tokens, MIN_ANSWER_TOKENS)`` tokens of context.

        Raises:
            GenerationError: the system prompt and the message alone leave no room.
        """
        from edgeprune_runtime.errors import GenerationError

        tok, limit = self.session.tokenizer, self.session.max_length
        dropped = 0
        while True:
            msgs = self.messages(user)
            n = len(tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True)))
            room = limit - n + 1
            if room >= min(self.max_new_tokens, MIN_ANSWER_TOKENS):
                return msgs, min(self.max_new_tokens, room), dropped
            if len(self.turns) < 2:
                raise GenerationError(f"the message ({n} tokens with the system prompt) leaves no "
                                      f"room to answer in the context of {limit} tokens",
                                      "send a shorter message, or /system with a shorter prompt")
            self.turns = self.turns[2:]
            dropped += 1

    def add(self, user: str, answer: str) -> None:
        """Record a finished exchange."""
        self.turns += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def _lines(stream, interactive: bool) -> Iterator[str]:
    """Lines typed (or piped) in, without their newline; ends at end of input."""
    while True:
        if interactive:
            click.secho("> ", bold=True, nl=False)
        line = stream.readline()
        if not line:
            return
        yield line.rstrip("\n")


def _stats(res, finish: Optional[str]) -> str:
    """One dim line after an answer: tokens, speed, first-token time, the reused prefix."""
    n = len(res.token_ids[0])
    end = {"length": ", cut at --max-new-tokens", "stop": "", "eos": "",
           "cancelled": ", interrupted"}.get(finish or "", "")
    return (f"[{n} tokens, {res.decode_tok_s:.1f} tok/s, first token {res.ttft_ms:.0f} ms, "
            f"prompt {res.prompt_tokens[0]} tokens ({res.cached_tokens} reused){end}]")


def chat_loop(session, conv: Conversation, sampling: dict, lines) -> int:
    """Answer each line of ``lines`` in ``conv`` on ``session``; returns the turns answered."""
    from edgeprune_runtime.errors import GenerationError

    answered = 0
    for line in lines:
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            cmd, _, arg = text.partition(" ")
            if cmd in ("/quit", "/exit"):
                break
            if cmd == "/reset":
                conv.reset()
                click.secho("[new conversation]", dim=True, err=True)
            elif cmd == "/system":
                conv.reset(arg.strip())
                click.secho(f"[system prompt {'set' if arg.strip() else 'removed'}; new conversation]",
                            dim=True, err=True)
            else:
                click.secho(HELP, dim=True, err=True)
            continue
        try:
            msgs, max_new, dropped = conv.fit(line)
        except GenerationError as e:
            click.secho(f"error: {e}", fg="red", err=True)
            continue
        if dropped:
            click.secho(f"[the {dropped} oldest exchange(s) no longer fit the context: dropped]",
                        dim=True, err=True)
        stream = session.stream(msgs, max_new_tokens=max_new, **sampling)
        pieces = []
        try:
            for piece in stream:
                pieces.append(piece)
                click.echo(piece, nl=False)
        except KeyboardInterrupt:
            stream.close()
        click.echo()
        if stream.result is not None:
            click.secho(_stats(stream.result, stream.finish_reason), dim=True, err=True)
        if stream.finish_reason != "cancelled":
            conv.add(line, "".join(pieces))
            answered += 1
    return answered


@cli.command("chat")
@click.argument("folder")
@click.option("--system", default=None, help="System prompt (kept across /reset).")
@click.option("--max-new-tokens", type=int, default=512, show_default=True,
              help="Most tokens of one answer.")
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help="Sampling temperature (0: greedy).")
@click.option("--top-k", type=int, default=0, show_default=True,
              help="Sample among the k likeliest tokens (0: all).")
@click.option("--top-p", type=float, default=1.0, show_default=True,
              help="Nucleus sampling: the likeliest tokens up to this probability mass.")
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True,
              help="Divide the logits of tokens already seen by this (1: off).")
@click.option("--seed", type=int, default=None, help="Seed of the sampler.")
@threads_option()
@click.option("--max-length", type=int, default=None,
              help="Context length in tokens (default and upper bound: the export's).")
@click.option("--prefix-reuse/--no-prefix-reuse", default=True, show_default=True,
              help="Keep the KV cache of the conversation between turns (only the new message "
                   "is processed).")
def chat_cmd(folder, system, max_new_tokens, temperature, top_k, top_p, repetition_penalty, seed,
             threads, max_length, prefix_reuse):
    """Chat with an exported FOLDER in the terminal (runtime only, no torch).

    Type a message and Enter; /reset starts a new conversation, /system TEXT sets a new
    system prompt, /quit (or end of input) ends. Ctrl-C stops an answer."""
    import edgeprune_runtime as runtime
    from edgeprune_runtime.errors import ConfigError

    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {max_new_tokens}",
                          "pass e.g. --max-new-tokens 512")
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p,
                    repetition_penalty=repetition_penalty, seed=seed)
    with runtime.load(folder, threads=threads, max_length=max_length) as sess:
        if not sess.tokenizer.chat_template:
            raise ConfigError(f"{folder} has no chat template",
                              "use `edgeprune generate --no-chat` for plain completions")
        sess.reuse_prefix = prefix_reuse
        interactive = sys.stdin.isatty()
        if interactive:
            click.secho(f"chatting with {folder} ({HELP})", dim=True, err=True)
        conv = Conversation(sess, system, max_new_tokens)
        try:
            chat_loop(sess, conv, sampling, _lines(sys.stdin, interactive))
        except KeyboardInterrupt:
            click.echo()
