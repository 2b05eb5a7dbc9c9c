"""The main job: compress -> evaluate -> save -> export -> run -> report, in one call.

:func:`run_pipeline` is what ``edgeprune run`` (and ``make demo``) calls. With no
arguments it takes the built-in ``smollm2-135m``, compresses it with the
:data:`DEFAULT_RECIPE` preset calibrated on 64 x 512 tokens sampled from the model itself,
each window seeded with a prompt in one of twelve languages (:data:`DEFAULT_CALIB`; no
dataset needed, and the int4 model keeps non-English text about as well as English),
evaluates the compressed model
against the dense one on the embedded held-out text (perplexity *and* fidelity: KL and
top-1 agreement, as the pruning-vs-quantization study recommends) twice: the PyTorch model
with dequantized weights (fake-quant), and the ONNX export that ships, through the runtime,
both in one teacher-forced pass and on the decode path (token by token through the KV
cache, what generation computes: the two differ for int4 ``MatMulNBits`` with int8
activations), saves a ``compressed-tensors`` checkpoint, exports both models to ONNX (dense
fp32 and the compressed one, int4 ``MatMulNBits`` when quantized), measures each in a fresh
runtime process (time to first token, decode tokens/s, peak RSS) and writes
``report.json`` + ``report.md`` into the output folder.

The output folder is written atomically: everything is built in a temporary sibling
folder that is renamed at the end, so a failure leaves nothing half-written. An
existing output folder holding a *different* run is refused unless ``overwrite``;
re-running the same settings replaces it. The folder is claimed for the whole run
(:func:`runtime.files.claim_output`): a second run into it is refused at once, and what a
killed run left beside it is removed by the next.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from edgeprune_runtime.files import OutputKind, atomic_folder, check_output, claim_output, write_json

from .errors import CalibrationError, CheckpointError, ConfigError

#: Default compression of the main job (see README for the measured trade-offs).
DEFAULT_METHOD = dict(method="gptq", bits=4, group_size=64, sym=False)
#: What ``edgeprune run`` compresses with when no method, recipe or method setting is
#: given: the ``best-w4-refit`` preset (GPTQ int4 g64 asym with static activation order,
#: clipped group grids and three rounds of least-squares scale refit, 8-bit ``v_proj`` and
#: first-layer ``down_proj``; ``edgeprune/recipes/best-w4-refit.yaml``).
DEFAULT_RECIPE = "best-w4-refit"
#: Calibration source of ``edgeprune run`` when ``--calib`` is not given: text sampled
#: from the model itself (``edgeprune.calibration.self_generated``), each window seeded
#: with a shipped prompt in one of twelve languages, :data:`DEFAULT_NSAMPLES` windows.
#: Unseeded, a small model writes mostly English and the int4 model loses twice as much
#: elsewhere. SmolLM2-135M int4 export (``bench/calibration_languages.py``), perplexity
#: increase NTREX English / worst of seven languages / WikiText-2: this default +11.8 /
#: +14.7 (German) / +11.9 %; best-w4 on 32 unseeded windows +12.3 / +28.8 / +11.6 %.
#: Dataset-free either way: best-w4 on self 32 x 512 scores WikiText-2 32.06 in PyTorch,
#: on the embedded documentation text 35.94, on C4 32.14 (dense 28.74).
DEFAULT_CALIB = "self-multilingual"
#: Calibration windows of ``edgeprune run`` (64 x 512 tokens; 32 seeded windows gave
#: NTREX English +12.5 % and WikiText-2 +12.9 % with the same recipe).
DEFAULT_NSAMPLES = 64
#: RunConfig fields that are settings of one method (any of them set -> no preset).
METHOD_SETTINGS = ("bits", "group_size", "sym", "sparsity", "prune_n", "prune_m")
DEFAULT_PROMPT = "Explain in two sentences why small language models are useful on phones."


@dataclass
class RunConfig:
    """Settings of one main-job run (all JSON-able; recorded in ``report.json``)."""

    model: str = "smollm2-135m"
    method: Optional[str] = None
    recipe: Optional[str] = None
    bits: Optional[int] = None
    group_size: Optional[int] = None
    sym: Optional[bool] = None
    sparsity: Optional[float] = None
    prune_n: Optional[int] = None
    prune_m: Optional[int] = None
    calib: Optional[str] = None          # None -> DEFAULT_CALIB; "default" = embedded text
    nsamples: int = DEFAULT_NSAMPLES
    seqlen: int = 512
    seed: int = 0
    eval_text: Optional[str] = None
    eval_seqlen: int = 512
    eval_nwindows: Optional[int] = 40
    decode_windows: int = 2              # windows scored token by token through the KV cache
    accuracy_levels: Optional[dict] = None  # MatMulNBits level per projection suffix (default: 4 everywhere)
    threads: int = 2
    prompt_len: int = 128
    gen_len: int = 128
    repeat: int = 3
    device: str = "cpu"
    prompt: str = DEFAULT_PROMPT

    def method_settings(self) -> dict[str, Any]:
        """The method name and its settings, falling back to :data:`DEFAULT_METHOD`."""
        if self.recipe:
            return {}
        if self.method is None and any(v is not None for v in
                                       (self.sparsity, self.prune_n, self.prune_m)):
            from .methods import config_classes

            pruners = [n for n, c in config_classes().items() if c.is_pruner]
            raise ConfigError("--sparsity/--pattern need a pruning method",
                              f"add --method {', '.join(pruners[:-1])} or {pruners[-1]}")
        method = self.method or DEFAULT_METHOD["method"]
        kw: dict[str, Any] = {k: getattr(self, k) for k in METHOD_SETTINGS}
        if self.method is None:
            for k, v in DEFAULT_METHOD.items():
                if k != "method" and kw.get(k) is None:
                    kw[k] = v
        return dict(method=method, **{k: v for k, v in kw.items() if v is not None})

    def fingerprint(self) -> str:
        d = {k: v for k, v in self.__dict__.items() if k not in ("threads", "repeat")}
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


PRESETS_DIR = Path(__file__).resolve().parent / "recipes"


def preset_names() -> list[str]:
    """Names of the recipe presets shipped in ``edgeprune/recipes/`` (e.g. ``best-w4``)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def resolve_recipe(recipe: str) -> Path:
    """A recipe file path, or the file of a shipped preset name.

    Raises:
        ConfigError: neither an existing file nor a preset name.
    """
    p = Path(recipe).expanduser()
    if p.is_file():
        return p
    preset = PRESETS_DIR / f"{recipe}.yaml"
    if preset.is_file():
        return preset
    raise ConfigError(f"recipe {recipe!r} is neither a file nor a preset",
                      f"pass a TOML/YAML file or one of: {', '.join(preset_names())}")


