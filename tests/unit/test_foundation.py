"""Models, calibration and evaluation: the protocol, the errors, the embedded text."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tiny import CharTokenizer

from edgeprune.calibration import (MAX_SEQLEN, build_calibration, default_documents, load_documents,
                                   token_stream)
from edgeprune.errors import (CalibrationError, ConfigError, ModelLoadError,
                              UnsupportedArchitectureError)
from edgeprune.evaluate import eval_windows, fidelity, perplexity


def test_default_text_parts_are_disjoint_and_real():
    cal, held = default_documents("calibration"), default_documents("heldout")
    assert len(cal) > 40 and len(held) > 20
    assert not set(cal) & set(held)
    assert sum(map(len, held)) > 100_000  # enough for 40 x 512 token windows


def test_calibration_is_seeded_and_reproducible():
    tok = CharTokenizer()
    a = build_calibration(tok, nsamples=16, seqlen=64, seed=1)
    b = build_calibration(tok, nsamples=16, seqlen=64, seed=1)
    c = build_calibration(tok, nsamples=16, seqlen=64, seed=2)
    assert a.input_ids.shape == (16, 64) and a.input_ids.dtype == torch.long
    assert torch.equal(a.input_ids, b.input_ids)
    assert not torch.equal(a.input_ids, c.input_ids)
    assert a.info["source"].startswith("default:")


def test_long_documents_are_windowed_not_dropped(tmp_path):
    tok = CharTokenizer()
    p = tmp_path / "one_long_doc.txt"
    p.write_text("x" * 1000)  # one document of 1000 tokens: 15 windows of 64
    cal = build_calibration(tok, p, nsamples=15, seqlen=64)
    assert cal.input_ids.shape == (15, 64)


def test_too_little_text_says_found_and_needed(tmp_path):
    p = tmp_path / "short.txt"
    p.write_text("y" * 100)
    with pytest.raises(CalibrationError) as e:
        build_calibration(CharTokenizer(), p, nsamples=4, seqlen=64)
    assert "100 tokens" in str(e.value) and "256" in str(e.value)


def test_jsonl_and_bad_jsonl(tmp_path):
    good = tmp_path / "d.jsonl"
    good.write_text("\n".join(json.dumps({"text": "abc" * 50}) for _ in range(4)))
    docs, _ = load_documents(good)
    assert len(docs) == 4 and docs[0] == "abc" * 50
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(CalibrationError, match="text"):
        load_documents(bad)


def test_document_files_edge_cases(tmp_path):
    """JSONL records end at "\\n" only (U+2028 / U+2029 / U+0085 are legal raw in JSON
    strings and split the file before); a byte-order mark is not text; a non-string
    'text' is named; null or empty documents are skipped in JSONL as in Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from edgeprune.evaluate import resolve_text
    seps = tmp_path / "seps.jsonl"
    docs = [f"one{c}two" for c in ("\u2028", "\u2029", "\u0085")]
    seps.write_text("\n".join(json.dumps({"text": d}, ensure_ascii=False) for d in docs), encoding="utf-8")
    assert load_documents(seps)[0] == docs
    bom = tmp_path / "bom.txt"
    bom.write_bytes("\ufeffhello".encode("utf-8"))
    assert load_documents(bom)[0] == ["hello"]
    (tmp_path / "bom.jsonl").write_bytes(("\ufeff" + json.dumps({"text": "hi"})).encode("utf-8"))
    assert load_documents(tmp_path / "bom.jsonl")[0] == ["hi"]
    for bad, kind in (({"text": 123}, "int"), ({"text": ["a"]}, "list")):
        (tmp_path / "n.jsonl").write_text(json.dumps(bad))
        with pytest.raises(CalibrationError, match=f"n.jsonl:1: 'text' is a {kind}, not a string"):
            load_documents(tmp_path / "n.jsonl")
    rows = ["first document", None, "", "second document"]
    (tmp_path / "e.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in rows))
    pq.write_table(pa.table({"text": rows}), tmp_path / "e.parquet")
    assert resolve_text(tmp_path / "e.jsonl")[0] == resolve_text(tmp_path / "e.parquet")[0] \
        == "first document\n\nsecond document"
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "i.parquet")
    with pytest.raises(CalibrationError, match="column 'text' of .*i.parquet holds int64, not strings"):
        load_documents(tmp_path / "i.parquet")


def test_non_finite_scores(tiny_llama):
    """Perplexity past float range is inf, not an OverflowError that loses the other
    figures; NaN logits are an EvaluationError; a token both models rule out adds 0 to
    the KL (it made it NaN)."""
    from edgeprune.errors import EvaluationError
    tok = CharTokenizer()
    text = "abcdefgh " * 100

    def scaled(ids):
        return tiny_llama(ids).logits * 5000

    assert perplexity(scaled, tok, text, seqlen=32, nwindows=2, progress=False).ppl == math.inf
    r = fidelity(tiny_llama, scaled, tok, text, seqlen=32, nwindows=2, progress=False)
    assert r.ppl == math.inf and math.isfinite(r.kl) and r.top1_agree == 1.0   # same argmax
    with pytest.raises(EvaluationError, match="logits hold NaN"):
        perplexity(lambda ids: tiny_llama(ids).logits * math.nan, tok, text, seqlen=32, nwindows=1,
                   progress=False)

    def masked(ids):                 # ids >= 240 never occur in this text
        lo = tiny_llama(ids).logits.clone()
        lo[..., 240:] = -math.inf
        return lo
    r = fidelity(masked, lambda ids: masked(ids) * 1.5, tok, text, seqlen=32, nwindows=2, progress=False)
    assert math.isfinite(r.kl) and r.kl > 0
    assert fidelity(masked, masked, tok, text, seqlen=32, nwindows=2, progress=False).kl == 0.0


