"""runtime.sampling: greedy, CTRL repetition penalty, temperature, top-k, top-p, seeding, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgeprune_runtime.errors import GenerationError
from edgeprune_runtime.sampling import Sampler, apply_repetition_penalty


def test_greedy_is_argmax_per_row():
    logits = np.array([[0.1, 2.0, -1.0, 1.9], [5.0, -2.0, 4.9, 0.0]], np.float32)
    out = Sampler()(logits, [[], []])
    assert out.dtype == np.int64 and out.tolist() == [1, 0]
    # 1-D logits are taken as batch 1; generated may be None.
    assert Sampler()(logits[1]).tolist() == [0]


def test_repetition_penalty_exact_values():
    logits = np.array([[2.0, -1.0, 0.5, 3.0]], np.float32)
    out = apply_repetition_penalty(logits, [[0, 1, 1, 0]], 2.0)  # duplicates count once
    np.testing.assert_array_equal(out, [[1.0, -2.0, 0.5, 3.0]])
    np.testing.assert_array_equal(logits, [[2.0, -1.0, 0.5, 3.0]])  # input untouched
    # Greedy choice flips once the repeated token is penalised.
    logits = np.array([[3.0, 2.0]], np.float32)
    assert Sampler()(logits, [[0]]).tolist() == [0]
    assert Sampler(repetition_penalty=2.0)(logits, [[0]]).tolist() == [1]
    # extreme penalties saturate at float32's range (they overflowed to inf, then the
    # sampled distribution was NaN and token 0 came every step); -inf stays -inf
    logits = np.array([[2.0, -1.0, 0.5, -np.inf]], np.float32)
    big = np.finfo(np.float32).max
    np.testing.assert_array_equal(apply_repetition_penalty(logits, [[0, 1, 3]], 1e-300),
                                  [[big, -0.0, 0.5, -np.inf]])
    p = Sampler(temperature=1.0, repetition_penalty=1e-300, seed=0).probabilities(logits, [[0, 1]])
    assert np.isfinite(p).all() and p[0, 0] == pytest.approx(1.0)


def test_matches_transformers_logits_processors():
    from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, size=(3, 97)).astype(np.float32)
    seen = [[1, 5, 5, 90], [0], [3, 4, 50, 60, 70]]
    for temp, k, p, rep in [(0.7, 10, 0.9, 1.3), (1.0, 0, 0.5, 1.0), (1.5, 5, 1.0, 0.8), (0.3, 0, 0.95, 1.1)]:
        ours = Sampler(temperature=temp, top_k=k, top_p=p, repetition_penalty=rep).probabilities(logits, seen)
        x = torch.from_numpy(logits.astype(np.float64))
        ids = torch.tensor([s + [s[0]] * (5 - len(s)) for s in seen])  # pad with a repeat (no effect)
        if rep != 1.0:
            x = RepetitionPenaltyLogitsProcessor(rep)(ids, x)
        x = TemperatureLogitsWarper(temp)(ids, x)
        if k:
            x = TopKLogitsWarper(k)(ids, x)
        if p < 1.0:
            x = TopPLogitsWarper(p)(ids, x)
        ref = torch.softmax(x, dim=-1).numpy()
        np.testing.assert_allclose(ours, ref, atol=1e-6, err_msg=str((temp, k, p, rep)))


def test_top_p_and_top_k_hand_cases():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs)[None].astype(np.float32)
    p = Sampler(temperature=1.0, top_p=0.7).probabilities(logits)
    np.testing.assert_allclose(p[0], [0.5 / 0.8, 0.3 / 0.8, 0, 0], atol=1e-6)
    p = Sampler(temperature=1.0, top_p=0.5).probabilities(logits)
    np.testing.assert_allclose(p[0], [1, 0, 0, 0], atol=1e-6)
    p = Sampler(temperature=1.0, top_p=0.01).probabilities(logits)  # the top token always survives
    np.testing.assert_allclose(p[0], [1, 0, 0, 0], atol=1e-6)
    p = Sampler(temperature=1.0, top_k=3).probabilities(logits)
    np.testing.assert_allclose(p[0], [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], atol=1e-6)
    # top_k=1 at any temperature is greedy.
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 50)).astype(np.float32)
    assert (Sampler(temperature=2.0, top_k=1, seed=3)(x) == x.argmax(1)).all()


def test_draws_follow_the_distribution_and_seed_reproduces():
    logits = np.log(np.array([[0.6, 0.25, 0.1, 0.05]], np.float32))
    rows = np.repeat(logits, 40000, axis=0)
    draws = Sampler(temperature=1.0, seed=0)(rows)
    freq = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(freq, [0.6, 0.25, 0.1, 0.05], atol=0.01)
    # Temperature 0.5 squares the probabilities (renormalised).
    draws = Sampler(temperature=0.5, seed=1)(rows)
    q = np.array([0.6, 0.25, 0.1, 0.05]) ** 2
    np.testing.assert_allclose(np.bincount(draws, minlength=4) / len(draws), q / q.sum(), atol=0.01)
    a = [Sampler(temperature=1.0, seed=7)(rows[:200]).tolist() for _ in range(2)]
    b = Sampler(temperature=1.0, seed=8)(rows[:200]).tolist()
    assert a[0] == a[1] and a[0] != b


def test_never_samples_filtered_or_masked_tokens():
    logits = np.array([[0.0, -np.inf, 1.0, 0.5, -3.0]], np.float32)
    draws = Sampler(temperature=5.0, top_k=3, seed=0)(np.repeat(logits, 5000, axis=0))
    assert set(draws.tolist()) == {0, 2, 3}


@pytest.mark.parametrize("kwargs, word", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(seed=-1), "seed"), (dict(temperature="hot"), "temperature"),
])
def test_bad_arguments_raise(kwargs, word):
    with pytest.raises(GenerationError, match=word) as e:
        Sampler(**kwargs)
    assert e.value.hint


def test_bad_inputs_raise():
    s = Sampler(repetition_penalty=1.2)
    with pytest.raises(GenerationError, match="shape"):
        s(np.zeros((1, 2, 3), np.float32), [[]])
    with pytest.raises(GenerationError, match="NaN"):
        s(np.array([[0.0, np.nan]], np.float32), [[]])
    with pytest.raises(GenerationError, match="-inf"):
        s(np.array([[-np.inf, -np.inf]], np.float32), [[]])
    with pytest.raises(GenerationError, match="rows"):
        s(np.zeros((2, 4), np.float32), [[]])
    with pytest.raises(GenerationError, match="outside the vocabulary"):
        s(np.zeros((1, 4), np.float32), [[4]])


def test_greedy_fast_path_matches_and_still_rejects_bad_logits():
    """Plain greedy decoding takes a one-pass argmax; it picks what the checked path
    picks (ties: the first maximum) and still raises on NaN / +inf / all -inf rows,
    wherever the bad value sits in the row."""
    s = Sampler()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 1000)).astype(np.float32)
    x[1, 10] = x[1, 500] = x[1].max() + 1          # a tie: the first index wins
    x[2, :5] = -np.inf
    assert s(x, [[], [], []]).tolist() == np.argmax(x, axis=1).tolist()
    assert s(x, [[], [], []])[1] == 10
    for bad, msg in ((np.nan, "NaN"), (np.inf, r"\+inf")):
        for pos in (0, 499, 999):
            y = x.copy()
            y[2, pos] = bad
            with pytest.raises(GenerationError, match=msg):
                s(y, [[], [], []])
    y = x.copy()
    y[0, :] = -np.inf
    with pytest.raises(GenerationError, match="-inf"):
        s(y, [[], [], []])


def test_tiny_temperature_tends_to_greedy_not_nan():
    """temperature=5e-324 used to overflow logits / T to inf, then inf - inf = NaN
    probabilities: token 0 every step. Shifting by the max first keeps it finite."""
    x = np.array([[1.0, 3.0, 2.0, -5.0], [0.5, -1.0, 0.25, 0.0]], np.float32)
    for t in (5e-324, 1e-300, 1e-8):
        s = Sampler(temperature=t, seed=0)
        p = s._filtered_probs(x)
        assert np.isfinite(p).all()
        np.testing.assert_array_equal(p.argmax(1), [1, 0])
        assert s(x, [[], []]).tolist() == [1, 0]