def build_recipe(cfg: RunConfig):
    """The :class:`~edgeprune.recipe.Recipe` a run config asks for: its ``recipe`` file or
    preset; else, with no method setting at all, the :data:`DEFAULT_RECIPE` preset; else
    ``method`` (default :data:`DEFAULT_METHOD`'s) with the given settings.

    Raises:
        ConfigError: unknown method or a setting the method does not take; method
            settings given beside a recipe (which fixes them all); ``sparsity`` beside an
            N:M pattern (which fixes the sparsity at 1 - N/M).
    """
    from .recipe import Recipe, method_config_from_name

    _OPT = {"prune_n": "pattern", "prune_m": "pattern"}
    if cfg.recipe:
        given = sorted({"--" + _OPT.get(k, k).replace("_", "-") for k in ("method",) + METHOD_SETTINGS
                        if getattr(cfg, k) is not None})
        if given:
            raise ConfigError(f"--recipe fixes the method and its settings; {', '.join(given)} "
                              "would be ignored", "edit the recipe (or copy a preset from "
                              "edgeprune/recipes/ and edit it), or drop --recipe")
        return Recipe.from_file(resolve_recipe(cfg.recipe))
    if cfg.sparsity is not None and (cfg.prune_n is not None or cfg.prune_m is not None):
        raise ConfigError(f"--sparsity {cfg.sparsity} and --pattern {cfg.prune_n}:{cfg.prune_m} "
                          "both given: an N:M pattern fixes the sparsity at 1 - N/M",
                          "pass --pattern alone (2:4 = 50%), or --sparsity alone (unstructured)")
    if cfg.method is None and all(getattr(cfg, k) is None for k in METHOD_SETTINGS):
        return Recipe.from_file(resolve_recipe(DEFAULT_RECIPE))
    ms = cfg.method_settings()
    name = ms.pop("method")
    return Recipe(stages=[method_config_from_name(name, **ms)], name=name)


