"""What decoding sees: an export's logits teacher-forced token by token through its KV
cache, beside the one-pass (prefill) logits that perplexity is usually computed from.

The two paths run different kernels: one pass multiplies ``[S, K]`` activations, a decode
step ``[1, K]``. With float weights they agree to ~1e-5, but an int4 ``MatMulNBits`` at
``accuracy_level=4`` quantizes its activations to int8 differently in the two (issue 29:
up to 1.27 logits apart, argmax agreement 93.8 % on SmolLM2-135M), so a perplexity
computed in one pass does not describe what generation computes.

* :class:`DecodePathModel`: an export as evaluation's logits function (``ids [1, S] ->
  logits [1, S, V]``), every position from a decode step of the runtime's own generation
  loop (``Session._prefill`` of the first token, then ``Session._decode_step`` per token:
  the subclass hooks ``generate`` runs), so :func:`~edgeprune.evaluation.fidelity.fidelity`
  and :func:`~edgeprune.evaluation.perplexity.perplexity` score the decode path unchanged;
* :func:`path_agreement`: one pass vs decode path on the same windows (argmax agreement,
  max and mean ``|dlogit|``, KL(one pass || decode path)).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np


def decode_path_logits(session, ids) -> np.ndarray:
    """Teacher-forced logits of ``ids`` through the KV cache: ``float32 [S, vocab]``.

    Position 0 comes from a one-token prefill, position ``t > 0`` from the decode step that
    feeds ``ids[t]`` (exactly what ``Session.generate`` runs when it generates ``ids[t]``).

    Args:
        session: a ``runtime.Session`` (or a variant's session class).
        ids: ``int [S]`` token ids, ``S <= session.max_length``.

    Raises:
        GenerationError (runtime): ``S`` exceeds the session's context, or the session is closed.
    """
    from edgeprune_runtime.errors import GenerationError

    ids = [int(t) for t in np.asarray(ids).reshape(-1)]
    if not ids or len(ids) > session.max_length:
        raise GenerationError(f"{len(ids)} tokens do not fit the session's context "
                              f"(max_length={session.max_length})", "score shorter windows")
    out = np.empty((len(ids), session.vocab_size), np.float32)
    session._check_open()
    session._acquire()
    try:
        session.free_kv_cache()       # no prefix of an earlier call is reused
        st = session._prefill([ids[:1]], len(ids))
        out[0] = st["logits"][0]
        for t in range(1, len(ids)):
            out[t] = session._decode_step(st, np.array([ids[t]], np.int64))[0]
    finally:
        session.free_kv_cache()
        session._release()
    return out


class DecodePathModel:
    """An export as evaluation's logits function, on the decode path:
    ``model(ids int64 [B, S]) -> logits float32 [B, S, V]`` (numpy), each row teacher-forced
    token by token (:func:`decode_path_logits`). ``config.max_position_embeddings`` is the
    export's trained context, as for :class:`~edgeprune.evaluation.backends.RuntimeModel`."""

    def __init__(self, session):
        self.session = session
        ctx = session.meta.get("max_position_embeddings")
        self.config = SimpleNamespace(max_position_embeddings=ctx if isinstance(ctx, int) else None)

    def __call__(self, ids):
        rows = np.asarray(ids, dtype=np.int64)
        return np.stack([decode_path_logits(self.session, r) for r in rows.reshape(-1, rows.shape[-1])])


@dataclass
class PathAgreement:
    """One pass vs decode path of one export on the same tokens.

    Attributes:
        argmax_agree: share in [0, 1] of positions whose argmax is the same on both paths.
        max_abs_dlogit: largest ``|logit_one_pass - logit_decode|`` over positions and vocab.
        mean_abs_dlogit: its mean over positions and vocab.
        kl: mean per-position KL(one pass || decode path), nats.
        ntokens: positions compared (every position of every window).
    """

    argmax_agree: float
    max_abs_dlogit: float
    mean_abs_dlogit: float
    kl: float
    ntokens: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class PathScores:
    """Running sums of :class:`PathAgreement` over windows (:meth:`add`, then :meth:`result`)."""

    def __init__(self):
        self.agree = self.abs_sum = self.kl = 0.0
        self.max_abs = 0.0
        self.n = self.cells = 0

    def add(self, one_pass: np.ndarray, decode: np.ndarray) -> None:
        """Add the logits ``[..., V]`` of the same positions on both paths."""
        a = np.asarray(one_pass, np.float64).reshape(-1, np.shape(one_pass)[-1])
        b = np.asarray(decode, np.float64).reshape(-1, np.shape(decode)[-1])
        d = np.abs(a - b)
        la, lb = _log_softmax(a), _log_softmax(b)
        self.kl += float((np.exp(la) * (la - lb)).sum())
        self.agree += float((a.argmax(-1) == b.argmax(-1)).sum())
        self.max_abs = max(self.max_abs, float(d.max()))
        self.abs_sum += float(d.sum())
        self.n += a.shape[0]
        self.cells += d.size

    def result(self) -> PathAgreement:
        n = max(self.n, 1)
        return PathAgreement(argmax_agree=self.agree / n, max_abs_dlogit=self.max_abs,
                             mean_abs_dlogit=self.abs_sum / max(self.cells, 1),
                             kl=max(self.kl / n, 0.0), ntokens=self.n)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare_paths(one_pass: np.ndarray, decode: np.ndarray) -> PathAgreement:
    """:class:`PathAgreement` of two logits arrays ``[..., V]`` of the same positions."""
    acc = PathScores()
    acc.add(one_pass, decode)
    return acc.result()


def path_agreement(session, windows) -> PathAgreement:
    """One pass (``Session.logits``) vs decode path (:func:`decode_path_logits`) on
    ``windows`` (``int [n, S]`` token ids; each row one sequence from position 0).

    Returns:
        :class:`PathAgreement` over all ``n x S`` positions.
    """
    acc = PathScores()
    for r in np.asarray(windows, dtype=np.int64).reshape(-1, np.shape(windows)[-1]):
        acc.add(session.logits(r[None])[0], decode_path_logits(session, r))
    return acc.result()


@dataclass
class ExportFidelity:
    """An export's fidelity to the dense model, on both paths.

    Attributes:
        one_pass: :class:`~edgeprune.evaluation.fidelity.FidelityResult` of the export's
            one-pass (prefill) logits on every window.
        decode: the same on the decode path (token by token through the KV cache), on the
            first ``decode_windows`` windows (its ``ppl_dense`` is the dense model's on those).
        paths: one pass vs decode path of the export on those windows (:class:`PathAgreement`).
    """

    one_pass: Any
    decode: Any
    paths: PathAgreement

    def to_dict(self) -> dict[str, Any]:
        return dict(one_pass=self.one_pass.to_dict(), decode=self.decode.to_dict(),
                    paths=self.paths.to_dict())


def export_fidelity(dense, session, tokenizer, text=None, *, seqlen: int = 512, nwindows: int | None = 40,
                    decode_windows: int = 2, progress: bool = True) -> ExportFidelity:
    """Perplexity, KL(dense || export) and top-1 agreement of an export through the runtime,
    teacher-forced in one pass (every window) and on the decode path (the first
    ``decode_windows`` windows), plus one pass vs decode path of the export; each window's
    dense logits are computed once.

    Args:
        dense: the reference (torch causal LM, export model or logits callable).
        session: the export's ``runtime.Session``.
        tokenizer, text, seqlen, nwindows: the perplexity protocol
            (:func:`~edgeprune.evaluation.perplexity.eval_windows`).
        decode_windows: windows scored on the decode path (``seqlen`` decode steps each),
            at most the windows scored; at least 1.
        progress: progress bar over windows.

    Returns:
        :class:`ExportFidelity`.

    Raises:
        ConfigError: ``decode_windows < 1``; windows longer than a model's context.
        CalibrationError: too little text (:func:`~edgeprune.evaluation.perplexity.eval_windows`).
    """
    import dataclasses

    import torch
    from tqdm.auto import tqdm

    from ..errors import ConfigError
    from .fidelity import WindowScores
    from .perplexity import _check_context, _logits_fn, eval_windows

    if isinstance(decode_windows, bool) or not isinstance(decode_windows, int) or decode_windows < 1:
        raise ConfigError(f"decode_windows={decode_windows!r} must be an integer >= 1",
                          "pass e.g. --decode-windows 2")
    one = DecodePathModel(session)           # its config: the export's trained context
    _check_context(seqlen, dense, one)
    windows, proto = eval_windows(tokenizer, text, seqlen=seqlen, nwindows=nwindows)
    f_dense = _logits_fn(dense)
    s_one, s_dec, s_path = WindowScores(), WindowScores(), PathScores()
    ndec = min(decode_windows, len(windows))
    with torch.no_grad():
        for i, w in enumerate(tqdm(windows, desc="export fidelity", unit="win", disable=not progress,
                                   leave=False)):
            ld = f_dense(w[None])
            lo = session.logits(w[None].numpy())
            s_one.add(ld, lo, w)
            if i < ndec:
                lx = decode_path_logits(session, w.numpy())[None]
                s_dec.add(ld, lx, w)
                s_path.add(lo[0], lx[0])
    dproto = dataclasses.replace(proto, nwindows=ndec, ntokens_scored=ndec * (seqlen - 1))
    return ExportFidelity(one_pass=s_one.result(proto), decode=s_dec.result(dproto), paths=s_path.result())


__all__ = ["DecodePathModel", "PathAgreement", "PathScores", "ExportFidelity", "export_fidelity", "decode_path_logits", "compare_paths", "path_agreement"]
