"""Roofline projection of a profiler measurement to target devices (never a measurement).

The scaling itself is :func:`devices.roofline.project`; this module applies it to the
decode, prefill and sweep figures of one run, with a launch-overhead floor on GPUs.
"""

from __future__ import annotations

import dataclasses

from ..catalog import DeviceProfile, load_profile
from ..host import measure_host
from ..roofline import project


def host_profile(threads: int) -> tuple[DeviceProfile, dict]:
    """The ``cpu-host`` profile with this machine's figures measured at ``threads``
    threads (:func:`devices.host.measure_host`), and those figures."""
    fig = measure_host(threads)
    host = dataclasses.replace(load_profile("cpu-host", measure=False), threads=threads,
                               bandwidth_gbs=fig["bandwidth_gbs"], peak_fp32_gflops=fig["peak_fp32_gflops"],
                               peak_int8_gops=fig["peak_int8_gops"], measured=True)
    return host, fig


def project_target(measured: dict, sweep_rows: list, work: dict, host: DeviceProfile, tgt: DeviceProfile,
                   prompt_len: int, gen_len: int) -> dict:
    """One target's projected column. Decode and prefill times are the roofline scaling of
    :func:`devices.project`, floored on GPU targets at ``graph_nodes x kernel_launch_us``
    per run (a small model's decode is launch-bound there, far from the roofline). TTFT
    is the projected prefill of the prompt (as measured: the first token comes from the
    prefill's logits). Memory: CPU targets carry the host's measured peak RSS (same
    runtime, same files); GPU targets count device memory as weights + KV cache.

    Args:
        measured: the worker's figures (``ProfileReport.measured``); ``sweep_rows`` its
            sweep rows.
        work: :func:`devices.profiler.work.model_work` of the export.
        host: the measured host profile (:func:`host_profile`); ``tgt`` the target.
        prompt_len, gen_len: the run's prompt and new tokens.

    Returns:
        ``ProfileReport.projected[target]``: tokens/s, step ms, bounds, host
        efficiencies, peak memory vs the target's budget, ``sweep_step_ms``.
    """
    comp = work["compute"]
    wb, wo, attn = work["weight_bytes_per_token"], work["weight_ops_per_token"], work["attn_ops_per_position"]
    kv = measured["kv_bytes"]
    kv_per_pos = (kv["k"] + kv["v"]) / max(1, measured["kv_tokens"])
    mean_ctx = prompt_len + gen_len / 2
    launch_s = tgt.kernel_launch_us * 1e-6 * int(work.get("graph_nodes") or 0)

    def step(measured_s, bytes_, ops, per_run=1):
        p = project(measured_s, host, tgt, bytes_, ops, comp)
        t = max(p.seconds_per_token, launch_s / per_run)
        return t, ("launch" if t > p.seconds_per_token else p.bound), p.host_efficiency

    dec_t, dec_bound, dec_eff = step(measured["decode_step_ms"]["median"] / 1000.0, wb + kv_per_pos * mean_ctx,
                                     wo + attn * mean_ctx)
    dec90_t, _, _ = step(measured["decode_step_ms"]["p90"] / 1000.0, wb + kv_per_pos * mean_ctx, wo + attn * mean_ctx)
    pre_t, pre_bound, pre_eff = step(1.0 / measured["prefill_tok_s"]["median"], wb / prompt_len + kv_per_pos,
                                     wo + attn * prompt_len / 2, per_run=prompt_len)
    gpu = tgt.device_class == "gpu"
    peak = int(measured["weights_bytes"] + kv["k"] + kv["v"]) if gpu else measured["peak_rss_bytes"]
    out = {"decode_tok_s": 1.0 / dec_t, "decode_tok_s_p90": 1.0 / dec90_t,
           "decode_step_ms": dec_t * 1000.0, "prefill_tok_s": 1.0 / pre_t,
           "ttft_ms": prompt_len * pre_t * 1000.0,
           "bound": dec_bound, "prefill_bound": pre_bound, "host_efficiency_decode": dec_eff,
           "host_efficiency_prefill": pre_eff, "peak_memory_bytes": peak,
           "peak_memory_kind": "device memory: weights + KV cache" if gpu else "peak RSS as measured on the host",
           "memory_budget_bytes": tgt.memory_budget_bytes, "fits_budget": bool(peak <= tgt.memory_budget_bytes),
           "kind": "projected (roofline)"}
    if sweep_rows:
        out["sweep_step_ms"] = [step(s["decode_step_ms"] / 1000.0, wb + kv_per_pos * s["context"],
                                     wo + attn * s["context"])[0] * 1000.0 for s in sweep_rows]
    return out


__all__ = ["host_profile", "project_target"]
