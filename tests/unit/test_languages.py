"""Per-language perplexity on parallel text: discovery, the parallel check, scores."""

from __future__ import annotations

import pytest

from edgeprune.errors import CalibrationError, ConfigError
from edgeprune.evaluation.languages import language_code, language_perplexity, load_languages
from tiny import CORPUS, byte_tokenizer


def _write(folder, lines_by_name, crlf=False):
    folder.mkdir(parents=True, exist_ok=True)
    for name, lines in lines_by_name.items():
        (folder / name).write_text(("\r\n" if crlf else "\n").join(lines) + "\n", encoding="utf-8")
    return folder


def test_codes_and_english_first(tmp_path):
    eng = [CORPUS[i % 5] for i in range(12)]
    d = _write(tmp_path / "set", {"news-ref.deu.txt": eng, "news-src.eng.txt": eng,
                                  "news-ref.zho-CN.txt": eng, "LANGUAGES.tsv": ["x"]}, crlf=True)
    langs = load_languages(str(d))
    assert [lt.code for lt in langs] == ["eng", "deu", "zho-CN"]          # .tsv ignored, English first
    assert [lt.name for lt in langs] == ["English", "German", "Chinese"]
    assert langs[0].lines == eng                                        # CRLF read as LF, no trailing ""
    assert language_code(d / "a.b.fra.txt") == "fra"
    files = ",".join(str(d / n) for n in ("news-ref.deu.txt", "news-src.eng.txt"))
    assert [lt.code for lt in load_languages(files)] == ["eng", "deu"]
    assert [lt.code for lt in load_languages(str(d), only=["deu"])] == ["deu"]
    with pytest.raises(ConfigError, match="no language file for xx"):
        load_languages(str(d), only=["xx"])


def test_a_file_whose_line_count_differs_is_refused(tmp_path):
    eng = [CORPUS[i % 5] for i in range(12)]
    d = _write(tmp_path / "set", {"s-src.eng.txt": eng, "s-ref.deu.txt": eng[:-1]})
    with pytest.raises(CalibrationError, match=r"s-ref\.deu\.txt has 11 lines but s-src\.eng\.txt \(English\) "
                                               r"has 12: the files are not parallel"):
        load_languages(str(d))
    with pytest.raises(CalibrationError, match="does not exist"):
        load_languages(str(tmp_path / "nope.txt"))
    with pytest.raises(CalibrationError, match="holds no .txt"):
        load_languages(str(_write(tmp_path / "empty", {})))


def test_language_perplexity_and_change(tiny_llama, tmp_path):
    import copy

    import torch

    eng = [CORPUS[i % 5] for i in range(40)]
    d = _write(tmp_path / "set", {"s-src.eng.txt": eng, "s-ref.deu.txt": [s.upper() for s in eng]})
    langs = load_languages(str(d))
    tok = byte_tokenizer()
    dense = language_perplexity(tiny_llama, tok, langs, lines=30, seqlen=64, progress=False)
    assert list(dense) == ["eng", "deu"] and all(r.ppl > 1 for r in dense.values())
    assert dense["eng"].protocol["text_source"].endswith("(first 30 lines)")
    other = copy.deepcopy(tiny_llama)
    with torch.no_grad():
        other.lm_head.weight.mul_(1.5)
    base = {k: v.ppl for k, v in dense.items()}
    r = language_perplexity(other, tok, langs, lines=30, seqlen=64, dense=base, progress=False)
    for k in r:
        assert r[k].rel_change == pytest.approx((r[k].ppl - base[k]) / base[k])
    same = language_perplexity(tiny_llama, tok, langs, lines=30, seqlen=64, dense=base, progress=False)
    assert all(v.rel_change == pytest.approx(0.0, abs=1e-6) for v in same.values())
    with pytest.raises(CalibrationError, match="English"):
        language_perplexity(tiny_llama, tok, langs, lines=1, seqlen=500, progress=False)
