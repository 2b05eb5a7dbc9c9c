"""The click group and the console entry point (errors as one line, exit code 2)."""

from __future__ import annotations

import os
import re

import click

from edgeprune_runtime.errors import EdgePruneError


@click.group(context_settings=dict(help_option_names=["-h", "--help"]))
@click.version_option(package_name="edgeprune")
def cli():
    """edgeprune: compress, export, run and profile small language models on device."""


#: Python keyword arguments that library errors suggest, and the CLI flags that set them.
_CLI_FLAGS = {"threads": "--threads", "max_new_tokens": "--max-new-tokens", "max_length": "--max-length",
              "top_k": "--top-k", "top_p": "--top-p", "temperature": "--temperature",
              "repetition_penalty": "--repetition-penalty", "context_policy": "--context-policy",
              "prompt_len": "--prompt-len", "gen_len": "--gen-len", "repeat": "--repeat",
              "seed": "--seed", "min_per_head": "--min-per-head", "alignment": "--alignment",
              "prompt_lookup_num_tokens": "--prompt-lookup-num-tokens",
              "max_matching_ngram_size": "--max-matching-ngram-size"}


#: A clause that speaks of a file's field ("edgeprune.json says max_length=...", "field
#: max_length=..."): a ``name=value`` in it is what the file holds, not a flag to pass.
_FILE_FIELD = re.compile(r"\b[\w.-]+\.(json|toml|yaml|yml|onnx|safetensors|gguf)\b|\bfield\b")


def _as_cli_hint(message: str) -> str:
    """An error's text as the command line spells it: ``pass e.g. threads=2`` (the Python
    API's words) becomes ``pass e.g. --threads 2``. A ``name=value`` in a clause naming a
    file or a field (``edgeprune.json says max_length=...``) is left alone: it is what the
    file holds, not a flag."""
    pattern = re.compile(r"\b(" + "|".join(_CLI_FLAGS) + r")=(?!=)'?([\w.\-]+)'?")

    def flag(m: re.Match) -> str:
        clause = re.split(r"[,;:()]", message[:m.start()])[-1]
        if _FILE_FIELD.search(clause):
            return m.group(0)
        return f"{_CLI_FLAGS[m.group(1)]} {m.group(2)}"

    return pattern.sub(flag, message)


def main(argv=None) -> int:
    """Console entry point: runs the click group, turning edgeprune errors into one line.

    SIGTERM (``kill``, ``timeout``) is turned into the same clean stop as Ctrl-C, so the
    temporary output folders are removed on the way out."""
    import signal
    import warnings

    def _term(signum, frame):
        raise KeyboardInterrupt

    def _warn(message, category, filename, lineno, file=None, line=None):
        click.echo(f"warning: {message}", err=True)      # one line, no source excerpt

    prev_warn, warnings.showwarning = warnings.showwarning, _warn

    try:
        prev = signal.signal(signal.SIGTERM, _term)
    except ValueError:                       # not the main thread (embedded use): leave it
        prev = None
    try:
        cli.main(args=argv, prog_name="edgeprune", standalone_mode=False)
        return 0
    except EdgePruneError as exc:
        click.echo(f"error: {_as_cli_hint(str(exc))}", err=True)
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except KeyboardInterrupt:
        click.echo("interrupted; partial outputs were removed", err=True)
        return 130
    except Exception as exc:  # noqa: BLE001 -- last resort: one line, not a torch traceback
        if os.environ.get("EDGEPRUNE_DEBUG"):
            raise
        click.echo(f"internal error: {type(exc).__name__}: {exc} (set EDGEPRUNE_DEBUG=1 for the traceback "
                   "and report it)", err=True)
        return 1
    finally:
        warnings.showwarning = prev_warn
        if prev is not None:
            signal.signal(signal.SIGTERM, prev)