def test_seqlen_capped_independently_of_model_context():
    with pytest.raises(ConfigError, match=str(MAX_SEQLEN)):
        build_calibration(CharTokenizer(), nsamples=1, seqlen=131072, model_max_length=131072)


def test_token_stream_stops_early():
    ids = token_stream(CharTokenizer(), ["a" * 100] * 1000, max_tokens=250)
    assert 250 <= len(ids) < 400


def test_perplexity_protocol_matches_manual_computation(tiny_llama):
    tok = CharTokenizer()
    text = "hello world, " * 200
    res = perplexity(tiny_llama, tok, text, seqlen=32, nwindows=3, progress=False)
    ids = torch.tensor(list(text.encode())[: 3 * 32]).view(3, 32)
    with torch.no_grad():
        logits = tiny_llama(ids).logits
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))
    assert res.ppl == pytest.approx(math.exp(nll.item()), rel=1e-5)
    assert res.protocol.nwindows == 3 and res.protocol.ntokens_scored == 3 * 31
    assert res.protocol.seqlen == 32 and not res.protocol.bos


def test_evaluation_builds_no_autograd_graph(tiny_llama):
    """perplexity/fidelity run under no_grad: a graph over every window's logits would
    cost the memory of a training step on a real model."""
    seen = []

    def fn(ids):
        seen.append(torch.is_grad_enabled())
        return tiny_llama(ids).logits

    text = "hello world, " * 200
    perplexity(fn, CharTokenizer(), text, seqlen=32, nwindows=2, progress=False)
    fidelity(fn, fn, CharTokenizer(), text, seqlen=32, nwindows=2, progress=False)
    assert len(seen) == 6 and not any(seen)


def test_fidelity_of_model_to_itself_is_perfect(tiny_llama):
    tok = CharTokenizer()
    r = fidelity(tiny_llama, tiny_llama, tok, "abcdefgh " * 100, seqlen=32, nwindows=2, progress=False)
    assert r.kl == pytest.approx(0.0, abs=1e-6) and r.top1_agree == 1.0 and r.ppl == pytest.approx(r.ppl_dense)


def test_fidelity_detects_a_change(tiny_llama):
    import copy

    tok = CharTokenizer()
    other = copy.deepcopy(tiny_llama)
    with torch.no_grad():
        other.lm_head.weight.add_(torch.randn_like(other.lm_head.weight) * 0.2)
    r = fidelity(tiny_llama, other, tok, "abcdefgh " * 100, seqlen=32, nwindows=2, progress=False)
    assert r.kl > 1e-3 and r.top1_agree < 1.0


def test_eval_text_too_short():
    with pytest.raises(CalibrationError, match="windows"):
        eval_windows(CharTokenizer(), "tiny text", seqlen=512, nwindows=40)


def test_model_errors(tmp_path):
    from edgeprune.models import load_model

    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "missing.gguf")
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_model(corrupt)
    with pytest.raises(ModelLoadError, match="not found"):
        load_model("no-such-alias")
    folder = tmp_path / "gpt2ish"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UnsupportedArchitectureError, match="llama, qwen2"):
        load_model(folder)


def test_hf_folder_roundtrip(tmp_path, tiny_qwen2):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    from edgeprune.models import load_model

    t = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=t).save_pretrained(tmp_path / "m")
    tiny_qwen2.save_pretrained(tmp_path / "m")
    model, tok = load_model(tmp_path / "m")
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, tiny_qwen2(ids).logits, atol=1e-6)


class _SelfTok:
    """Just the special ids self-calibration needs."""
    bos_token_id, eos_token_id = 1, 2


def test_self_generated_calibration(tiny_llama):
    tok = _SelfTok()
    a = build_calibration(tok, "self", nsamples=5, seqlen=24, seed=3, model=tiny_llama)
    b = build_calibration(tok, "self", nsamples=5, seqlen=24, seed=3, model=tiny_llama)
    c = build_calibration(tok, "self", nsamples=5, seqlen=24, seed=4, model=tiny_llama)
    assert a.input_ids.shape == (5, 24) and a.input_ids.dtype == torch.long
    assert torch.equal(a.input_ids, b.input_ids)          # seeded
    assert not torch.equal(a.input_ids, c.input_ids)
    assert (a.input_ids[:, 0] == 1).all()                  # starts at BOS
    assert not (a.input_ids[:, 1:] == 2).any()             # EOS suppressed: full windows
    assert len(set(a.input_ids[:, 1:].flatten().tolist())) > 20   # sampled, not greedy
    assert a.info["source"] == "self:T=1" and a.info["nsamples"] == 5
    # the documented shortcut takes "self" too (it had no way to pass the model)
    from edgeprune.calibration import get_calibration
    assert torch.equal(get_calibration(tok, "self", nsamples=5, seqlen=24, seed=3, model=tiny_llama),
                       a.input_ids)
    # the caller's RNG is untouched
    torch.manual_seed(0)
    x = torch.rand(3)
    torch.manual_seed(0)
    build_calibration(tok, "self", nsamples=2, seqlen=8, model=tiny_llama)
    assert torch.equal(torch.rand(3), x)


def test_self_calibration_needs_the_model():
    with pytest.raises(CalibrationError, match="pass model="):
        build_calibration(_SelfTok(), "self", nsamples=2, seqlen=8)
