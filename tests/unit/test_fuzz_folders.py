"""Seeded fuzz over damaged export and checkpoint folders (issue 27): every damaged variant
either still loads and runs, or gives one ``EdgePruneError`` naming the damaged file;
never an internal error (any other exception), never a hang.

A case copies a tiny folder, damages one file (JSON fields set to wrong types or values,
keys dropped, the file truncated, bytes flipped, garbage or an empty file in its place)
and loads it: ``runtime.load`` + two generated tokens for exports,
``edgeprune.checkpoint.load_checkpoint`` for checkpoints. The mutations are drawn from
``random.Random(seed)``, so a failure names a case that reproduces.
"""

from __future__ import annotations

import faulthandler
import json
import random
import shutil
import time
from pathlib import Path

import pytest

from edgeprune_runtime.errors import EdgePruneError

#: cases per folder kind (the whole test stays well under a minute on a loaded machine)
EXPORT_CASES = 300
CHECKPOINT_CASES = 200
#: a single case taking longer than this is a hang
CASE_LIMIT_S = 20.0
#: values a JSON field is set to: wrong types, out-of-range numbers, huge sizes
BAD_VALUES = [None, "x", "", -1, 0, 1, 3, 7, 10 ** 12, -(10 ** 12), 1.5, float("nan"), True,
              False, [], [1, 2], {}, {"a": 1}, "1e9", 2 ** 63]


def _mutate_json(rng: random.Random, data):
    """``data`` (a JSON value) with one field at a random depth set to a bad value, or
    dropped; a value of the wrong shape where the file holds a scalar."""
    if isinstance(data, dict) and data:
        key = rng.choice(sorted(data))
        if rng.random() < 0.3 and isinstance(data[key], (dict, list)) and data[key]:
            data[key] = _mutate_json(rng, data[key])
        elif rng.random() < 0.25:
            del data[key]
        else:
            data[key] = rng.choice(BAD_VALUES)
        return data
    if isinstance(data, list) and data:
        i = rng.randrange(len(data))
        data[i] = _mutate_json(rng, data[i]) if rng.random() < 0.5 else rng.choice(BAD_VALUES)
        return data
    return rng.choice(BAD_VALUES)


def _damage(rng: random.Random, path: Path) -> str:
    """Damage ``path`` in place; returns what was done (for the failure message)."""
    raw = path.read_bytes()
    kind = rng.choice(["json", "json", "json", "truncate", "flip", "garbage", "empty"]
                      if path.suffix == ".json" else ["truncate", "truncate", "flip", "flip",
                                                       "zeros", "garbage", "empty"])
    if kind == "json":
        try:
            data = json.loads(raw)
        except ValueError:
            kind = "truncate"
        else:
            data = _mutate_json(rng, data)
            path.write_text(json.dumps(data, allow_nan=True))
            return f"json field changed: {json.dumps(data)[:300]}"
    if kind == "truncate":
        n = rng.randrange(len(raw)) if raw else 0
        path.write_bytes(raw[:n])
        return f"truncated to {n} of {len(raw)} bytes"
    if kind in ("flip", "zeros"):
        b = bytearray(raw)
        spots = [rng.randrange(len(b)) for _ in range(rng.randint(1, 8))] if b else []
        for i in spots:
            b[i] = 0 if kind == "zeros" else b[i] ^ (1 << rng.randrange(8))
        path.write_bytes(bytes(b))
        return f"{kind} at {spots}"
    if kind == "garbage":
        path.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randint(1, 200))))
        return "replaced by random bytes"
    path.write_bytes(b"")
    return "emptied"


