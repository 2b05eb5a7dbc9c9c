"""``bench/compare_runtimes.py --ops``: our side traced by onnxruntime's profiler, and the
side-by-side records per operator type."""

from __future__ import annotations

import json

import pytest
from bench_modules import load_bench
from tiny import export_tiny_llama


def _breakdown(ops, step=100.0, outside=10.0):
    return {"decode": {"ops": [{"op": k, "us_per_run": v, "nodes_per_run": n} for k, v, n in ops],
                       "run_us_median": step, "outside_nodes_us_per_run": outside}, "prefill": None}


def test_op_records_pair_every_type_of_either_side(benchlib):
    cr = load_bench("compare_runtimes")
    recs = cr.op_records("m/int4-t1", _breakdown([("MatMulNBits", 70.0, 5), ("Gelu", 4.0, 2)]),
                         _breakdown([("MatMulNBits", 90.0, 7), ("Split", 6.0, 1)], step=120.0, outside=5.0))
    got = {(r["case"], r["metric"]): (r["ours"], r["theirs"]) for r in recs}
    assert got == {
        ("m/int4-t1/op/MatMulNBits", "decode_us_per_step"): (70.0, 90.0),
        ("m/int4-t1/op/MatMulNBits", "nodes_per_step"): (5, 7),
        ("m/int4-t1/op/Split", "decode_us_per_step"): (0.0, 6.0),     # only theirs runs it
        ("m/int4-t1/op/Split", "nodes_per_step"): (0.0, 1),
        ("m/int4-t1/op/Gelu", "decode_us_per_step"): (4.0, 0.0),
        ("m/int4-t1/op/Gelu", "nodes_per_step"): (2, 0.0),
        ("m/int4-t1/op", "traced_step_us"): (100.0, 120.0),
        ("m/int4-t1/op", "outside_nodes_us_per_step"): (10.0, 5.0)}
    # ordered by the larger side's time
    assert [r["case"] for r in recs[::2]][:3] == ["m/int4-t1/op/MatMulNBits", "m/int4-t1/op/Split",
                                                  "m/int4-t1/op/Gelu"]
    assert all(r["peer"] == "onnxruntime-genai" for r in recs)
    # no peer trace: ours alone, theirs None
    alone = cr.op_records("m/int4-t1", _breakdown([("Gelu", 4.0, 2)]), None)
    assert {r["theirs"] for r in alone} == {None}


def test_ours_worker_traces_the_warm_up_and_one_generation(benchlib, tmp_path):
    from edgeprune_devices.profiler.ops import op_breakdown

    cr = load_bench("compare_runtimes")
    folder, _, _ = export_tiny_llama(tmp_path / "tiny")
    trace = tmp_path / "t.json"
    ids = list(range(3, 23))
    r = cr.worker_ours(str(folder), 1, ids, 6, 64, trace=str(trace))
    assert r["n_tokens"] == 6
    runs = [e for e in json.loads(trace.read_text()) if e.get("name") == "model_run"]
    assert len(runs) == 4 + 6                  # warm-up (prefill + 3 steps), prefill + 5 steps
    b = op_breakdown(trace, decode_steps=5)
    assert b["decode"]["runs"] == 5 and b["prefill"]["runs"] == 1
    assert {o["op"] for o in b["decode"]["ops"]} >= {"GroupQueryAttention"}
    assert not list(tmp_path.glob("t-ort*"))   # the trace was moved, not copied
