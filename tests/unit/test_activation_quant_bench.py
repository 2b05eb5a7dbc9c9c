"""bench/activation_quant.py's emulation of MatMulNBits accuracy_level=4 against onnxruntime
itself: int8 per block of the input row, then the dequantized weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench_modules import load_bench


def _matmulnbits(x: np.ndarray, w, level: int) -> np.ndarray:
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from edgeprune_exporters import int4

    B, scales, zp = int4.pack_matmulnbits(w)
    node = helper.make_node("MatMulNBits", ["A", "B", "scales", "zp"], ["Y"], domain="com.microsoft",
                            K=w.K, N=w.N, bits=w.bits, block_size=w.block_size, accuracy_level=level)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [x.shape[0], w.N])],
        [helper.make_tensor("B", TensorProto.UINT8, B.shape, B.tobytes(), raw=True),
         helper.make_tensor("scales", TensorProto.FLOAT, scales.shape, scales),
         helper.make_tensor("zp", TensorProto.UINT8, zp.shape, zp.tobytes(), raw=True)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"A": x})[0]


@pytest.fixture
def aq(benchlib):
    return load_bench("activation_quant")


@pytest.mark.parametrize("block", [32, 64])
def test_int8_blocks_is_what_level_4_computes(aq, block):
    """onnxruntime's level-4 output is the emulated one to float rounding, and far from the
    exact product: the emulation attributes level 4's error, not something else."""
    from edgeprune_exporters import int4

    rng = np.random.default_rng(0)
    K, N = 256, 48
    x = rng.standard_normal((5, K)).astype(np.float32)
    x[:, 7] *= 40.0                                  # an outlier channel, as real activations have
    w = int4.rtn_int(rng.standard_normal((N, K)).astype(np.float32), bits=4, group_size=block)
    wd = w.dequantize()
    got = _matmulnbits(x, w, level=4)
    emulated = aq.int8_blocks(torch.from_numpy(x), block).numpy() @ wd.T
    exact = x @ wd.T
    err_emulated = np.abs(got - emulated).max()
    err_exact = np.abs(got - exact).max()
    assert err_emulated < 1e-3 * np.abs(exact).max()
    assert err_exact > 20 * err_emulated
    # level 0 is the exact product
    np.testing.assert_allclose(_matmulnbits(x, w, level=0), exact, rtol=1e-4, atol=1e-3)


def test_int8_blocks_values(aq):
    x = torch.tensor([[127.0, 1.4, -0.6, 0.0, 2.0, 1.0, 0.5, 0.26]])
    # block 1: scale 1 -> rounded to integers; block 2: scale 2/127
    want = torch.tensor([[127.0, 1.0, -1.0, 0.0, 2.0, 64 * 2 / 127, 32 * 2 / 127, 17 * 2 / 127]])
    torch.testing.assert_close(aq.int8_blocks(x, 4), want)
