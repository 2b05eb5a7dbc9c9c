"""Long-context evaluation of LeanK: perplexity on 2,048-token windows and a synthetic
key-value retrieval ("needle in a haystack") test, through the torch reference or any
generate function (an ONNX LeanK session)."""

from __future__ import annotations

import contextlib
import random
import time

import torch

from ..errors import CalibrationError
from .config import DEFAULT_SINK, DEFAULT_WINDOW, check_leank_args
from .reference import apply_reference


def long_perplexity(model, tokenizer, mask, text=None, *,
                    seqlen: int = 2048, nwindows: int = 10, sink: int = DEFAULT_SINK,
                    window: int = DEFAULT_WINDOW, progress: bool = False):
    """Perplexity (``edgeprune.evaluate`` protocol: no BOS, non-overlapping windows) with
    the LeanK reference attention; ``mask=None`` gives the unpruned figure through the
    same code path.

    Returns:
        ``edgeprune.evaluate.PerplexityResult``.

    Raises:
        ConfigError: ``sink + window`` larger than ``seqlen`` when a mask is given.
    """
    from ..evaluate import perplexity
    if mask is None:        # unpruned: the model's own attention (sdpa), same numbers
        return perplexity(model, tokenizer, text, seqlen=seqlen, nwindows=nwindows,
                          progress=progress)
    check_leank_args(sink=sink, window=window, context=seqlen)
    with apply_reference(model, mask, sink, window):
        return perplexity(model, tokenizer, text, seqlen=seqlen, nwindows=nwindows,
                          progress=progress)


NAMES = ["Alice", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ingrid",
         "Jonas", "Kamala", "Luca", "Marta", "Nils", "Olga", "Pavel", "Quentin", "Rosa",
         "Sven", "Tamar", "Ugo", "Vera", "Wanda", "Xavier", "Yara", "Zoltan"]


def retrieval_prompts(tokenizer, text=None, *, n_trials: int = 20, context_tokens: int = 2000,
                      seed: int = 0, chat: bool = False) -> list[dict]:
    """Synthetic long-context retrieval trials ("needle in a haystack").

    One haystack, the first ``context_tokens`` tokens of ``text`` (default: the embedded
    held-out text), is shared by all trials. Trial ``t`` inserts the fact " The secret code
    of <name> is <5-digit number>." at depth ``t / (n_trials - 1)`` of the haystack
    (0% = start, 100% = end; snapped to just after a token ending a sentence when one is
    within 40 tokens), then asks: "Question: What is the secret code of <name>?
    Answer: The secret code of <name> is" and the greedy continuation is scored. With
    ``chat=True`` the document + question form a user turn of the tokenizer's chat
    template and the assistant's answer is primed the same way.

    Returns:
        ``[{"ids": list[int], "prefix": int, "answer": str, "depth": float, "name": str}]``
        where ``ids[:prefix]`` is the shared haystack prefix (reusable cache).
    """
    from ..evaluate import resolve_text
    body, _ = resolve_text(text)
    hay = tokenizer(body, add_special_tokens=False)["input_ids"]
    if len(hay) < context_tokens:
        raise CalibrationError(f"retrieval text has {len(hay)} tokens, {context_tokens} needed",
                               "use a longer text or fewer context_tokens")
    hay = hay[:context_tokens]
    ends = [i + 1 for i, t in enumerate(hay) if tokenizer.decode([t]).rstrip().endswith(".")]
    rng = random.Random(seed)
    head: list[int] = []
    if chat and getattr(tokenizer, "chat_template", None):
        marker = "\x00DOC\x00"
        tmpl = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                             add_generation_prompt=True)
        pre_txt, post_txt = tmpl.split(marker)
        head = tokenizer(pre_txt, add_special_tokens=False)["input_ids"]
    out = []
    for t in range(n_trials):
        depth = t / max(1, n_trials - 1)
        cut = int(round(depth * len(hay)))
        near = [e for e in ends if abs(e - cut) <= 40]
        if near and 0 < depth < 1:
            cut = min(near, key=lambda e: abs(e - cut))
        name = NAMES[t % len(NAMES)]
        code = str(rng.randint(10000, 99999))
        fact = tokenizer(f" The secret code of {name} is {code}. ", add_special_tokens=False)["input_ids"]
        q = f"What is the secret code of {name}?"
        prime = f"The secret code of {name} is"
        if head:
            tail = tokenizer("\n\n" + q + post_txt + prime, add_special_tokens=False)["input_ids"]
        else:
            tail = tokenizer("\n\nQuestion: " + q + "\nAnswer: " + prime,
                             add_special_tokens=False)["input_ids"]
        ids = head + hay[:cut] + fact + hay[cut:] + tail
        out.append({"ids": ids, "prefix": len(head) + cut, "answer": code,
                    "depth": round(depth, 3), "name": name})
    return out


