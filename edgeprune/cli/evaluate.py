"""``edgeprune eval``: perplexity, fidelity, task accuracy (lm-eval) and per-language
perplexity of a model, checkpoint or export."""

from __future__ import annotations

import click

from edgeprune_runtime.errors import ConfigError

from ._app import cli
from ._common import _check_output, _console, _table, _write_json, threads_option


@cli.command("eval")
@click.argument("model")
@click.option("--text", default=None, help="Text file: plain UTF-8, .jsonl ({\"text\": ...} per line) "
                                          "or .parquet ('text' column) (default: embedded held-out text).")
@click.option("--seqlen", type=int, default=512, show_default=True)
@click.option("--nwindows", type=int, default=40, show_default=True, help="0 = the whole text.")
@click.option("--dense", "dense_ref", default=None,
              help="Reference model for KL / top-1 agreement / activation SNR / continuation change "
                   "(and the languages' relative change).")
@click.option("--continuations", type=int, default=0, show_default=True,
              help="With --dense: prompts whose 32-token greedy continuation is compared (0 = skip).")
@click.option("--tasks", default=None,
              help="lm-eval tasks, comma-separated: piqa,arc_easy,arc_challenge,hellaswag,winogrande,boolq,"
                   "openbookqa,lambada_openai,copa,rte,xcopa (needs edgeprune[eval]).")
@click.option("--limit", type=int, default=None, help="First N documents of each task (default: all).")
@click.option("--task-data", default=None, type=click.Path(file_okay=False),
              help="Folder of local task files (docs/study.md gives the layout); without it lm-eval reads "
                   "its hub data (online).")
@click.option("--num-fewshot", type=int, default=None, help="Few-shot examples (default: each task's, 0).")
@click.option("--langs", default=None,
              help="Parallel text: a folder of one .txt per language (e.g. NTREX-128) or comma-separated files.")
@click.option("--lang-lines", type=int, default=200, show_default=True, help="First lines of each language file.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="Precision of a PyTorch model's task and language scoring (perplexity on --text stays "
                   "float32); bfloat16 is about 2x faster on CPUs with AVX512-BF16 or AMX.")
@threads_option()
@click.option("--json", "json_path", default=None, help="Write the figures here.")
def eval_cmd(model, text, seqlen, nwindows, dense_ref, continuations, tasks, limit, task_data, num_fewshot,
             langs, lang_lines, dtype, threads, json_path):
    """Evaluate MODEL (alias, .gguf, HF folder, checkpoint or ONNX export folder).

    Perplexity on --text (with --dense: fidelity to that model), task accuracy with
    --tasks, per-language perplexity with --langs. With --tasks or --langs alone the
    perplexity on the default text is skipped (give --text or --dense to add it).
    """
    _check_output(json_path, "--json", [model] + ([dense_ref] if dense_ref else []))
    if continuations and not dense_ref:
        raise ConfigError("--continuations compares against a dense model", "add --dense MODEL")
    # every input checked before a model loads
    task_names = None
    if tasks:
        from ..evaluation.tasks import check_tasks

        task_names = check_tasks(tasks, task_data)
    elif limit is not None or task_data is not None:
        raise ConfigError("--limit / --task-data apply to tasks", "add --tasks (e.g. --tasks piqa,arc_easy)")
    languages = None
    if langs:
        from ..evaluation.languages import load_languages

        languages = load_languages(langs)
    if threads:
        import torch

        torch.set_num_threads(threads)
    from ..evaluation.backends import is_export, load_evaluated, scoring_model

    if dtype != "float32" and (is_export(model) or (dense_ref and is_export(dense_ref))):
        raise ConfigError(f"--dtype {dtype} applies to PyTorch models; an export runs in its graph's precision",
                          "drop --dtype for an export")
    m, tok = load_evaluated(model, threads)
    d = None
    if dense_ref:
        d, _ = load_evaluated(dense_ref, threads)
    con = _console()
    out: dict = {"model": model, "dtype": dtype}
    if text is not None or dense_ref or not (tasks or langs):
        out.update(_perplexity(con, model, m, d, tok, text, seqlen, nwindows, continuations))
    if dtype != "float32" and (task_names or languages):      # tasks and languages in dtype
        m = scoring_model(m, dtype)
        d = scoring_model(d, dtype) if d is not None else None
    if task_names:
        from ..evaluation.tasks import run_tasks

        r = run_tasks(m, tok, task_names, limit=limit, task_data=task_data, num_fewshot=num_fewshot)
        con.print(_table(f"{model}: tasks ({r.protocol['harness']}, limit {limit or 'all'})",
                         ["task", "acc", "acc_norm", "± stderr", "documents"],
                         [[k, v.acc, v.acc_norm, v.acc_stderr, v.n] for k, v in r.tasks.items()]))
        if r.protocol.get("prepared"):
            con.print(f"task data: {r.protocol['prepared']} (`lm_eval --include_path` reads this folder as it is)")
        out["tasks"] = r.to_dict()
    if languages:
        from ..evaluation.languages import language_perplexity

        base = None
        if d is not None:
            base = {k: v.ppl for k, v in language_perplexity(d, tok, languages, lines=lang_lines,
                                                               seqlen=seqlen).items()}
        lr = language_perplexity(m, tok, languages, lines=lang_lines, seqlen=seqlen, dense=base)
        con.print(_table(f"{model}: languages (first {lang_lines} lines, windows of {seqlen})",
                         ["language", "perplexity", "dense", "change"],
                         [[f"{v.name} ({k})", v.ppl, v.ppl_dense,
                           None if v.rel_change is None else f"{100 * v.rel_change:+.1f} %"] for k, v in lr.items()]))
        out["languages"] = {k: v.to_dict() for k, v in lr.items()}
    _write_json(json_path, out)


def _perplexity(con, name, m, d, tok, text, seqlen, nwindows, continuations) -> dict:
    """Perplexity (or, with a dense model, fidelity) on the protocol's windows, printed."""
    from ..evaluation import fidelity, perplexity

    nw = None if nwindows == 0 else nwindows
    if d is not None:
        r = fidelity(d, m, tok, text, seqlen=seqlen, nwindows=nw, continuations=continuations)
        rows = [["perplexity", r.ppl], ["dense perplexity", r.ppl_dense], ["KL(dense||model) nats/token", r.kl],
                ["top-1 agreement", r.top1_agree], ["activation SNR (dB, mean of layers)", r.snr_db]]
        if r.continuation_change is not None:
            rows.append([f"greedy continuations changed ({r.continuation_tokens} tokens)", r.continuation_change])
    else:
        r = perplexity(m, tok, text, seqlen=seqlen, nwindows=nw)
        rows = [["perplexity", r.ppl], ["NLL nats/token", r.nll]]
    proto = r.protocol
    con.print(_table(f"{name}", ["metric", "value"], rows))
    con.print(f"protocol: {proto.text_source} (sha256 {proto.text_sha256[:12]}…), no BOS, "
              f"{proto.nwindows} x {proto.seqlen} tokens, {proto.ntokens_scored} scored")
    return r.to_dict()
