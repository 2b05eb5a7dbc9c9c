"""The iterator ``Session.stream`` returns: text pieces as tokens are generated, and the outcome.

:class:`TextStream` turns the generation loop's per-token results into text with the
tokenizer's streaming decoder (:class:`runtime.tokenizer.IncrementalDecoder`, over
``tokenizers.decoders.DecodeStream``), holds back text that may still become a stop
string, and records why the generation ended (:attr:`TextStream.finish_reason`) and its
:class:`~runtime.generation.GenerationResult` (token counts, timings, cached prefix).
"""

from __future__ import annotations

import threading
from typing import Iterator, Optional

#: :attr:`TextStream.finish_reason` of a stream closed or cancelled before its end
CANCELLED = "cancelled"


class TextStream:
    """Text pieces of one generation, as they are generated (an iterator of ``str``).

    Same pieces as before: their concatenation is the generated text (cut before a stop
    string). Once the iterator is exhausted it tells how the generation ended.

    Attributes:
        finish_reason: ``None`` while running; then ``"eos"`` (the model ended its turn),
            ``"stop"`` (a stop string), ``"length"`` (``max_new_tokens``), or
            ``"cancelled"`` (:meth:`close` or :meth:`cancel` before the end).
        result: the :class:`~runtime.generation.GenerationResult` of the tokens so far
            (``None`` before the first token): ``token_ids``, ``prompt_tokens``,
            ``cached_tokens``, ``ttft_ms``, ``decode_tok_s``...

    Args:
        results: the loop's generator of ``(GenerationResult, final)`` (one per token).
        stop: stop strings (non-empty).
        tokenizer: the session's :class:`runtime.tokenizer.Tokenizer`.
    """

    def __init__(self, results, stop: list, tokenizer):
        self._results = results
        self._stop = list(stop)
        self._tokenizer = tokenizer
        self._cancel = threading.Event()
        self.finish_reason: Optional[str] = None
        self.result = None
        self._pieces = self._text()

    def __iter__(self) -> "TextStream":
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def cancel(self) -> None:
        """Ask the generation to stop (thread-safe: for a thread other than the one
        iterating, e.g. a server whose client went away). The iterating thread stops
        before the next token, the session frees the KV buffers, and the iteration ends
        with ``finish_reason == "cancelled"``."""
        self._cancel.set()

    def close(self) -> None:
        """Stop now (from the iterating thread): the session is free again and its KV
        buffers are freed if the generation had not ended."""
        self._pieces.close()
        self._results.close()
        if self.finish_reason is None:
            self.finish_reason = CANCELLED

    def _text(self) -> Iterator[str]:
        """The new text of each result, held back while it may still become the start of
        a stop string and cut before one."""
        dec = self._tokenizer.incremental_decoder()
        stop = self._stop
        emitted, n = "", 0
        hold = max((len(s) for s in stop), default=1) - 1
        for res, final in self._results:
            self.result = res
            if self._cancel.is_set() and not final:
                self._results.close()           # frees the KV buffers of the unfinished run
                self.finish_reason = CANCELLED
                return
            ids = res.token_ids[0]
            for t in ids[n:]:
                dec.push(t)
            n = len(ids)
            if final:
                dec.flush()
                self.finish_reason = res.finish_reasons[0]
            text = dec.text
            if stop:
                cut = min((text.find(s) for s in stop if s and s in text), default=-1)
                if cut >= 0:
                    text = text[:cut]
                elif not final and hold:
                    text = text[:max(len(emitted), len(text) - hold)]
            if len(text) > len(emitted) and text.startswith(emitted):
                yield text[len(emitted):]
                emitted = text


__all__ = ["TextStream", "CANCELLED"]