#: The report's quality rows: (JSON key, the evaluation it comes from, its field); the
#: "compressed" column is the export through the runtime, "pytorch" the fake-quantized model.
QUALITY_ROWS = (("perplexity (one pass)", "one_pass", "ppl"),
                ("perplexity (decode path)", "decode", "ppl"),
                ("KL(dense||compressed) nats/token (one pass)", "one_pass", "kl"),
                ("KL(dense||compressed) nats/token (decode path)", "decode", "kl"),
                ("top-1 agreement (one pass)", "one_pass", "top1_agree"),
                ("top-1 agreement (decode path)", "decode", "top1_agree"))


def quality_rows(export_fid, torch_fid) -> dict[str, dict]:
    """The report's quality rows: ``{row: {"dense", "compressed", "pytorch"}}``.

    Args:
        export_fid: :class:`~edgeprune.evaluation.decode_path.ExportFidelity` of the
            compressed export (the "compressed" column; each row's "dense" is the dense
            model on the same windows).
        torch_fid: :class:`~edgeprune.evaluation.fidelity.FidelityResult` of the
            fake-quantized PyTorch model on the one-pass windows (the "pytorch" column).
    """
    rows: dict[str, dict] = {}
    for key, part, attr in QUALITY_ROWS:
        r = getattr(export_fid, part)
        dense = r.ppl_dense if attr == "ppl" else (0.0 if attr == "kl" else 1.0)
        rows[key] = dict(dense=dense, compressed=getattr(r, attr),
                         pytorch=getattr(torch_fid, attr) if part == "one_pass" else None)
    p = export_fid.paths
    rows["one pass vs decode path: argmax agreement"] = dict(dense=None, compressed=p.argmax_agree)
    rows["one pass vs decode path: max |dlogit|"] = dict(dense=None, compressed=p.max_abs_dlogit)
    return rows


def next_commands(folder) -> list[str]:
    """The three commands to try next on a run's compressed export: chat, serve, profile."""
    import shlex

    f = shlex.quote(str(folder))
    return [f"edgeprune chat {f}", f"edgeprune serve {f}", f"edgeprune profile {f}"]


#: What a run folder holds; replacing it deletes nothing else.
RUN_ENTRIES = ("checkpoint", "onnx-compressed", "onnx-dense", "report.json", "report.md")
#: A run folder, for the output guard: replaced as a whole; marked by a ``report.json``
#: holding the run's ``fingerprint`` (the same run is replaced without ``overwrite``).
RUN_OUTPUT = OutputKind("run", files=frozenset(RUN_ENTRIES), marker="report.json",
                        marker_key="fingerprint", ours="part of an edgeprune run")


def _out_guard(model: str | None) -> dict[str, Any]:
    """The output guard's settings for a run folder: its kind, the model's file or
    folder as the input it must not touch, the error."""
    from .models import local_source

    src = local_source(model) if model else None
    return dict(kind=RUN_OUTPUT, inputs=[src] if src is not None else [], error=CheckpointError)


