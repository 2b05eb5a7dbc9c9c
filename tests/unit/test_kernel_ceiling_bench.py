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


def test_leank_at_speed_attention_is_leank(benchlib):
    """The LeanK candidate: full-width scores for the sink + window rows, kept channels only
    for the middle; with every channel kept it is plain grouped-query attention."""
    kc = load_bench("kernel_ceiling")
    H, KVH, D, T, F, dk = 9, 3, 64, 41, 16, 19
    rng = np.random.default_rng(1)
    q = rng.standard_normal(H * D).astype(np.float32)
    K = rng.standard_normal((T, KVH * D)).astype(np.float32)
    V = rng.standard_normal((T, KVH * D)).astype(np.float32)
    keep = kc.leank_keep(dk)
    assert keep.shape == (KVH * dk,) and len(set(keep.tolist())) == KVH * dk
    assert all(k * D <= c < (k + 1) * D for k in range(KVH) for c in keep[k * dk:(k + 1) * dk])
    sess = kc.leank_session(1, 1, dk)

    def run(K, V, keep=keep, sess=sess):
        return sess.run(None, {"q0": q[None, None], "Kf0": K[:F], "Km0": np.ascontiguousarray(K[F:, keep]),
                               "V0": V, "keep0": keep})[0].reshape(-1)

    got = run(K, V)
    assert np.abs(got - kc._leank_reference(q, K, V, keep, F)).max() < 1e-4
    assert np.abs(got - kc._attention_reference(q, K, V)).max() > 1e-3    # pruning changes it
    # a dropped channel of a middle key is never read; the same channel of a window key is
    dropped = next(c for c in range(D) if c not in keep)
    K_mid, K_full = K.copy(), K.copy()
    K_mid[F:, dropped] += 5.0
    K_full[:F, dropped] += 5.0
    assert np.array_equal(run(K_mid, V), got)
    assert not np.allclose(run(K_full, V), got, atol=1e-3)
    # every channel kept: grouped-query attention itself
    everything = kc.leank_keep(D)
    full_sess = kc.leank_session(1, 1, D)
    dense = run(K, V, keep=everything, sess=full_sess)
    assert np.abs(dense - kc._attention_reference(q, K, V)).max() < 1e-4


def test_leank_head_major_form_is_the_same_attention(benchlib):
    """The head-major LeanK candidate computes what the time-major one does; masked columns
    (a buffer's unused capacity) change nothing."""
    kc = load_bench("kernel_ceiling")
    H, D, T, F, dk = 9, 64, 41, 16, 19
    rng = np.random.default_rng(2)
    q = rng.standard_normal(H * D).astype(np.float32)
    K = rng.standard_normal((T, 3 * D)).astype(np.float32)
    V = rng.standard_normal((T, 3 * D)).astype(np.float32)
    keep = kc.leank_keep(dk, seed=5)
    sess = kc.leank_heads_session(1, 1, dk)
    feed = {"q0": q[None, None], "mask": np.zeros(T, np.float32), **kc.leank_heads_inputs(K, V, keep, F)}
    got = sess.run(None, feed)[0].reshape(-1)
    assert np.abs(got - kc._leank_reference(q, K, V, keep, F)).max() < 1e-4
    # 7 columns of spare capacity, filled with noise and masked out
    pad = 7
    Kp = np.concatenate([K, rng.standard_normal((pad, 3 * D)).astype(np.float32) * 9])
    Vp = np.concatenate([V, rng.standard_normal((pad, 3 * D)).astype(np.float32) * 9])
    mask = np.zeros(T + pad, np.float32)
    mask[T:] = -1e9
    padded = sess.run(None, {"q0": q[None, None], "mask": mask, **kc.leank_heads_inputs(Kp, Vp, keep, F)})[0]
    assert np.abs(padded.reshape(-1) - got).max() < 1e-5


def test_leank_int8_middle_reads_int8_and_stays_near_leank(benchlib):
    """The int8-middle candidate: its middle buffers are int8, its output within the stated
    5e-3 of float LeanK (quantization, not a different function: a dropped middle channel is
    still never read)."""
    kc = load_bench("kernel_ceiling")
    H, D, T, F, dk = 9, 64, 300, 128, 19
    rng = np.random.default_rng(4)
    q = rng.standard_normal(H * D).astype(np.float32)
    K = rng.standard_normal((T, 3 * D)).astype(np.float32)
    V = rng.standard_normal((T, 3 * D)).astype(np.float32)
    keep = kc.leank_keep(dk)
    feed = kc.leank_int8_inputs(K, V, keep, F)
    assert feed["Kq0"].dtype == np.int8 and feed["Kq0"].shape == (3, dk, T - F)
    assert feed["Vq0"].dtype == np.int8 and feed["Vq0"].shape == (3, T - F, D)
    sess = kc.leank_int8_session(1, 1, dk)
    got = sess.run(None, {"q0": q[None, None], "mask": np.zeros(T, np.float32), **feed})[0].reshape(-1)
    err = np.abs(got - kc._leank_reference(q, K, V, keep, F)).max()
    assert 1e-6 < err < 5e-3
    dropped = next(c for c in range(D) if c not in keep)
    K2 = K.copy()
    K2[F:, dropped] += 5.0
    moved = sess.run(None, {"q0": q[None, None], "mask": np.zeros(T, np.float32),
                            **kc.leank_int8_inputs(K2, V, keep, F)})[0].reshape(-1)
    assert np.array_equal(moved, got)
