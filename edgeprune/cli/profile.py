"""``edgeprune profile`` and ``edgeprune devices``: measured / projected latency and memory."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import click

from edgeprune_runtime.errors import ConfigError

from ._app import cli
from ._common import _check_output, _console, _table, _write_json, threads_option

@cli.command("profile")
@click.argument("folder")
@click.option("--device", "device_name", default="cpu-host", show_default=True,
              help="Device profile name (see `edgeprune devices`).")
@click.option("--prompt-len", type=int, default=128, show_default=True)
@click.option("--gen-len", type=int, default=128, show_default=True)
@click.option("--repeat", type=int, default=5, show_default=True)
@click.option("--sweep", is_flag=False, flag_value="default", default=None, metavar="[CONTEXTS]",
              help="Also sweep context lengths and draw a PNG: --sweep alone = 128,256,512,1024,2048 (those "
                   "that fit the export), or a comma-separated list, e.g. --sweep 128,512,2048.")
@click.option("--target", "targets", multiple=True,
              help="Profiles to project to (repeatable); projections are shown only for these (or for a "
                   "--device that is not this host), in a table of their own.")
@click.option("--out", "out_dir", default=None,
              help="Folder for profile.md and the sweep plot (default: nothing written but the plot, into a "
                   "temporary folder the output names).")
@threads_option(help="Threads to run with instead of the profile's.")
@click.option("--ops", is_flag=True, default=False,
              help="Also break a decode step down by operator type (onnxruntime's profiler, over one more "
                   "generation after the timed runs): where the time goes.")
@click.option("--json", "json_path", default=None, help="Write the report as JSON here.")
def profile_cmd(folder, device_name, prompt_len, gen_len, repeat, sweep, targets, out_dir, threads, ops, json_path):
    """Measure latency and memory of an exported FOLDER under a device profile."""
    from edgeprune_runtime.files import atomic_write
    from edgeprune_devices.profiler import profile

    # outputs checked before minutes of measuring, not after
    _check_output(out_dir, "--out", [folder], folder=True)
    _check_output(json_path, "--json", [folder])
    rep = profile(folder, device_name, prompt_len=prompt_len, gen_len=gen_len, repeat=repeat,
                  sweep=_parse_sweep(sweep), targets=list(targets) or None, out_dir=out_dir,
                  threads=threads, progress=True, ops=ops)
    md = rep.to_markdown()
    click.echo(md)          # Markdown as is: no terminal-width wrapping, no rich markup
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        atomic_write(Path(out_dir) / "profile.md", md)
    if json_path:
        rep.to_json(json_path)


def _parse_sweep(value: Optional[str]):
    """``--sweep`` -> ``profile(sweep=...)``: ``None`` (absent), ``True`` (alone) or the
    list of context lengths.

    Raises:
        ConfigError: not a comma-separated list of positive integers.
    """
    if value is None:
        return None
    if value == "default":
        return True
    try:
        contexts = [int(c) for c in value.split(",") if c.strip()]
    except ValueError:
        contexts = []
    if not contexts or min(contexts) < 1:
        raise ConfigError(f"--sweep {value!r} is not a list of context lengths",
                          "pass e.g. --sweep 128,512,2048, or --sweep alone for the default contexts")
    return contexts


@cli.command("devices")
@click.option("--json", "json_path", default=None)
def devices_cmd(json_path):
    """List the device profiles (devices/profiles/*.toml)."""
    import edgeprune_devices as devices

    _check_output(json_path, "--json")
    profs = devices.list_profiles()
    rows = []
    for p in profs:
        d = p.to_dict()
        rows.append([d["name"], d["device_class"], d["execution_provider"].replace("ExecutionProvider", ""),
                     d["threads"], round(d["memory_budget_bytes"] / 2**20),
                     d["bandwidth_gbs"] or "measured", d["peak_fp32_gflops"] or "measured",
                     d["peak_int8_gops"] or "measured"])
    con = _console()
    con.print(_table("device profiles (devices/profiles/*.toml)",
                     ["name", "class", "provider", "threads", "memory budget MiB",
                      "bandwidth GB/s", "fp32 GFLOP/s", "int8 GOP/s"], rows))
    con.print("sources of the figures:")
    for p in profs:
        con.print(f"  {p.name}: {p.source or 'not given'}")
    _write_json(json_path, [p.to_dict() for p in profs])