def _run_cases(base: Path, files: list[str], n: int, seed: int, load, tmp_path: Path) -> dict:
    """``n`` damaged copies of ``base`` (one of ``files`` each), each loaded with ``load``.

    Returns:
        ``{"ok": k, "refused": k, "seconds": s, "slowest": s}``; fails the test on an
        internal error, an error that does not name the damaged file, or a hang.
    """
    rng = random.Random(seed)
    counts = {"ok": 0, "refused": 0}
    slowest = 0.0
    t0 = time.perf_counter()
    for i in range(n):
        case = tmp_path / f"case{i}"
        shutil.copytree(base, case)
        name = rng.choice(files)
        what = _damage(rng, case / name)
        faulthandler.dump_traceback_later(CASE_LIMIT_S * 3, exit=True)   # a hang ends the run
        tc = time.perf_counter()
        try:
            load(case)
            counts["ok"] += 1
        except EdgePruneError as e:
            assert name in str(e), f"case {i} ({name}: {what}): the error does not name {name}: {e}"
            counts["refused"] += 1
        except Exception as e:  # noqa: BLE001 - what the test is for
            pytest.fail(f"case {i} ({name}: {what}): internal error {type(e).__name__}: {e}")
        finally:
            faulthandler.cancel_dump_traceback_later()
        took = time.perf_counter() - tc
        slowest = max(slowest, took)
        assert took < CASE_LIMIT_S, f"case {i} ({name}: {what}) took {took:.1f} s"
        shutil.rmtree(case)
    return dict(counts, seconds=round(time.perf_counter() - t0, 1), slowest=round(slowest, 2))


def tiny_export(out: Path) -> Path:
    """A 2-layer random llama with the tiny BPE tokenizer, exported int4 with its weights
    in ``model.onnx.data`` (as real exports are)."""
    import torch
    from transformers import LlamaConfig

    import edgeprune_exporters as exporters
    from tiny import save_bpe_tokenizer, tiny_model

    tok = save_bpe_tokenizer(out.parent / "tok")
    torch.manual_seed(0)
    model = tiny_model(LlamaConfig, vocab_size=len(tok), bos_token_id=0, eos_token_id=2,
                       max_position_embeddings=64)
    exporters.export_onnx(model, tok, out, precision="int4", group_size=32, max_length=64,
                          external_data=True, validate=False)
    return out


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    return tiny_export(tmp_path_factory.mktemp("fuzz") / "export")


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> Path:
    import torch
    from transformers import LlamaConfig

    from edgeprune.checkpoint import save_checkpoint
    from edgeprune.engine import compress
    from edgeprune.methods.rtn import RTNConfig
    from tiny import byte_tokenizer, tiny_model

    model = tiny_model(LlamaConfig)
    ids = torch.randint(0, 255, (2, 16), generator=torch.Generator().manual_seed(0))
    res = compress(model, RTNConfig(bits=4, group_size=32), ids, progress=False)
    out = tmp_path_factory.mktemp("fuzz") / "ck"
    save_checkpoint(model, byte_tokenizer(), res, out)
    return out


def _load_export(folder: Path) -> None:
    import edgeprune_runtime as runtime

    with runtime.load(folder, threads=1) as sess:
        sess.generate("Hello", max_new_tokens=2)


def _load_checkpoint(folder: Path) -> None:
    from edgeprune.checkpoint import load_checkpoint

    load_checkpoint(folder)


def test_fuzz_export_folders(export_dir, tmp_path, record_property):
    files = ["edgeprune.json", "edgeprune.json", "genai_config.json", "tokenizer.json",
             "tokenizer.json", "tokenizer_config.json", "model.onnx", "model.onnx",
             "model.onnx.data"]
    got = _run_cases(export_dir, files, EXPORT_CASES, 27, _load_export, tmp_path)
    record_property("export_fuzz", got)
    print(f"export folders: {EXPORT_CASES} damaged cases: {got}")
    assert got["ok"] + got["refused"] == EXPORT_CASES and got["refused"] > EXPORT_CASES // 3


def test_fuzz_checkpoint_folders(checkpoint_dir, tmp_path, record_property):
    files = ["config.json", "config.json", "edgeprune_checkpoint.json", "model.safetensors",
             "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    got = _run_cases(checkpoint_dir, files, CHECKPOINT_CASES, 27, _load_checkpoint, tmp_path)
    record_property("checkpoint_fuzz", got)
    print(f"checkpoint folders: {CHECKPOINT_CASES} damaged cases: {got}")
    assert got["ok"] + got["refused"] == CHECKPOINT_CASES and got["refused"] > CHECKPOINT_CASES // 3
