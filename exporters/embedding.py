"""The token embedding and the ``lm_head`` of the decoder graph (and their shared table).

:class:`EmbeddingHeadMixin` is the part of :class:`~exporters.decoder.DecoderBuilder` that
builds ``input_ids -> hidden`` and ``hidden -> logits``. The head is stored as the export
asks (``lm_head``: ``fp``, ``q8`` or ``int4``); a tied model's quantized head table is
shared with the embedding on fused graphs (rows of codes gathered and dequantized in the
graph), so the 8-bit table is stored once.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from .graph import MS_DOMAIN
from .int4 import (IntWeight, default_zero_points, from_quantized, pack_matmulnbits,
                   q8_head_block, rtn_int)


class EmbeddingHeadMixin:
    """Embedding and head of :class:`~exporters.decoder.DecoderBuilder` (reads ``self.g``,
    ``self.spec``, ``self.opts``; sets ``self._head_int``, ``self._head_tensors``,
    ``self._emb_name``)."""

    #: why :meth:`default_lm_head` picks what it picks (``edgeprune.json`` ``head.policy``)
    head_policy = ("int4 exports: an 8-bit head (small-model quality at 8-bit cost; an int4 "
                   "head makes small models repeat themselves); float exports: the float table")

    def default_lm_head(self) -> str:
        """The ``lm_head`` mode when the export does not name one: ``q8`` for int4
        exports (small-model quality at 8-bit cost), ``fp`` otherwise."""
        return "q8" if self.opts.precision == "int4" else "fp"

    def default_embedding(self) -> str:
        """How an untied embedding table is stored when the export does not say: ``fp``
        (the model's float table; a family may quantize it, :meth:`build_embedding`)."""
        return "fp"

    def head_record(self) -> dict:
        """``edgeprune.json``'s ``head`` record (after ``build()``): how the head and the
        embedding table are stored, their bytes, and the policy behind the default.

        ``embedding``: ``"shared"`` (a tied table stored once: the head's quantized
        ``MatMulNBits`` table, rows gathered and dequantized by the embedding; or the one
        float table), ``"dequantized copy"`` (a tied quantized head on a plain graph: the
        embedding holds the float values of the head's codes), ``"float"`` (an untied
        float table) or the storage of an untied quantized one (``"int4 block 32 asym"``).
        """
        s, w = self.spec, self._head_int
        item = np.dtype(self.fdtype).itemsize
        table = s.vocab_size * s.hidden_size
        if w is None:
            head_bytes, storage = table * item, np.dtype(self.fdtype).name
        else:
            blob = w.block_size * w.bits // 8
            zp = 0 if default_zero_points(w) else w.N * -(-w.n_blocks * w.bits // 8)
            head_bytes = w.N * w.n_blocks * (blob + item) + zp
            storage = f"int{w.bits} block {w.block_size} {'sym' if default_zero_points(w) else 'asym'}"
        if s.tie_word_embeddings:
            shared = w is None or self._head_tensors is not None
            embedding = "shared" if shared else "dequantized copy"
            emb_bytes = 0 if shared else table * item
        elif self._emb_int is not None:
            e = self._emb_int
            embedding = f"int{e.bits} block {e.block_size} asym"
            emb_bytes = e.N * e.n_blocks * (e.block_size * e.bits // 8 + item + 1)
        else:
            embedding, emb_bytes = "float", table * item
        return {"mode": self.opts.lm_head, "storage": storage, "tied": s.tie_word_embeddings,
                "embedding": embedding, "head_bytes": int(head_bytes),
                "embedding_bytes": int(emb_bytes), "policy": self.head_policy}

    def build_embedding(self) -> str:
        """``input_ids [B,S]`` -> hidden ``[B,S,H]`` (q8 table shared with the head when tied)."""
        g, s = self.g, self.spec
        self._head_int = self._emb_int = None
        head_mode = self.opts.lm_head
        tied = s.tie_word_embeddings
        if head_mode in ("q8", "int4"):
            q = self.opts.quantized.get("lm_head")
            if q is not None:
                self._head_int = from_quantized(q, "lm_head")
            else:
                w = self.param("lm_head.weight") if not tied else \
                    self.param("model.embed_tokens.weight")
                # 8-bit: the largest block in (128, 64, 32) dividing K (fewer scale bytes
                # read per token, no measurable quality change); int4 head: block 32.
                # Both asymmetric: a symmetric q8 head matches it in PyTorch (WikiText-2
                # 40x512, only the tied table quantized: 28.719 vs 28.718, dense 28.738)
                # and its matmul is ~5% faster, but through the int8-activation kernel it
                # cost more (compact 2:4 export +0.57% vs +0.36% over PyTorch)
                bs = q8_head_block(w.shape[1]) if head_mode == "q8" else 32
                self._head_int = rtn_int(w, 8 if head_mode == "q8" else 4, bs)
        if self._head_int is not None:
            self.int_weights["lm_head" if not tied else "model.embed_tokens"] = self._head_int
        if tied and self._head_int is not None and self._head_int.perm is None and self.fused:
            # Share the quantized table: gather rows of codes, dequantize in the graph.
            w = self._head_int
            B, sc, zp = pack_matmulnbits(w)
            # The scales as one [N, n_blocks] initializer in the graph's float type, read by
            # both consumers straight from the mapped weight file: onnxruntime keeps a
            # MatMulNBits scales input resident after pre-packing it (x86: is_packed false),
            # so the float16-behind-a-Cast form (GraphBuilder.scales) became a folded float32
            # copy held in full, and the embedding's Reshape of it a second one (Gemma 3
            # int4 head: 2 x 20 MiB resident; here the mapped pages are dropped after the
            # build and the Gather reads one row per token). Same values (the float16 ones
            # widened), so the same compute; the head's scales take 32 instead of 16 bits
            # in the file.
            self._head_tensors = (g.initializer("lm_head.qweight", B),
                                  g.initializer("lm_head.scales", np.ascontiguousarray(
                                      sc.reshape(w.N, w.n_blocks), self.fdtype)),
                                  None if default_zero_points(w) else
                                  g.initializer("lm_head.qzeros", zp.reshape(w.N, -1)))
            return self._gather_quantized(w)
        mode = self.opts.embedding or self.default_embedding()
        if not tied and mode in ("q8", "int4"):
            # an untied table quantized on its own (RTN asym; rows gathered and dequantized)
            ew = rtn_int(self.param("model.embed_tokens.weight"), 8 if mode == "q8" else 4,
                         q8_head_block(s.hidden_size) if mode == "q8" else 32)
            self._emb_int = self.int_weights["model.embed_tokens"] = ew
            B, sc, _ = pack_matmulnbits(ew)
            self._head_tensors = None
            return self._gather_quantized(ew, (g.initializer("embed_tokens.qweight", B),
                                               g.scales("embed_tokens.scales", sc, self.fdtype),
                                               g.initializer("embed_tokens.qzeros", ew.zeros)),
                                          packed_zeros=False)
        if tied and self._head_int is not None:
            # the head is quantized and tied: the embedding reads the same (dequantized)
            # table, as the model the export stands for does (plain graphs, or a table with
            # an act-order permutation; it used to be the float table beside a quantized head)
            emb = np.asarray(self._head_int.dequantize(original_order=True), np.float32).astype(self.fdtype)
        else:
            emb = self.param("model.embed_tokens.weight").astype(self.fdtype)
        self._emb_name = g.initializer("model.embed_tokens.weight", emb)
        self._head_tensors = None
        return g.gather(self._emb_name, "input_ids", name="embed_tokens")

    def _gather_quantized(self, w: IntWeight, tensors=None, packed_zeros: bool = True) -> str:
        """Embedding rows ``(code - zero) * scale`` gathered from a ``MatMulNBits``-layout
        table: the tied head's (``tensors=None``: ``self._head_tensors``) or ``tensors``
        ``(codes, scales, zeros)``; ``packed_zeros=False``: zeros ``uint8 [V, n_blocks]``."""
        g, s = self.g, self.spec
        qB, qs, qz = tensors or self._head_tensors
        nb, bs = w.n_blocks, w.block_size
        rows = g.gather(qB, "input_ids", name="embed_tokens")               # [B,S,nb,blob]
        if w.bits == 4:
            lo = g.node("BitwiseAnd", [rows, g.const(15, np.uint8)], name="embed_tokens/lo")
            hi = g.node("BitShift", [rows, g.const(4, np.uint8)], name="embed_tokens/hi",
                        direction="RIGHT")
            st = g.concat([g.unsqueeze(lo, [-1]), g.unsqueeze(hi, [-1])], axis=-1)
            rows = g.reshape(st, [0, 0, nb, bs])
        codes = g.cast(rows, self.ftype)
        if g.initializer_shape(qs) == (s.vocab_size, nb):
            # gathered from the initializer itself (a Reshape of it would be folded into
            # a resident copy of the whole table of scales)
            sc = g.unsqueeze(g.gather(qs, "input_ids", name="embed_tokens/scales"), [-1])
        else:
            scales = g.reshape(qs, [s.vocab_size, nb, 1])
            sc = g.gather(scales, "input_ids", name="embed_tokens/scales")  # [B,S,nb,1]
        if qz is None:                      # symmetric grid: one zero point for all
            zz = g.const(2 ** (w.bits - 1), self.fdtype)
        elif tensors is None and g.initializer_shape(qz) == (s.vocab_size, -(-nb * w.bits // 8)):
            # the head's own zero points [V, bytes per row], gathered as stored (no folded
            # copy, no float table in the file); 4-bit ones unpacked like the codes
            zr = g.gather(qz, "input_ids", name="embed_tokens/zeros")      # [B,S,bytes]
            if w.bits == 4:
                lo = g.node("BitwiseAnd", [zr, g.const(15, np.uint8)], name="embed_tokens/zeros/lo")
                hi = g.node("BitShift", [zr, g.const(4, np.uint8)], name="embed_tokens/zeros/hi",
                            direction="RIGHT")
                zr = g.concat([g.unsqueeze(lo, [-1]), g.unsqueeze(hi, [-1])], axis=-1)
                zr = g.reshape(zr, [0, 0, -1])                             # [B,S,2*bytes]
                if nb % 2:
                    zr = g.slice(zr, [0], [nb], [2])
            zz = g.cast(g.unsqueeze(zr, [-1]), self.ftype)                  # [B,S,nb,1]
        elif w.bits == 4 and packed_zeros:  # packed 4-bit zero points: gather float copies
            zfull = np.ascontiguousarray(w.zeros.astype(self.fdtype)[..., None])
            zz = g.gather(g.initializer("embed_tokens.zeros", zfull), "input_ids")
        else:
            zz = g.cast(g.unsqueeze(g.gather(g.reshape(qz, [s.vocab_size, nb]), "input_ids"),
                                    [-1]), self.ftype)
        deq = g.mul(g.sub(codes, zz), sc, name="embed_tokens/dequant")
        deq = g.reshape(deq, [0, 0, nb * bs])
        if nb * bs != s.hidden_size:
            deq = g.slice(deq, [0], [s.hidden_size], [2])
        return deq

    def build_lm_head(self, h: str) -> str:
        """Keep the last ``num_logits_to_keep`` positions of ``h [B,S,H]``, project to the
        vocabulary: returns the logits tensor ``[B, keep, vocab]`` in the model's float
        dtype (``build`` then names it the ``logits`` output)."""
        g, s = self.g, self.spec
        start = g.node("Neg", [g.unsqueeze("num_logits_to_keep", [0])], name="logits/start")
        h = g.slice(h, start, [2 ** 62], [1], name="logits/keep")
        if self._head_int is not None:
            if self._head_tensors is not None:
                w = self._head_int
                qB, qs, qz = self._head_tensors
                ins = [h, qB, qs] + ([] if qz is None else [qz])
                logits = g.node("MatMulNBits", ins, name="lm_head", domain=MS_DOMAIN,
                                K=w.K, N=w.N, bits=w.bits, block_size=w.block_size,
                                accuracy_level=self._accuracy_level("lm_head"))
            else:
                logits = self.int_matmul(h, self._head_int, "lm_head")
            self.quant_summary["lm_head"] = f"int{self._head_int.bits} block {self._head_int.block_size}"
        elif s.tie_word_embeddings:
            flat = g.reshape(h, [-1, s.hidden_size])
            logits = g.node("Gemm", [flat, self._emb_name], name="lm_head", transB=1)
            shp = g.concat([g.shape(h, 0, 2), g.const([s.vocab_size])], axis=0)
            logits = g.reshape(logits, shp)
            self.quant_summary["lm_head"] = self.opts.precision if self.opts.precision != "int4" else "fp32"
        else:
            logits = self.float_matmul(h, self.param("lm_head.weight"), "lm_head", ["lm_head"])
        return logits


    def _output_logits(self, x: str) -> None:
        """Name ``x`` the ``logits float32 [B, num_logits_to_keep, vocab]`` output."""
        g = self.g
        if self.fdtype != np.float32:
            x = g.cast(x, TensorProto.FLOAT)
        node = next(n for n in reversed(g.nodes) if x in n.output)
        node.output[list(node.output).index(x)] = "logits"
        g.output("logits", TensorProto.FLOAT, ["batch_size", "num_logits_to_keep",
                                               self.spec.vocab_size])


__all__ = ["EmbeddingHeadMixin"]
