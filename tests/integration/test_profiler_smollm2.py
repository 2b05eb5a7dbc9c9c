"""The profiler on the real SmolLM2-135M int4 export: figures, KV sizes, budget, projection."""

from __future__ import annotations

import pytest

import edgeprune_devices as devices
from edgeprune_runtime.errors import DeviceError
from edgeprune_devices.profiler import model_work, profile

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def smol_int4(smollm2_int4):
    return smollm2_int4


def test_profile_smollm2_int4(smol_int4, tmp_path):
    r = profile(smol_int4, "raspberry-pi-5", prompt_len=64, gen_len=32, repeat=2, sweep=[128, 512], out_dir=tmp_path)
    m = r.measured
    per_token = 30 * 3 * 64 * 4  # layers x kv heads x head_dim x fp32, for K (and the same for V)
    assert m["kv_bytes"] == {"k": 95 * per_token, "v": 95 * per_token}      # 64 + 32 - 1 cached
    # int4 exports keep their initializers in model.onnx.data: count the graph and its data
    assert m["weights_bytes"] == sum(p.stat().st_size for p in smol_int4.glob("model.onnx*"))
    # int4 linears + q8 lm_head: ~85-110 MB, and the whole file is read per token (tied lm_head).
    assert 80e6 < m["weights_bytes"] < 115e6
    w = model_work(smol_int4)
    assert w["compute"] == "int8" and 0.9 * m["weights_bytes"] < w["weight_bytes_per_token"] <= m["weights_bytes"]
    # ~2 x 134.5M MACs of linears per token (incl. the 49152 x 576 lm_head).
    assert 2.6e8 < w["weight_ops_per_token"] < 2.8e8
    assert m["weights_bytes"] < m["peak_rss_bytes"] < 1.5e9
    assert m["decode_tok_s"]["median"] > 1 and m["prefill_tok_s"]["median"] > 1
    p = r.projected["raspberry-pi-5"]
    assert p["bound"] == "memory" and p["fits_budget"] and p["decode_tok_s"] > 0
    assert [s["context"] for s in r.sweep] == [128, 512] and r.plot_path
    assert r.sweep[1]["kv_bytes"] == 2 * (512 + 16 - 1) * per_token


def test_budget_below_the_model_fails_clearly(smol_int4, tmp_path):
    src = (devices.PROFILE_DIR / "raspberry-pi-5.toml").read_text()
    p = tmp_path / "small-board.toml"
    p.write_text(src.replace('name = "raspberry-pi-5"', 'name = "small-board"')
                 .replace("memory_budget_mb = 6144", "memory_budget_mb = 120"))
    with pytest.raises(DeviceError, match="exceeded the memory budget of profile 'small-board'"):
        profile(smol_int4, str(p), prompt_len=16, gen_len=8, repeat=1)
