"""Compressed checkpoints: save and load a compressed model as a folder transformers reads.

Two on-disk formats (:func:`save_checkpoint`, ``format=``):

``"compressed-tensors"`` (default)
    The ``compressed-tensors`` library's ``pack-quantized`` format, the one llm-compressor
    writes and transformers / vLLM load. For every quantized linear layer ``<name>``,
    ``model.safetensors`` holds, instead of ``<name>.weight``:

    * ``weight_packed``  ``int32 [out, ceil(in*bits/32)]``: the codes, packed densely
      along the input dimension, element ``i`` at bits ``[i*bits, (i+1)*bits)`` of the
      row's little-endian bit stream (values may straddle two words for 3-bit);
    * ``weight_scale``   ``float32 [out, n_groups]``;
    * ``weight_zero_point`` ``int32 [out, n_groups]`` (asymmetric only): packed the same
      way along the *output* dimension into the first ``ceil(out*bits/32)`` rows, the
      rest zero. The padding gives the tensor the shape transformers 5.24 +
      compressed-tensors 0.20 allocate for it (llm-compressor#1618), and their
      unpacking reads only the leading rows, so plain transformers loads it;
      ``asym_layout="pack-quantized-compact"`` writes the unpadded
      ``[ceil(out*bits/32), n_groups]`` of llm-compressor (``"naive-quantized"``: one
      int8 per code);
    * ``weight_shape``   ``int64 [2]`` = ``(out, in)``;
    * ``weight_g_idx``   ``int32 [in]`` only for GPTQ ``act_order`` with dynamic groups
      (``actorder: "group"``; compressed-tensors >= 0.15 refuses such checkpoints with a
      clear error, :func:`load_checkpoint` reads them).

    compressed-tensors stores *signed* codes ``q = code - 2**(bits-1)`` and packs
    ``q + 2**(bits-1)``: the packed nibble is exactly our unsigned code, and its
    dequantization ``(q - zp) * scale`` equals ours ``(code - zero) * scale`` bit for bit
    (both differences are exact small integers in float32). Nothing is re-rounded.
    ``config.json`` gets a ``quantization_config`` (``quant_method: "compressed-tensors"``)
    with one config group per distinct ``(bits, group_size, sym, act_order)`` whose
    ``targets`` are the exact module names, so mixed precision is expressed directly.
    Sparsity (2:4 or unstructured, from pruning) is recorded in ``sparsity_config`` with
    ``format: "dense"`` (compressed-tensors >= 0.15 dropped its ``sparse-24-bitmask``
    compressor; the zeros are stored as they are and the structure is marked).

``"dense"``
    A plain transformers folder with dense float weights (the dequantized values), plus a
    sidecar ``edgeprune_qparams.safetensors`` (scales, zero points, ``g_idx``) from which
    :func:`load_checkpoint` re-derives the integer codes exactly and checks them.

In the compressed-tensors format the embedding (and an unquantized untied head) is stored
in 16 bits whenever that keeps every value; :func:`round_embeddings` (what ``edgeprune
compress`` does by default, ``--embedding-dtype``) puts a float32 model's embedding on a
16-bit grid first, so a 4-bit SmolLM2-135M checkpoint is ~0.24x its float32 size.

Both formats also get:

* an ``edgeprune`` section in ``config.json`` and a separate ``edgeprune_checkpoint.json``
  (method, recipe, calibration source/size, seed, tied-embedding policy, per-layer bits,
  group size, sparsity pattern, average bits per weight, run id);
* ``edgeprune_masks.safetensors`` only for pruned layers whose mask is *not* simply
  ``weight != 0`` (a kept weight that is exactly zero), as packed bits.

Tied embeddings policy (recorded as ``tied_embeddings``): ``"tied"`` when the source ties
``lm_head`` to ``embed_tokens`` and ``lm_head`` is not quantized (the default: only the
embedding tensor is stored, as transformers does); ``"untied-quantized-head"`` when the
recipe quantized ``lm_head`` (the embedding stays dense, the head is stored packed,
``tie_word_embeddings`` becomes false); ``"untied"`` when the source was untied. The
embedding tensor is always present after save and reload.

Writes are atomic: everything goes to a temporary folder next to ``out_dir``, which is
renamed into place only when complete; on any failure nothing is left behind and an
existing ``out_dir`` is untouched.

The package: :mod:`.pack` (compressed-tensors bit packing), :mod:`.embeddings` (16-bit
embeddings), :mod:`.format` (file names,
:class:`CheckpointInfo`), :mod:`.folder` (the output guard and claim on a checkpoint
folder), :mod:`.save` and :mod:`.load`.
"""

from .folder import CHECKPOINT_OUTPUT, check_out_dir, claim_out_dir
from .format import (CHECKPOINT_FILES, CHECKPOINT_JSON, FORMATS, MASKS_FILE, QPARAMS_FILE,
                     SCHEMA_VERSION, WEIGHTS_FILE, CheckpointInfo, is_edgeprune_checkpoint)
from .embeddings import EMBEDDING_DTYPES, round_embeddings, storage_dtype
from .load import load_checkpoint
from .pack import pack_int32, unpack_int32
from .save import ASYM_LAYOUTS, save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "is_edgeprune_checkpoint", "CheckpointInfo",
           "pack_int32", "unpack_int32", "FORMATS", "check_out_dir", "claim_out_dir",
           "CHECKPOINT_OUTPUT", "CHECKPOINT_JSON", "CHECKPOINT_FILES", "QPARAMS_FILE",
           "MASKS_FILE", "WEIGHTS_FILE", "SCHEMA_VERSION", "ASYM_LAYOUTS", "EMBEDDING_DTYPES",
           "round_embeddings", "storage_dtype"]