def _check_out(out: Path, fingerprint: str, overwrite: bool, model: str | None = None) -> None:
    """Refuse an output folder that would lose data (:func:`runtime.files.check_output`):
    one that is, holds or lies in the input model's folder (or is or holds the model
    file); a folder with anything besides an earlier run's :data:`RUN_ENTRIES` (its
    ``report.json`` carrying a ``fingerprint``), even with ``overwrite``; a different run
    without ``overwrite``; one another process is writing."""
    check_output(out, overwrite=overwrite, run_id=fingerprint, **_out_guard(model))


def _profile(folder: Path, cfg: RunConfig) -> dict[str, Any]:
    from edgeprune_devices.profiler import profile

    rep = profile(folder, "cpu-host", prompt_len=cfg.prompt_len, gen_len=cfg.gen_len,
                  repeat=cfg.repeat, targets=[])
    m = rep.measured
    return dict(ttft_ms=m["ttft_ms"]["median"], decode_tok_s=m["decode_tok_s"]["median"],
                decode_tok_s_p90=m["decode_tok_s"]["p90"], prefill_tok_s=m["prefill_tok_s"]["median"],
                peak_rss_mb=m["peak_rss_bytes"] / 2**20, weights_mb=m["weights_bytes"] / 2**20,
                ran_on=rep.ran_on)


def _sample(folder: Path, prompt: str, threads: int, max_new_tokens: int = 48) -> str:
    import edgeprune_runtime as runtime
    from edgeprune_runtime.errors import GenerationError

    with runtime.load(folder, threads=threads) as sess:
        try:
            res = sess.generate(prompt, max_new_tokens=max_new_tokens, chat=True)
        except GenerationError:  # the tokenizer has no chat template: plain prompt
            res = sess.generate(prompt, max_new_tokens=max_new_tokens)
    return " ".join(res.text.split())


def _file_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.glob("model.onnx*")) / 2**20


@dataclass
class RunReport:
    """What :func:`run_pipeline` measured (also written as ``report.json``/``report.md``)."""

    out_dir: str
    config: dict
    fingerprint: str
    rows: dict = field(default_factory=dict)   # metric -> {"dense": v, "compressed": v}
    samples: dict = field(default_factory=dict)
    compression: dict = field(default_factory=dict)
    protocol: dict = field(default_factory=dict)
    quality: dict = field(default_factory=dict)     # {"export": ExportFidelity, "pytorch": FidelityResult}
    export: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def to_markdown(self) -> str:
        """The report table as Markdown."""
        lines = [f"# edgeprune run: {self.config['model']}", "",
                 f"Compression: `{json.dumps(self.compression.get('recipe'))}` "
                 f"({self.compression.get('seconds', 0):.1f} s)", "",
                 f"| metric | dense | {COMPRESSED_COLUMN} | {PYTORCH_COLUMN} | ratio |",
                 "|---|---|---|---|---|"]
        for metric, v in self.rows.items():
            d, c = v.get("dense"), v.get("compressed")
            ratio = f"{c / d:.3f}" if isinstance(d, (int, float)) and isinstance(c, (int, float)) and d else "—"
            cells = [metric, format_value(d), format_value(c), format_value(v.get("pytorch")), ratio]
            lines.append("| " + " | ".join(str(x).replace("|", "\\|") for x in cells) + " |")
        p = self.protocol
        lines += ["", f"Perplexity protocol: {p.get('text_source')} (sha256 {str(p.get('text_sha256'))[:12]}…), "
                      f"no BOS, {p.get('nwindows')} windows x {p.get('seqlen')} tokens, "
                      f"{p.get('ntokens_scored')} tokens scored.", "", QUALITY_NOTE.format(
                          decode_windows=self.config.get("decode_windows"),
                          seqlen=p.get("seqlen")),
                  f"Speed: batch 1, prompt {self.config['prompt_len']} tokens, {self.config['gen_len']} new tokens, "
                  f"greedy, {self.config['threads']} threads, median of {self.config['repeat']} runs, each model in a fresh "
                  "runtime process (onnxruntime, no torch).", "", "## Samples", ""]
        for k, s in self.samples.items():
            lines += [f"**{k}**: {s}", ""]
        return "\n".join(lines)


