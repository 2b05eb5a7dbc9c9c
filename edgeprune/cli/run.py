"""``edgeprune run``: the main job (compress, evaluate, export, run, report)."""

from __future__ import annotations

from pathlib import Path

import click

from ._app import cli
from ._common import (_check_output, _console, _parse_levels, _parse_pattern, _table, _write_json,
                      method_options, threads_option)

@cli.command("run")
@click.option("--model", default="smollm2-135m", show_default=True,
              help="Alias, .gguf file, HF folder or hub id.")
@method_options
@click.option("--eval-text", default=None, help="Evaluation text file (default: embedded held-out text).")
@click.option("--eval-seqlen", type=int, default=512, show_default=True,
              help="Tokens per evaluation window (capped at the model's context).")
@click.option("--eval-nwindows", type=int, default=40, show_default=True, help="0 = the whole text.")
@click.option("--decode-windows", type=int, default=2, show_default=True,
              help="Evaluation windows also scored on the decode path (token by token through the KV cache).")
@click.option("--accuracy-level-for", "accuracy_levels", multiple=True, metavar="SUFFIX=LEVEL",
              help="MatMulNBits compute of the compressed export per projection (4 = int8 activations, "
                   "the default; 0 = fp32, the same logits in one pass and decode steps), e.g. down_proj=0 "
                   "(repeatable).")
@threads_option(default=2, help="CPU threads for torch and onnxruntime.")
@click.option("--prompt-len", type=int, default=128, show_default=True)
@click.option("--gen-len", type=int, default=128, show_default=True)
@click.option("--repeat", type=int, default=3, show_default=True)
@click.option("--out", "out_dir", default="runs/demo", show_default=True, help="Output folder.")
@click.option("--overwrite", is_flag=True, help="Replace an output folder holding a different run.")
@click.option("--json", "json_path", default=None, help="Also write the report to this JSON file.")
def run_cmd(model, method, recipe, bits, group_size, sym, sparsity, pattern, calib, nsamples, seqlen,
            seed, device, eval_text, eval_seqlen, eval_nwindows, decode_windows, accuracy_levels, threads, prompt_len, gen_len, repeat,
            out_dir, overwrite, json_path):
    """The main job: compress, evaluate, export, run and report on one model."""
    _check_output(out_dir, "--out", folder=True)   # writable; input protection follows
    _check_output(json_path, "--json", [model])
    from ..pipeline import COMPRESSED_COLUMN, PYTORCH_COLUMN, RunConfig, next_commands, run_pipeline

    pn, pm = _parse_pattern(pattern)
    cfg = RunConfig(model=model, method=method, recipe=recipe, bits=bits, group_size=group_size, sym=sym,
                    sparsity=sparsity, prune_n=pn, prune_m=pm, calib=calib, nsamples=RunConfig.nsamples if nsamples is None else nsamples,
                    seqlen=seqlen, seed=seed, eval_text=eval_text, eval_seqlen=eval_seqlen,
                    eval_nwindows=eval_nwindows, decode_windows=decode_windows,
                    accuracy_levels=_parse_levels(accuracy_levels) or None,
                    threads=threads, prompt_len=prompt_len, gen_len=gen_len, repeat=repeat, device=device)
    con = _console()
    rep = run_pipeline(cfg, out_dir, overwrite=overwrite, log=lambda m: con.print(m))
    rows = [[k, v.get("dense"), v.get("compressed"), v.get("pytorch")] for k, v in rep.rows.items()]
    con.print(_table(f"{model}: dense vs compressed ({rep.compression.get('recipe', {}).get('name', '')})",
                     ["metric", "dense", COMPRESSED_COLUMN, PYTORCH_COLUMN], rows))
    con.print(f"one pass: every evaluation window in one prefill pass; decode path: the first "
              f"{decode_windows} window(s) token by token through the KV cache, as generation runs")
    for k, s in rep.samples.items():
        con.print(f"{k} sample: {s}")
    con.print(f"report: {Path(rep.out_dir) / 'report.md'} and report.json "
              f"(total {rep.seconds.get('total', 0):.0f} s)")
    _write_json(json_path, rep.to_dict())
    con.print("next, try the compressed export:")
    for c in next_commands(Path(rep.out_dir) / "onnx-compressed"):
        con.print(f"  {c}", markup=False, highlight=False)
