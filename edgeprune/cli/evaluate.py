"""``edgeprune eval``: perplexity and fidelity of a model, checkpoint or export."""

from __future__ import annotations

from pathlib import Path

import click

from runtime.errors import ConfigError

from ._app import cli
from ._common import _check_output, _console, _table, _write_json

@cli.command("eval")
@click.argument("model")
@click.option("--text", default=None, help="Text file: plain UTF-8, .jsonl ({\"text\": ...} per line) "
                                          "or .parquet ('text' column) (default: embedded held-out text).")
@click.option("--seqlen", type=int, default=512, show_default=True)
@click.option("--nwindows", type=int, default=40, show_default=True, help="0 = the whole text.")
@click.option("--dense", "dense_ref", default=None, help="Reference model for KL / top-1 agreement.")
@click.option("--threads", type=int, default=None, help="CPU threads (torch and onnxruntime; default: all).")
@click.option("--json", "json_path", default=None, help="Write the figures here.")
def eval_cmd(model, text, seqlen, nwindows, dense_ref, threads, json_path):
    """Perplexity of MODEL (alias, .gguf, HF folder, checkpoint or ONNX export folder)."""
    _check_output(json_path, "--json", [model] + ([dense_ref] if dense_ref else []))
    from ..evaluate import fidelity, perplexity

    if threads is not None and threads < 1:
        raise ConfigError(f"--threads {threads} must be >= 1", "pass e.g. --threads 2, or omit it for all")
    if threads:
        import torch

        torch.set_num_threads(threads)
    nw = None if nwindows == 0 else nwindows
    m, tok = _load_any(model, threads)
    con = _console()
    if dense_ref:
        d, _ = _load_any(dense_ref, threads)
        r = fidelity(d, m, tok, text, seqlen=seqlen, nwindows=nw)
        rows = [["perplexity", r.ppl], ["dense perplexity", r.ppl_dense], ["KL(dense||model) nats/token", r.kl],
                ["top-1 agreement", r.top1_agree]]
        out = r.to_dict()
        proto = r.protocol
    else:
        r = perplexity(m, tok, text, seqlen=seqlen, nwindows=nw)
        rows = [["perplexity", r.ppl], ["NLL nats/token", r.nll]]
        out = r.to_dict()
        proto = r.protocol
    out["model"] = model
    con.print(_table(f"{model}", ["metric", "value"], rows))
    con.print(f"protocol: {proto.text_source} (sha256 {proto.text_sha256[:12]}…), no BOS, "
              f"{proto.nwindows} x {proto.seqlen} tokens, {proto.ntokens_scored} scored")
    _write_json(json_path, out)


def _load_any(source: str, threads=None):
    """A torch model, or an ONNX export folder wrapped as a logits function."""
    p = Path(source)
    if p.is_dir() and (p / "model.onnx").is_file() and (p / "edgeprune.json").is_file():
        import numpy as np
        from transformers import PreTrainedTokenizerFast

        import runtime

        sess = runtime.load(p, threads=threads)
        tok = PreTrainedTokenizerFast(tokenizer_file=str(p / "tokenizer.json"))

        def fn(ids):
            return sess.logits(np.asarray(ids, dtype=np.int64))

        # the trained context, for evaluation's check (exports record it since this field)
        ctx = sess.meta.get("max_position_embeddings")
        if isinstance(ctx, int):
            from types import SimpleNamespace
            fn.config = SimpleNamespace(max_position_embeddings=ctx)
        return fn, tok
    from ..models import load_model

    return load_model(source)
