"""``edgeprune generate``: stream a completion from an export (runtime only)."""

from __future__ import annotations

import click

from ._app import cli
from ._common import threads_option

@cli.command("generate")
@click.argument("folder")
@click.argument("prompt")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-k", type=int, default=0)
@click.option("--top-p", type=float, default=1.0)
@click.option("--repetition-penalty", type=float, default=1.0)
@click.option("--seed", type=int, default=None)
@click.option("--chat/--no-chat", default=True, show_default=True, help="Render with the chat template.")
@threads_option()
@click.option("--max-length", type=int, default=None,
              help="Context length in tokens (default and upper bound: the export's).")
@click.option("--context-policy", type=click.Choice(["error", "sliding_window"]), default="error",
              show_default=True, help="What happens when the context is full: raise, or re-prefill "
                                      "the last max_length // 2 tokens and go on (a longer "
                                      "prompt is cut to that window too).")
@click.option("--stop", "stops", multiple=True,
              help="Stop string (repeatable); the escapes \\n, \\t and \\\\ are understood, so "
                   "--stop '\\n\\n' stops at a blank line.")
@click.option("--prompt-lookup-num-tokens", type=int, default=0, show_default=True,
              help="Prompt-lookup speculative decoding: draft up to this many tokens from an "
                   "earlier occurrence of the last n-gram and score them in one pass (0: off). "
                   "Faster where the text repeats its context; same sampler, same draws.")
@click.option("--max-matching-ngram-size", type=int, default=2, show_default=True,
              help="Longest n-gram prompt lookup matches.")
def generate_cmd(folder, prompt, max_new_tokens, temperature, top_k, top_p, repetition_penalty, seed, chat,
                 threads, max_length, context_policy, stops, prompt_lookup_num_tokens,
                 max_matching_ngram_size):
    """Stream a completion of PROMPT from an exported FOLDER (runtime only, no torch)."""
    import edgeprune_runtime as runtime

    with runtime.load(folder, threads=threads, max_length=max_length,
                      context_policy=context_policy) as sess:
        for piece in sess.stream(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                 top_p=top_p, repetition_penalty=repetition_penalty, seed=seed, chat=chat,
                                 stop=[_unescape(x) for x in stops] or None,
                                 prompt_lookup_num_tokens=prompt_lookup_num_tokens,
                                 max_matching_ngram_size=max_matching_ngram_size):
            click.echo(piece, nl=False)
    click.echo()


def _unescape(text: str) -> str:
    r"""``\n``, ``\t`` and ``\\`` typed on a command line (shells pass them as two
    characters) as the characters they name; any other backslash is kept as it is."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in "nt\\":
            out.append({"n": "\n", "t": "\t", "\\": "\\"}[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)
