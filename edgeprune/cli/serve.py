"""``edgeprune serve``: an OpenAI-compatible HTTP server over an export (runtime only, no torch).

The server itself is :mod:`runtime.serve` (Starlette + uvicorn, the ``serve`` extra).
"""

from __future__ import annotations

import click

from ._app import cli
from ._common import threads_option


@cli.command("serve")
@click.argument("folder")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface; no authentication).")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--max-concurrency", type=int, default=1, show_default=True,
              help="Generations at once (one KV cache each; the weights are loaded once).")
@click.option("--queue-size", type=int, default=8, show_default=True,
              help="Requests that may wait for a free slot; beyond them the answer is 503.")
@click.option("--max-request-bytes", type=int, default=1 << 20, show_default=True,
              help="Largest request body; beyond it the answer is 413.")
@click.option("--max-tokens", type=int, default=None,
              help="Most tokens of an answer whose request sets no max_tokens (default: the "
                   "rest of the context).")
@click.option("--model-name", default=None,
              help="The model name clients see in /v1/models (default: the folder's name).")
@threads_option(help="CPU threads for torch and onnxruntime (onnxruntime's shared by the slots; default: all cores).")
@click.option("--max-length", type=int, default=None,
              help="Context length in tokens (default and upper bound: the export's).")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]),
              default="info", show_default=True, help="info logs one line per request.")
def serve_cmd(folder, host, port, max_concurrency, queue_size, max_request_bytes, max_tokens,
              model_name, threads, max_length, log_level):
    """Serve an exported FOLDER with OpenAI's API: /v1/chat/completions, /v1/completions
    (streaming by server-sent events), /v1/models, /health.

    The KV cache of each slot keeps the conversation it served last: the next turn of that
    conversation processes only its new message. Point any OpenAI client at
    http://HOST:PORT/v1 (the API key is not checked)."""
    from edgeprune_runtime.serve import serve

    serve(folder, host=host, port=port, max_concurrency=max_concurrency, queue_size=queue_size,
          max_request_bytes=max_request_bytes, threads=threads, max_length=max_length,
          model_name=model_name, max_tokens=max_tokens, log_level=log_level)
