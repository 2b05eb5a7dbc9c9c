"""What ``Session.generate`` / ``stream`` / ``logits`` take, checked and turned into token ids.

Every malformed input gets one :class:`~runtime.errors.GenerationError` naming the problem
and the fix, before any graph runs.
"""

from __future__ import annotations

import numpy as np

from .errors import GenerationError
from .tokenizer import check_text


def check_token_range(lo, hi, vocab_size: int) -> None:
    """Raises :class:`GenerationError` unless token ids ``lo..hi`` lie in ``[0, vocab_size)``."""
    if lo < 0 or hi >= vocab_size:
        raise GenerationError(f"token id out of range [0, {vocab_size}): min {int(lo)}, "
                              f"max {int(hi)}", "encode the text with this folder's tokenizer")


def encode_prompts(tokenizer, prompt, chat: bool, vocab_size: int, max_length: int,
                   context_policy: str) -> tuple[list[list[int]], bool]:
    """The token ids of each row of ``prompt`` and whether it was a batch.

    Args:
        tokenizer: the folder's ``runtime.tokenizer.Tokenizer``.
        prompt: a string, token ids, a batch of either, or one conversation (a list of
            ``{"role", "content"}`` messages, rendered with the chat template).
        chat: render string rows with the chat template first.
        vocab_size: ids must lie in ``[0, vocab_size)``.
        max_length: the context; a longer row raises, or under ``context_policy
            "sliding_window"`` keeps its last ``max_length // 2`` tokens.
        context_policy: ``"error"`` | ``"sliding_window"``.

    Returns:
        ``(rows, batched)``: a non-empty ``list[int]`` per row.

    Raises:
        GenerationError: an empty prompt or row, a row neither text nor integer ids, text
            that is not valid (a lone surrogate, a byte that was not UTF-8:
            :func:`runtime.tokenizer.check_text`),
            ``chat`` with token ids, ids out of range, a row longer than ``max_length``
            under the ``"error"`` policy.
    """
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        # one conversation: [{"role": ..., "content": ...}, ...] through the chat template
        for i, m in enumerate(prompt):
            if isinstance(m.get("content"), str):
                check_text(m["content"], f"message {i}'s content")
        prompt = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
        chat = False
    if isinstance(prompt, str):
        prompts, batched = [prompt], False
    elif isinstance(prompt, np.ndarray):
        prompts = prompt.tolist() if prompt.ndim == 2 else [prompt.tolist()]
        batched = prompt.ndim == 2
    elif isinstance(prompt, (list, tuple)) and len(prompt) > 0 and \
            all(isinstance(t, (int, np.integer)) for t in prompt):
        prompts, batched = [list(prompt)], False
    elif isinstance(prompt, (list, tuple)) and len(prompt) > 0:
        prompts, batched = list(prompt), True
    elif isinstance(prompt, (list, tuple, np.ndarray)):
        raise GenerationError("the prompt is empty", "pass a non-empty string or token ids")
    else:
        raise GenerationError(f"a prompt must be a string, token ids or a list of them, "
                              f"got {type(prompt).__name__}",
                              "pass e.g. 'Hello' or [1, 2, 3]")
    out = []
    for row, p in enumerate(prompts):
        if isinstance(p, str):
            check_text(p, f"prompt row {row}" if batched else "the prompt")
            if chat:
                p = tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                       add_generation_prompt=True)
            ids = tokenizer.encode(p, add_special_tokens=False) if p else []
        elif isinstance(p, (list, tuple, np.ndarray)) and all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in p):
            if chat:
                raise GenerationError("chat=True renders the chat template around a text prompt; "
                                      "token ids would be used as they are",
                                      "pass the text, or token ids already templated with chat=False")
            ids = [int(t) for t in p]
        else:
            raise GenerationError(f"prompt row {row} is neither a string nor integer token ids "
                                  f"({type(p).__name__})",
                                  "pass strings, or lists of int token ids from this "
                                  "folder's tokenizer")
        if not ids:
            raise GenerationError("the prompt is empty" + (f" (row {row})" if batched else ""),
                                  "pass a non-empty string or token ids")
        check_token_range(min(ids), max(ids), vocab_size)
        if len(ids) > max_length:
            if context_policy == "sliding_window":
                ids = ids[-max(1, max_length // 2):]   # the window an overflow keeps
            else:
                raise GenerationError(f"the prompt has {len(ids)} tokens, more than the "
                                      f"context max_length={max_length}",
                                      "shorten the prompt, load with a larger max_length, or "
                                      "use context_policy='sliding_window' (keeps its last "
                                      "max_length // 2 tokens)")
        out.append(ids)
    return out, batched


def logits_inputs(input_ids, attention_mask, vocab_size: int, max_length: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``(ids int64 [B, S], mask int64 [B, S])`` checked for ``Session.logits``: integer
    ids in ``[0, vocab_size)``, ``S <= max_length``, a 0/1 mask of the same shape, padded
    on the left only, with a real token in every row.

    Raises:
        GenerationError: naming the problem and the fix.
    """
    ids = np.asarray(input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise GenerationError(f"input_ids must be integer token ids [batch, seq] (or [seq]), got "
                              f"{ids.dtype} {tuple(np.shape(input_ids))}",
                              "pass e.g. np.array([[1, 2, 3]])")
    check_token_range(ids.min(), ids.max(), vocab_size)
    ids = ids.astype(np.int64)
    if ids.shape[1] > max_length:
        raise GenerationError(f"{ids.shape[1]} tokens exceed max_length={max_length}",
                              "evaluate shorter windows or load with a larger max_length")
    if attention_mask is None:
        return ids, np.ones_like(ids)
    mask = np.asarray(attention_mask)
    if mask.ndim == 1:
        mask = mask[None]
    if mask.shape != ids.shape or not np.isin(mask, (0, 1)).all():
        raise GenerationError(f"attention_mask must be 0/1 of the ids' shape {ids.shape}, got "
                              f"{mask.dtype} {tuple(mask.shape)}",
                              "pass 1 on real tokens and 0 on (left) padding")
    mask = mask.astype(np.int64)
    if (mask.sum(1) == 0).any():
        raise GenerationError("a row of attention_mask has no real token", "drop empty rows")
    if (np.diff(mask, axis=1) < 0).any():
        raise GenerationError("attention_mask has padding after a real token (right or "
                              "inner padding)", "pad on the left, as for generation")
    return ids, mask


__all__ = ["check_token_range", "encode_prompts", "logits_inputs"]
