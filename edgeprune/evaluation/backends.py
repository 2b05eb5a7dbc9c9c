"""One scoring interface over a PyTorch model and an ONNX export, so that tasks, fidelity
and perplexity score both with the same code.

A backend answers two questions about token ids:

* :meth:`score`: the summed log-probability of each continuation after a context, and
  whether it is the greedy one (every token the argmax) -- lm-eval's ``loglikelihood``;
* :meth:`greedy`: up to ``n`` greedily generated tokens after a prompt.

:class:`TorchBackend` runs a transformers causal LM: the context once (with its KV cache),
then every continuation of it in one batch on top of that cache (the choices of a
multiple-choice item share their context). :class:`RuntimeBackend` runs an export through
``runtime`` (``Session.logits``: each context + continuation as one left-padded row;
``Session.generate``): an ONNX model is scored exactly like a checkpoint, by the numbers
its own graph computes. :func:`load_evaluated` loads either from a path or alias.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

Scores = list[tuple[float, bool]]


def _truncate(context: list[int], continuations: Sequence[list[int]], max_length: int) -> list[int]:
    """The context cut from the left so that context + longest continuation - 1 fits
    ``max_length`` (what lm-eval's HFLM does per request)."""
    room = max_length + 1 - max(len(c) for c in continuations)
    return context[-room:] if len(context) > room else context


def _gather(first: torch.Tensor, rest: Optional[torch.Tensor], cont: list[int]) -> tuple[float, bool]:
    """``(sum log p, all greedy)`` of ``cont`` from the log-probs predicting its first token
    (``first [V]``) and the rest (``rest [>= len(cont) - 1, V]``)."""
    lp = float(first[cont[0]])
    greedy = int(first.argmax()) == cont[0]
    if len(cont) > 1:
        r = rest[: len(cont) - 1]
        tgt = torch.tensor(cont[1:], dtype=torch.long)
        lp += float(r.gather(1, tgt[:, None]).sum())
        greedy = greedy and bool((r.argmax(-1) == tgt).all())
    return lp, greedy


#: Tokens per packed forward pass of :class:`TorchBackend` (several groups in one row).
#: Measured on SmolLM2-135M, 1 thread, 300 groups of the study's seven tasks (bf16):
#: 128 tokens 41.2 s, 256 39.5 s, 512 42.9 s, against 66.7 s for one group per pass.
PACK_TOKENS = 256


def _packable(model, params) -> bool:
    """Whether ``model`` can score several groups in one row: an attention that takes a
    custom additive 4D mask (``sdpa``, ``eager``), a forward that takes ``position_ids``
    and an index tensor as ``logits_to_keep``, and no hook on the whole model (such a
    hook may act per batch row, e.g. IG-Pruning's router, and a packed row mixes groups).
    ``params``: the parameters of ``model.forward``."""
    impl = getattr(model.config, "_attn_implementation", None)
    return (impl in ("sdpa", "eager") and "position_ids" in params and "logits_to_keep" in params
            and not model._forward_pre_hooks and not model._forward_hooks)


class TorchBackend:
    """A transformers causal LM (``model(ids, past_key_values=..., use_cache=True)``).

    Scoring packs several ``(context, continuations)`` groups into one row of up to
    ``pack_tokens`` tokens: each group's context once, then each continuation (all but its
    last token) after it, with positions restarting per group and per continuation and an
    additive 4D attention mask that lets a token see only its own context and its own
    continuation (a prefix tree per group, groups block-diagonal). One forward pass
    scores them all with no padding; the head runs only on the positions whose
    log-probabilities are read (``logits_to_keep`` as indices). Models that cannot take
    such a mask (see :func:`_packable`) score one group per pass on a KV cache.

    Args:
        model: the torch model (eval mode; its device is used).
        max_length: context limit in tokens (default: ``config.max_position_embeddings``).
        pack_tokens: tokens per packed row (0: one group per pass, context on a KV cache).
    """

    def __init__(self, model, max_length: Optional[int] = None, pack_tokens: int = PACK_TOKENS):
        self.model = model
        self.device = next(model.parameters()).device
        cfg = model.config
        self.max_length = int(max_length or getattr(cfg, "max_position_embeddings", None) or 2048)
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = getattr(cfg, "eos_token_id", None)
        self.eos_token_ids = set([eos] if isinstance(eos, int) else (eos or []))
        import inspect

        # transformers 5.24 names the KV cache ``cache`` (``past_key_values`` before)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.pack_tokens = int(pack_tokens) if pack_tokens and _packable(model, params) else 0
        types = getattr(cfg, "layer_types", None) or []
        window = getattr(cfg, "sliding_window", None)
        self._window = int(window) if window and "sliding_attention" in types else None

    def plan(self, sizes: Sequence[int]) -> list[list[int]]:
        """Which groups share a forward pass: consecutive groups of ``sizes`` (tokens each,
        :meth:`group_tokens`) filled up to ``pack_tokens`` (a larger group alone);
        one group per pass when packing is off."""
        if not self.pack_tokens:
            return [[i] for i in range(len(sizes))]
        out: list[list[int]] = []
        used = 0
        for i, n in enumerate(sizes):
            if out and used + n <= self.pack_tokens:
                out[-1].append(i)
                used += n
            else:
                out.append([i])
                used = n
        return out

    def group_tokens(self, context: list[int], continuations: Sequence[list[int]]) -> int:
        """Tokens a group takes in a packed row: its (truncated) context and every
        continuation but its last token."""
        ctx = _truncate(context, continuations, self.max_length)
        return len(ctx) + sum(len(c) - 1 for c in continuations)

    def _step(self, rows, cache=None, **kw):
        """``(logits, cache)`` of a forward over ``rows`` (ids or a tensor) on top of ``cache``."""
        if cache is not None:
            kw[self._cache_kw] = cache
        ids = rows.to(self.device) if isinstance(rows, torch.Tensor) else self._ids(rows)
        out = self.model(ids, use_cache=True, **kw)
        new = getattr(out, "cache", None)
        return out.logits, (new if new is not None else out.past_key_values)

    def _ids(self, rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def score(self, context: list[int], continuations: Sequence[list[int]]) -> Scores:
        """Log-likelihood of each continuation after ``context``.

        Args:
            context: token ids (at least one).
            continuations: token ids of each continuation (each at least one).

        Returns:
            ``[(sum of log p over the continuation's tokens (nats), greedy), ...]``.
        """
        return self.score_many([(context, continuations)])[0]

    @torch.no_grad()
    def score_many(self, groups: Sequence[tuple[list[int], Sequence[list[int]]]]) -> list[Scores]:
        """:meth:`score` of several ``(context, continuations)`` groups: packed rows of
        ``pack_tokens`` (see the class), or, with packing off, two forward passes: the
        contexts (left-padded, with their attention mask and positions), then every
        continuation on its context's KV cache rows."""
        if self.pack_tokens:
            out: list[Scores] = []
            for row in self.plan([self.group_tokens(c, k) for c, k in groups]):
                out += self._score_row([groups[i] for i in row])
            return out
        return self._score_cached(groups)

    def _score_row(self, groups) -> list[Scores]:
        """The groups of one packed row in one forward pass (see the class)."""
        ids: list[int] = []
        pos: list[int] = []
        grp: list[int] = []
        branch: list[int] = []
        where = []                                  # (last context index, [(start, n)], conts)
        for g, (context, conts) in enumerate(groups):
            ctx = _truncate(context, conts, self.max_length)
            ids += ctx
            last = len(ids) - 1                     # predicts every continuation's first token
            pos += range(len(ctx))
            grp += [g] * len(ctx)
            branch += [0] * len(ctx)
            spans = []
            for k, c in enumerate(conts):
                spans.append((len(ids), len(c) - 1))
                ids += c[:-1]
                pos += range(len(ctx), len(ctx) + len(c) - 1)
                grp += [g] * (len(c) - 1)
                branch += [k + 1] * (len(c) - 1)
            where.append((last, spans, conts))
        n = len(ids)
        gt, bt, pt, ar = (torch.tensor(v) for v in (grp, branch, pos, list(range(n))))
        allow = ((gt[:, None] == gt[None]) & ((bt[None] == 0) | (bt[:, None] == bt[None]))
                 & (ar[None] <= ar[:, None]))
        dtype = next(self.model.parameters()).dtype
        low = torch.finfo(dtype).min

        def additive(ok):
            return torch.zeros((1, 1, n, n), dtype=dtype).masked_fill_(~ok, low).to(self.device)

        mask = additive(allow)
        if self._window is not None:
            mask = {"full_attention": mask,
                    "sliding_attention": additive(allow & ((pt[:, None] - pt[None]) < self._window))}
        need = sorted({w[0] for w in where} | {a + i for w in where for a, m in w[1] for i in range(m)})
        row = {p: i for i, p in enumerate(need)}
        logits = self.model(torch.tensor([ids], device=self.device), attention_mask=mask,
                            position_ids=pt[None].to(self.device), use_cache=False,
                            logits_to_keep=torch.tensor(need, device=self.device)).logits[0]
        lp = F.log_softmax(logits.float(), -1).cpu()
        return [[_gather(lp[row[first]], lp[[row[a + i] for i in range(m)]] if m else None, c)
                 for (a, m), c in zip(spans, conts)] for first, spans, conts in where]

    def _score_cached(self, groups) -> list[Scores]:
        """Groups scored on a KV cache (packing off): contexts left-padded in one pass,
        then every continuation in a second pass on its context's cache rows."""
        ctxs = [_truncate(ctx, conts, self.max_length) for ctx, conts in groups]
        width = max(len(c) for c in ctxs)
        ids = torch.zeros((len(ctxs), width), dtype=torch.long)
        mask = torch.zeros((len(ctxs), width), dtype=torch.long)
        for g, c in enumerate(ctxs):
            ids[g, width - len(c):] = torch.tensor(c)
            mask[g, width - len(c):] = 1
        padded = bool((mask == 0).any())
        kw = dict(attention_mask=mask.to(self.device),
                  position_ids=(mask.cumsum(1) - 1).clamp(min=0).to(self.device)) if padded else {}
        logits, cache = self._step(ids, logits_to_keep=1, **kw)
        first = F.log_softmax(logits[:, -1].float(), -1).cpu()
        rows = [(g, i) for g, (_, conts) in enumerate(groups) for i, c in enumerate(conts) if len(c) > 1]
        rest: dict[tuple[int, int], torch.Tensor] = {}
        if rows:
            conts = [groups[g][1][i] for g, i in rows]
            t = max(len(c) - 1 for c in conts)
            # right padding: causal attention never lets a real token read it
            rid = torch.tensor([c[:-1] + [c[0]] * (t - len(c) + 1) for c in conts], dtype=torch.long)
            sel = torch.tensor([g for g, _ in rows])
            if len(ctxs) > 1 or len(rows) > 1:
                cache.batch_select_indices(sel.to(self.device))
            kw = {}
            if padded:
                kw = dict(attention_mask=torch.cat([mask[sel], torch.ones((len(rows), t), dtype=torch.long)],
                                                   1).to(self.device),
                          position_ids=(torch.tensor([len(ctxs[g]) for g in sel.tolist()])[:, None]
                                        + torch.arange(t)[None]).to(self.device))
            lo = F.log_softmax(self._step(rid.tolist(), cache, **kw)[0].float(), -1).cpu()
            rest = {r: lo[k] for k, r in enumerate(rows)}
        return [[_gather(first[g], rest.get((g, i)), c) for i, c in enumerate(conts)]
                for g, (_, conts) in enumerate(groups)]

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_new_tokens: int, stop_eos: bool = True) -> list[int]:
        """Up to ``max_new_tokens`` greedy tokens after ``prompt`` (an end-of-sequence token
        ends it and is not returned when ``stop_eos``)."""
        return self.greedy_many([prompt], max_new_tokens, stop_eos)[0]

    @torch.no_grad()
    def greedy_many(self, prompts: Sequence[list[int]], max_new_tokens: int, stop_eos: bool = True
                    ) -> list[list[int]]:
        """:meth:`greedy` of several prompts of one length in one batch (one forward per
        step for all of them; a row that has ended is still fed, its tokens dropped).
        Prompts of different lengths are generated one by one.

        Returns:
            One token list per prompt, as :meth:`greedy` gives it.
        """
        if len({len(p) for p in prompts}) != 1:
            return [self.greedy(p, max_new_tokens, stop_eos) for p in prompts]
        logits, cache = self._step([list(p) for p in prompts], logits_to_keep=1)
        new: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        while True:
            toks = logits[:, -1].argmax(-1).tolist()
            for i, tok in enumerate(toks):
                if done[i]:
                    continue
                if stop_eos and tok in self.eos_token_ids:
                    done[i] = True
                    continue
                new[i].append(tok)
                done[i] = len(new[i]) >= max_new_tokens
            if all(done):
                return new
            logits, cache = self._step([[t] for t in toks], cache)


class RuntimeBackend:
    """An export loaded by ``runtime.load`` (its graph computes every number).

    Args:
        session: a ``runtime.Session``.
        batch: rows per ``Session.logits`` call.
    """

    def __init__(self, session, batch: int = 8):
        self.session = session
        self.max_length = int(session.max_length)
        self.eos_token_ids = set(session.eos_token_ids)
        self.batch = batch

    @torch.no_grad()
    def score(self, context: list[int], continuations: Sequence[list[int]]) -> Scores:
        """As :meth:`TorchBackend.score`: each ``context + continuation[:-1]`` one row."""
        import numpy as np

        ctx = _truncate(context, continuations, self.max_length)
        out: Scores = []
        for s in range(0, len(continuations), self.batch):
            conts = continuations[s: s + self.batch]
            rows = [ctx + c[:-1] for c in conts]
            width = max(len(r) for r in rows)
            ids = np.zeros((len(rows), width), np.int64)
            mask = np.zeros((len(rows), width), np.int64)
            for b, r in enumerate(rows):          # left padding, as Session.logits wants
                ids[b, width - len(r):] = r
                mask[b, width - len(r):] = 1
            logits = self.session.logits(ids, mask)
            for b, c in enumerate(conts):
                lp = F.log_softmax(torch.from_numpy(logits[b, width - len(c):]).float(), -1)
                out.append(_gather(lp[0], lp[1:], c))
        return out

    def score_many(self, groups) -> list[Scores]:
        """:meth:`score` of each ``(context, continuations)`` group."""
        return [self.score(ctx, conts) for ctx, conts in groups]

    def greedy_many(self, prompts, max_new_tokens: int, stop_eos: bool = True) -> list[list[int]]:
        """:meth:`greedy` of each prompt."""
        return [self.greedy(p, max_new_tokens, stop_eos) for p in prompts]

    def greedy(self, prompt: list[int], max_new_tokens: int, stop_eos: bool = True) -> list[int]:
        """As :meth:`TorchBackend.greedy`, through ``Session.generate`` (temperature 0)."""
        res = self.session.generate([list(prompt)], max_new_tokens=max_new_tokens, temperature=0.0)
        ids = list(res.token_ids[0])
        if stop_eos:
            ids = [t for t in ids if t not in self.eos_token_ids][:max_new_tokens]
        return ids


class RuntimeModel:
    """An export as evaluation's logits function: ``model(ids int64 [B, S]) -> logits
    float32 [B, S, V]`` (numpy), with the session and the trained context
    (``config.max_position_embeddings``, when the export records it)."""

    def __init__(self, session):
        self.session = session
        ctx = session.meta.get("max_position_embeddings")
        self.config = SimpleNamespace(max_position_embeddings=ctx if isinstance(ctx, int) else None)

    def __call__(self, ids):
        import numpy as np

        return self.session.logits(np.asarray(ids, dtype=np.int64))


def backend_for(model):
    """The backend of a torch model, a :class:`RuntimeModel` or a ``runtime`` session.

    Raises:
        ConfigError: anything else.
    """
    from ..errors import ConfigError

    if isinstance(model, torch.nn.Module):
        return TorchBackend(model)
    if isinstance(model, RuntimeModel):
        return RuntimeBackend(model.session)
    if hasattr(model, "logits") and hasattr(model, "generate") and hasattr(model, "max_length"):
        return RuntimeBackend(model)
    raise ConfigError(f"cannot score a {type(model).__name__}",
                      "pass a torch causal LM, an export folder or a runtime session")


def is_export(source) -> bool:
    """``source`` is an export folder (``model.onnx`` + ``edgeprune.json``)."""
    try:
        p = Path(source).expanduser()
        return p.is_dir() and (p / "model.onnx").is_file() and (p / "edgeprune.json").is_file()
    except (OSError, ValueError, TypeError):
        return False


#: Precisions a PyTorch model can be scored in (``--dtype``).
SCORING_DTYPES = ("float32", "bfloat16")


def check_scoring_dtype(dtype: str, option: str = "--dtype") -> None:
    """Raises ConfigError unless ``dtype`` is one of :data:`SCORING_DTYPES` (the dtypes a
    model is scored or calibrated in); ``option`` names the setting in the message."""
    if dtype not in SCORING_DTYPES:
        from ..errors import ConfigError

        raise ConfigError(f"{option} {dtype} is not one of {', '.join(SCORING_DTYPES)}",
                          f"pass {option} float32 or {option} bfloat16")


def scoring_model(model, dtype: str = "float32"):
    """``model`` as scored in ``dtype``: itself for ``"float32"``, a ``bfloat16`` copy for
    ``"bfloat16"`` (the original is left as it is; log-probabilities are still taken in
    float32 from the bfloat16 logits).

    bfloat16 scoring runs the matmuls on the CPU's bfloat16 units (AVX512-BF16, AMX): on
    the 2-core AVX512-BF16 host, a linear layer of SmolLM2-135M runs 2.9x faster and task
    scoring about 2x. Each weight is rounded to 8 mantissa bits, comparable to an 8-bit
    grid's step, so it suits task accuracy and language perplexity of models far apart,
    not fine fidelity figures (KL, SNR), which stay float32.

    Raises:
        ConfigError: an unknown ``dtype``; a non-float32 ``dtype`` for an export (its graph
            fixes the precision).
    """
    from ..errors import ConfigError

    check_scoring_dtype(dtype)
    if dtype == "float32":
        return model
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"--dtype {dtype} applies to PyTorch models; an export runs in its graph's precision",
                          "drop --dtype for an export, or export at the precision you want")
    import copy

    return copy.deepcopy(model).to(getattr(torch, dtype))


def load_evaluated(source, threads: Optional[int] = None, device: str = "cpu"):
    """``(model, tokenizer)`` of an alias, model file or folder, checkpoint, or export.

    An export comes back as a :class:`RuntimeModel` and the Hugging Face tokenizer of its
    ``tokenizer.json`` (with ``tokenizer_config.json`` when the folder has one), so the
    token ids are those of the checkpoint it came from.

    Raises:
        ModelLoadError, RuntimeLoadError: see :func:`edgeprune.models.load_model` and
            ``runtime.load``.
    """
    if is_export(source):
        import edgeprune_runtime as runtime

        p = Path(source).expanduser()
        sess = runtime.load(p, threads=threads)
        if (p / "tokenizer_config.json").is_file():
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(p))
        else:
            from transformers import PreTrainedTokenizerFast

            tok = PreTrainedTokenizerFast(tokenizer_file=str(p / "tokenizer.json"))
        return RuntimeModel(sess), tok
    from ..models import load_model

    return load_model(source, device=device)


__all__ = ["TorchBackend", "RuntimeBackend", "RuntimeModel", "backend_for", "load_evaluated",
           "is_export", "scoring_model", "check_scoring_dtype", "SCORING_DTYPES"]
