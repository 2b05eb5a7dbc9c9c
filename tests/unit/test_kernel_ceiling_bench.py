"""bench/kernel_ceiling.py --attention: the standard-operator attention candidate computes
grouped-query attention (checked against a direct numpy loop and against onnxruntime's own
GroupQueryAttention), so the speeds it is compared by are of the same function."""

from __future__ import annotations

import numpy as np

from bench_modules import load_bench


def test_one_gemm_attention_is_grouped_query_attention(benchlib):
    kc = load_bench("kernel_ceiling")
    H, KVH, D, T = 9, 3, 64, 37
    rng = np.random.default_rng(0)
    q = rng.standard_normal(H * D).astype(np.float32)
    K = rng.standard_normal((T, KVH * D)).astype(np.float32)
    V = rng.standard_normal((T, KVH * D)).astype(np.float32)
    got = kc.blockgemm_session(1, 1).run(None, {"q0": q[None, None], "K0": K, "V0": V})[0].reshape(-1)
    ref = kc._attention_reference(q, K, V)
    assert np.abs(got - ref).max() < 1e-4
    # query heads 0-2 read KV group 0 (9 query heads over 3 KV heads), and only they move
    K2 = K.copy()
    K2[:, 0:D] += rng.standard_normal((T, D)).astype(np.float32)  # group 0: query heads 0-2
    moved = kc.blockgemm_session(1, 1).run(None, {"q0": q[None, None], "K0": K2, "V0": V})[0].reshape(H, D)
    assert np.allclose(moved[3:], got.reshape(H, D)[3:], atol=1e-5)
    assert not np.allclose(moved[:3], got.reshape(H, D)[:3], atol=1e-3)
    # the same function as onnxruntime's GroupQueryAttention (rotary inside) on the same cache
    sess, _ = kc.gqa_session(1, T + 1, 1)
    qkv = np.zeros((1, 1, (H + 2 * KVH) * D), np.float32)
    qkv[0, 0, :H * D] = q
    qkv[0, 0, H * D:(H + KVH) * D] = K[-1]
    qkv[0, 0, (H + KVH) * D:] = V[-1]
    inv = 1.0 / 100000 ** (np.arange(0, D, 2) / D)

    def rot(x, pos):
        """Rotary (half-split) at ``pos`` of every 64-wide head in ``x``."""
        x = x.reshape(-1, D).astype(np.float64)
        c, s = np.cos(pos * inv), np.sin(pos * inv)
        a, b = x[:, :D // 2], x[:, D // 2:]
        return np.concatenate([a * c - b * s, b * c + a * s], 1).reshape(-1)

    # the cache holds rotated keys; the new token's key and the query are rotated inside
    Kr = np.stack([rot(K[t], t) for t in range(T)]).astype(np.float32)
    pk = np.zeros((1, KVH, T + 1, D), np.float32)
    pv = np.zeros_like(pk)
    pk[0, :, :T - 1] = Kr[:T - 1].reshape(T - 1, KVH, D).transpose(1, 0, 2)
    pv[0, :, :T - 1] = V[:T - 1].reshape(T - 1, KVH, D).transpose(1, 0, 2)
    out = sess.run(["o0"], {"qkv": qkv, "seqlens_k": np.array([T - 1], np.int32),
                            "total": np.array(T, np.int32), "pk0": pk, "pv0": pv})[0].reshape(-1)
    ref_gqa = kc._attention_reference(rot(q, T - 1).astype(np.float32), Kr, V)
    assert np.abs(out - ref_gqa).max() < 1e-4