#: Column titles of the report: the compressed figures come from the export.
COMPRESSED_COLUMN = "compressed (ONNX export, runtime)"
PYTORCH_COLUMN = "compressed (PyTorch fake-quant)"
QUALITY_NOTE = ("Quality: *one pass* = every window teacher-forced in one prefill pass (how perplexity "
                "is usually computed); *decode path* = the first {decode_windows} window(s) fed token "
                "by token through the KV cache, as generation runs (its dense figure is the dense "
                "model on those windows). The ONNX column is the shipped export run by the runtime; "
                "the PyTorch column is the compressed model with dequantized weights, before export.")


def format_value(v) -> str:
    """A table cell: '—' for missing, 3 significant digits below 0.001 (a KL of 2e-5
    read 0.0000), 4 decimals below 10, one decimal above."""
    if v is None:
        return "—"
    if isinstance(v, float):
        if v != 0 and abs(v) < 1e-3:
            return f"{v:.3g}"
        return f"{v:,.4f}" if abs(v) < 10 else f"{v:,.1f}"
    return str(v)


def run_pipeline(cfg: RunConfig | None = None, out_dir: str | os.PathLike = "runs/demo", *,
                 overwrite: bool = False, log: Callable[[str], None] = print,
                 export_dense: bool = True) -> RunReport:
    """Run the whole pipeline on one model and write ``report.json`` / ``report.md``.

    Args:
        cfg: :class:`RunConfig` (defaults: ``smollm2-135m``, the :data:`DEFAULT_RECIPE`
            preset (GPTQ int4 g64 asym, clipped grids, 8-bit ``v_proj``), 64x512
            calibration windows sampled from the model, seeded in twelve languages
            (:data:`DEFAULT_CALIB`), held-out embedded text for
            evaluation, 2 threads, prompt 128 / 128 new tokens). Any method setting
            (``method``, ``bits``, ``sparsity``...) replaces the preset with
            :data:`DEFAULT_METHOD` plus those settings.
        out_dir: output folder; gets ``checkpoint/``, ``onnx-dense/``,
            ``onnx-compressed/``, ``report.json``, ``report.md``.
        overwrite: replace an output folder that holds a different run.
        log: progress messages (one line each).
        export_dense: also export and measure the dense model (the table's "dense" column
            for size and speed).

    Returns:
        :class:`RunReport`.

    Raises:
        EdgePruneError subclasses: bad settings, unloadable model, too little text,
        an output folder holding another run or being written by another process.
    """
    import torch

    from . import checkpoint as ckpt
    from .calibration import build_calibration, self_source_prompts
    from .engine import check_recipe, compress
    from .evaluate import fidelity
    from .models import load_model

    import edgeprune_exporters as exporters
    import edgeprune_runtime as runtime

    from .evaluation.decode_path import export_fidelity

    cfg = cfg or RunConfig()
    out = Path(out_dir).expanduser().resolve()
    fp = cfg.fingerprint()
    _check_out(out, fp, overwrite, cfg.model)
    recipe = build_recipe(cfg)
    recipe.validate()
    # every count of the later stages now, not after minutes of calibration
    from edgeprune_devices.profiler import check_profile_args
    check_profile_args(cfg.prompt_len, cfg.gen_len, cfg.repeat, cfg.threads)
    dw = cfg.decode_windows
    if isinstance(dw, bool) or not isinstance(dw, int) or dw < 1:
        raise ConfigError(f"decode_windows={dw!r} must be an integer >= 1", "pass e.g. --decode-windows 2")
    for k, v in (cfg.accuracy_levels or {}).items():
        if not isinstance(k, str) or not k or isinstance(v, bool) or v not in (0, 1, 2, 3, 4):
            raise ConfigError(f"accuracy level override {k!r}={v!r} is invalid",
                              "use a projection-name suffix and a level 0-4, e.g. down_proj=0")
    if isinstance(cfg.eval_seqlen, bool) or not isinstance(cfg.eval_seqlen, int) or cfg.eval_seqlen < 2:
        raise ConfigError(f"eval_seqlen={cfg.eval_seqlen!r} must be an integer >= 2",
                          "pass e.g. --eval-seqlen 512")
    nwin = cfg.eval_nwindows
    if nwin is not None and (isinstance(nwin, bool) or not isinstance(nwin, int) or nwin < 0):
        raise ConfigError(f"eval_nwindows={nwin!r} must be an integer >= 0 (0 = the whole text)",
                          "pass e.g. --eval-nwindows 40")
    torch.set_num_threads(cfg.threads)
    t_all = time.perf_counter()
    secs: dict[str, float] = {}

    # claimed until the folder is written (a second run into it is refused at once), and
    # built in a temporary sibling renamed into place: a failure leaves nothing
    with claim_output(out, overwrite=overwrite, run_id=fp, **_out_guard(cfg.model)), \
            atomic_folder(out, overwrite=True, error=CheckpointError) as tmp:
        t = time.perf_counter()
        log(f"[1/7] loading {cfg.model}")
        dense, tok, src = load_model(cfg.model, return_source=True, device=cfg.device)
        secs["load"] = time.perf_counter() - t

        check_recipe(dense, recipe)          # shapes vs recipe before minutes of calibration
        eval_seqlen = cfg.eval_seqlen
        ctx = getattr(dense.config, "max_position_embeddings", None)
        if isinstance(ctx, int) and eval_seqlen > ctx:   # found now, not after compressing
            log(f"      evaluation windows capped at the model's context: {ctx} tokens, not {eval_seqlen}")
            eval_seqlen = ctx
        # the evaluation text must hold its windows: found now, not after compressing
        from .evaluate import eval_windows
        try:
            eval_windows(tok, cfg.eval_text, seqlen=eval_seqlen, nwindows=nwin or None)
        except CalibrationError as e:
            raise CalibrationError(e.message,
                                   "use a longer --eval-text, or lower --eval-nwindows / "
                                   "--eval-seqlen") from None
        t = time.perf_counter()
        calib = cfg.calib if cfg.calib is not None else DEFAULT_CALIB
        log(f"[2/7] calibration: {cfg.nsamples} x {cfg.seqlen} tokens from "
            + ("text sampled from the model itself" + (f" ({calib})" if calib != "self" else "")
               if self_source_prompts(calib)[0] else
               "the embedded default text" if calib == "default" else calib))
        cal = build_calibration(tok, calib, nsamples=cfg.nsamples, seqlen=cfg.seqlen, seed=cfg.seed,
                                progress=True,
                                model_max_length=getattr(dense.config, "max_position_embeddings", None),
                                model=dense)
        model = copy.deepcopy(dense)
        log(f"      compressing with {recipe.to_dict()}")
        result = compress(model, recipe, cal.input_ids, device=cfg.device, progress=True)
        result.calibration = cal.info
        secs["compress"] = result.seconds or (time.perf_counter() - t)

        t = time.perf_counter()
        log("[3/7] evaluating dense vs compressed in PyTorch (fake-quant: perplexity, KL, top-1 agreement)")
        fid = fidelity(dense, model, tok, cfg.eval_text, seqlen=eval_seqlen, nwindows=nwin or None)
        secs["evaluate"] = time.perf_counter() - t

        t = time.perf_counter()
        fmt = "compressed-tensors" if result.quantized else "dense"
        log(f"[4/7] saving the compressed checkpoint ({fmt})")
        prov = dict(method=recipe.to_dict(), source=src.to_dict(), calibration=cal.info, seed=cfg.seed)
        ckpt.save_checkpoint(model, tok, result, tmp / "checkpoint", format=fmt, provenance=prov)
        secs["save"] = time.perf_counter() - t

        t = time.perf_counter()
        log("[5/7] exporting to ONNX")
        exports = {}
        precision = "int4" if result.quantized else "fp32"
        sparse24 = bool(result.sparsity_pattern) and all(p == "2:4" for p in result.sparsity_pattern.values())
        exports["compressed"] = exporters.export_onnx(
            model, tok, tmp / "onnx-compressed", precision=precision, quantized=result.quantized or None,
            sparsity={"pattern": sorted(set(result.sparsity_pattern.values()))} if result.masks else None,
            sparse_24=sparse24, provenance=prov, accuracy_levels=cfg.accuracy_levels or None)
        if export_dense:
            exports["dense"] = exporters.export_onnx(dense, tok, tmp / "onnx-dense", precision="fp32",
                                                     provenance=dict(source=src.to_dict()))
        secs["export"] = time.perf_counter() - t
        del model

        t = time.perf_counter()
        log(f"[6/7] evaluating the export through the runtime: every window in one pass, the first "
            f"{cfg.decode_windows} token by token through the KV cache (decode path)")
        with runtime.load(exports["compressed"].folder, threads=cfg.threads) as sess:
            xfid = export_fidelity(dense, sess, tok, cfg.eval_text, seqlen=eval_seqlen,
                                   nwindows=nwin or None, decode_windows=cfg.decode_windows)
        secs["evaluate_export"] = time.perf_counter() - t
        del dense

        t = time.perf_counter()
        log(f"[7/7] measuring in the runtime ({cfg.threads} threads, prompt {cfg.prompt_len}, {cfg.gen_len} new tokens)")
        speed, samples = {}, {}
        for kind, ex in exports.items():
            speed[kind] = _profile(ex.folder, cfg)
            samples[kind] = _sample(ex.folder, cfg.prompt, cfg.threads)
        secs["runtime"] = time.perf_counter() - t
        secs["total"] = time.perf_counter() - t_all

        rows = {
            **quality_rows(xfid, fid),
            "model file (MiB)": {k: _file_mb(ex.folder) for k, ex in exports.items()},
            "time to first token (ms)": {k: v["ttft_ms"] for k, v in speed.items()},
            "decode tokens/s": {k: v["decode_tok_s"] for k, v in speed.items()},
            "peak RSS (MiB)": {k: v["peak_rss_mb"] for k, v in speed.items()},
        }
        report = RunReport(
            out_dir=str(out), config=dict(cfg.__dict__), fingerprint=fp, rows=rows, samples=samples,
            compression={k: v for k, v in result.summary().items() if k not in ("layer_errors", "quantized")},
            protocol=fid.protocol.to_dict(), quality=dict(export=xfid.to_dict(), pytorch=fid.to_dict()),
            export={k: dict(ex.parity, file_mb=_file_mb(ex.folder), timings=ex.timings) for k, ex in exports.items()},
            seconds=secs)
        report.speed = speed  # type: ignore[attr-defined]
        write_json(tmp / "report.json", report.to_dict())
        (tmp / "report.md").write_text(report.to_markdown())
    # the export folders' recorded paths: their final location
    for ex in exports.values():
        ex.folder = out / ex.folder.name
    return report


__all__ = ["RunConfig", "RunReport", "run_pipeline", "build_recipe", "quality_rows", "next_commands", "DEFAULT_METHOD",
           "DEFAULT_RECIPE", "DEFAULT_CALIB", "DEFAULT_NSAMPLES"]