def _torch_greedy(model, ids: list[int], max_new_tokens: int, prefix_cache=None,
                  prefix: int = 0) -> list[int]:
    """Greedy decoding with HF's cache; ``prefix_cache`` (a cache of ``ids[:>=prefix]``)
    is copied and cropped to ``prefix`` tokens instead of recomputing them."""
    import copy
    dev = next(model.parameters()).device
    out: list[int] = []
    with torch.no_grad():
        cache = None
        start = 0
        if prefix_cache is not None and prefix > 0:
            cache = copy.deepcopy(prefix_cache)
            extra = cache.get_seq_length() - prefix
            if extra > 0:
                cache.crop(-extra)
            start = prefix
        res = model(torch.tensor([ids[start:]], device=dev), cache=cache, use_cache=True)
        for _ in range(max_new_tokens):
            t = int(res.logits[0, -1].argmax())
            out.append(t)
            if len(out) == max_new_tokens:
                break
            res = model(torch.tensor([[t]], device=dev), cache=res["cache"], use_cache=True)
    return out


def retrieval_eval(model_or_generate, tokenizer, mask = None, text=None, *,
                   n_trials: int = 20, context_tokens: int = 2000, sink: int = DEFAULT_SINK,
                   window: int = DEFAULT_WINDOW, chat: bool = False, seed: int = 0,
                   max_new_tokens: int = 7, progress: bool = False) -> dict:
    """Exact-match accuracy of the greedy continuation on :func:`retrieval_prompts`.

    A trial scores 1 when the first number in the continuation equals the planted code.

    Args:
        model_or_generate: a torch model (run under :func:`apply_reference` with ``mask``,
            decoding with HF's cache) or a callable ``fn(ids: list[int], max_new_tokens)
            -> list[int]`` (e.g. an ONNX LeanK session).

    Returns:
        ``{"accuracy", "n_trials", "context_tokens", "chat", "by_depth": {depth: 0/1},
        "seconds"}``.
    """
    import re
    trials = retrieval_prompts(tokenizer, text, n_trials=n_trials, context_tokens=context_tokens,
                               seed=seed, chat=chat)
    t0 = time.perf_counter()
    torch_model = isinstance(model_or_generate, torch.nn.Module)
    if torch_model:
        model = model_or_generate
        ctx = apply_reference(model, mask, sink, window) if mask is not None \
            else contextlib.nullcontext()
    else:
        ctx = contextlib.nullcontext()
        gen = model_or_generate
    hits, by_depth, samples = 0, {}, []
    from tqdm.auto import tqdm
    with ctx:
        shared = None
        if torch_model:   # the haystack prefix is common to all trials: compute its cache once
            longest = max(trials, key=lambda tr: tr["prefix"])
            with torch.no_grad():
                dev = next(model.parameters()).device
                shared = model(torch.tensor([longest["ids"][:longest["prefix"]]], device=dev),
                               use_cache=True)["cache"]
        for tr in tqdm(trials, desc="retrieval", disable=not progress, leave=False):
            if torch_model:
                toks = _torch_greedy(model, tr["ids"], max_new_tokens, shared, tr["prefix"])
            else:
                toks = gen(tr["ids"], max_new_tokens)
            txt = tokenizer.decode(toks)
            m = re.search(r"\d+", txt)
            ok = bool(m and m.group(0) == tr["answer"])
            hits += ok
            by_depth[str(tr["depth"])] = int(ok)
            if len(samples) < 3:
                samples.append({"answer": tr["answer"], "got": txt})
    return {"accuracy": hits / len(trials), "n_trials": len(trials),
            "context_tokens": context_tokens, "chat": chat, "by_depth": by_depth,
            "samples": samples, "seconds": round(time.perf_counter() - t0, 1)}


__all__ = ["long_perplexity", "retrieval_prompts", "retrieval_eval"]
