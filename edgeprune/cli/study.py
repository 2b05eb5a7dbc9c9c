"""``edgeprune study``: the pruning-vs-quantization grid in one command (docs/study.md)."""

from __future__ import annotations

import click

from edgeprune_runtime.errors import ConfigError

from ._app import cli
from ._common import _check_output, _console, threads_option


def _split(text) -> list[str]:
    return [s.strip() for s in str(text).split(",") if s.strip()] if text else []


@cli.command("study")
@click.option("--models", default="smollm2-135m", show_default=True,
              help="Comma-separated models (aliases, .gguf files, HF folders).")
@click.option("--methods", default=None, help="Comma-separated methods of the cross product (gptq,awq,sparsegpt,wanda,rtn,magnitude).")
@click.option("--bits", default=None, help="Quantizers' bit widths, e.g. 4,8.")
@click.option("--sparsity", default=None, help="Pruners' unstructured sparsities, e.g. 0.5,0.75.")
@click.option("--pattern", default=None, help="Pruners' N:M patterns, e.g. 2:4.")
@click.option("--cells", default=None,
              help="Explicit cells instead of the cross product: METHOD:BITS, METHOD:SPARSITY or METHOD:N:M, "
                   "e.g. gptq:4,awq:4,gptq:8,sparsegpt:0.5,wanda:0.5,sparsegpt:2:4 (dense always runs).")
@click.option("--group-size", default="auto", show_default=True,
              help="Quantizers' group size: auto (128 where every layer width allows, else 64), or a number.")
@click.option("--calib", default=None, help="Calibration text (.txt/.jsonl/.parquet, hf:NAME, self; default: embedded).")
@click.option("--nsamples", type=int, default=128, show_default=True)
@click.option("--seqlen", type=int, default=512, show_default=True, help="Tokens per calibration window.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--text", default=None, help="Fidelity text (perplexity, KL, top-1, SNR; default: embedded held-out text).")
@click.option("--eval-seqlen", type=int, default=512, show_default=True, help="Window of the text and the languages.")
@click.option("--nwindows", type=int, default=40, show_default=True, help="Windows of the text (0 = all).")
@click.option("--continuations", type=int, default=32, show_default=True,
              help="Prompts whose 32-token greedy continuation is compared with the dense model's (0 = skip).")
@click.option("--tasks", default=None, help="lm-eval tasks, e.g. piqa,arc_easy,arc_challenge,hellaswag,winogrande,boolq,openbookqa.")
@click.option("--limit", type=int, default=None, help="First N documents of each task.")
@click.option("--task-data", default=None, type=click.Path(file_okay=False), help="Folder of local task files.")
@click.option("--langs", default=None, help="Parallel text: folder of one .txt per language, or files.")
@click.option("--lang-lines", type=int, default=200, show_default=True, help="First lines of each language file.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="Precision of task and language scoring (the fidelity text is always float32); bfloat16 "
                   "is about 2x faster on CPUs with AVX512-BF16 or AMX.")
@click.option("--calib-dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="Precision of the compressions' calibration forward passes (weights, Hessians and the "
                   "methods stay float32); bfloat16 is about 1.7x faster on CPUs with AVX512-BF16 or AMX.")
@click.option("--device", default="cpu", show_default=True)
@threads_option(help="Torch threads per cell (Ray: the CPUs each cell declares; default: all cores).")
@click.option("--ray", "ray_address", default=None, help="Run cells as Ray tasks: 'local' or a cluster ADDRESS.")
@click.option("--cache", default=None, help="Cache folder (default: OUT/cache).")
@click.option("--out", "out_dir", required=True, help="Folder for results.csv/.md/.json and plots/.")
@click.option("--no-plots", is_flag=True, help="Skip the PNG plots.")
def study_cmd(models, methods, bits, sparsity, pattern, cells, group_size, calib, nsamples, seqlen, seed, text,
              eval_seqlen, nwindows, continuations, tasks, limit, task_data, langs, lang_lines, dtype, calib_dtype, device,
              threads, ray_address, cache, out_dir, no_plots):
    """Run the pruning-vs-quantization grid: every model x compression cell, measured on
    fidelity, tasks and languages; cached by content hash (a re-run computes only what
    changed)."""
    from ..study import StudyConfig, expand_grid, parse_cells, run_study

    _check_output(out_dir, "--out", _split(models), folder=True)
    if cells and (methods or bits or sparsity or pattern):
        raise ConfigError("--cells lists the cells itself", "drop --methods/--bits/--sparsity/--pattern, or --cells")
    if cells:
        grid = parse_cells(cells, group_size)
    else:
        grid = expand_grid(_split(methods), _split(bits), _split(sparsity), _split(pattern), group_size)
    task_names = []
    if tasks:
        from ..evaluation.tasks import check_tasks

        task_names = check_tasks(tasks, task_data)
    elif limit is not None or task_data is not None:
        raise ConfigError("--limit / --task-data apply to tasks", "add --tasks")
    cfg = StudyConfig(models=_split(models), cells=grid, group_size=group_size, calib=calib, nsamples=nsamples,
                      seqlen=seqlen, seed=seed, text=text, eval_seqlen=eval_seqlen, nwindows=nwindows or None,
                      continuations=continuations, tasks=task_names, limit=limit, task_data=task_data, langs=langs,
                      lang_lines=lang_lines, dtype=dtype, calib_dtype=calib_dtype, device=device, threads=threads, cache=cache)
    con = _console()
    con.print(f"study: {len(cfg.models)} model(s) x {len(grid)} cells: {', '.join(c.label for c in grid)}")
    table = run_study(cfg, out_dir, ray_address=ray_address, log=lambda m: con.print(m))
    con.print(table.to_markdown())
    done = table.computed()
    failed = [o for o in table.outcomes if o.status == "failed"]
    con.print(f"computed {sum(len(u) for _, _, u in done)} measurement(s) in {len(done)} cell(s); "
              f"{len(table.outcomes) - len(done) - len(failed)} cell(s) from the cache; {len(failed)} failed")
    con.print(f"wrote {out_dir}/results.csv, results.md, results.json" + (f" and {len(table.plots)} plots" if table.plots else ""))
