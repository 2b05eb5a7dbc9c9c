"""A tiny model, task folder and parallel text for the study tests (unit and integration)."""

from __future__ import annotations

import json
from pathlib import Path

from tiny import CORPUS, save_bpe_tokenizer, tiny_model


def tiny_model_folder(folder: Path) -> Path:
    """A 2-layer llama (hidden 64, MLP 160) with the tiny BPE tokenizer, saved as an HF folder."""
    from transformers import LlamaConfig

    tok = save_bpe_tokenizer(folder)
    tiny_model(LlamaConfig, vocab_size=len(tok), bos_token_id=0, eos_token_id=2).save_pretrained(str(folder))
    return folder


def tiny_task_data(root: Path, n: int = 6) -> Path:
    """A PIQA folder in the release layout (valid.jsonl + valid-labels.lst), ``n`` items."""
    (root / "piqa").mkdir(parents=True)
    docs = [dict(goal=f"How do I {w}?", sol1=f"You {w} with care.", sol2=f"You never {w}.")
            for w in ("run", "sleep", "cook", "read", "write", "swim", "walk", "sing")[:n]]
    (root / "piqa/valid.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (root / "piqa/valid-labels.lst").write_text("".join(f"{i % 2}\n" for i in range(n)))
    return root


def tiny_langs(root: Path, lines: int = 30) -> Path:
    root.mkdir(parents=True)
    eng = [CORPUS[i % 5] for i in range(lines)]
    (root / "set-src.eng.txt").write_text("\r\n".join(eng) + "\r\n", encoding="utf-8")
    (root / "set-ref.deu.txt").write_text("\n".join(s.upper() for s in eng) + "\n", encoding="utf-8")
    return root



def study_inputs_in(base: Path) -> dict:
    """The tiny model folder, task folder and language folder under ``base``."""
    return dict(model=str(tiny_model_folder(base / "model")), task_data=str(tiny_task_data(base / "tasks")),
                langs=str(tiny_langs(base / "langs")))


def study_config(inp, cells, cache, **kw):
    """A small study of the tiny model: 4 x 32 calibration, 2 windows of 32, 2 continuations,
    PIQA (4 items), two languages."""
    from edgeprune.study import StudyConfig, parse_cells

    base = dict(models=[inp["model"]], cells=parse_cells(cells), nsamples=4, seqlen=32, text=" ".join(CORPUS),
                eval_seqlen=32, nwindows=2, continuations=2, prompt_len=8, new_tokens=4, tasks=["piqa"],
                task_data=inp["task_data"], limit=4, langs=inp["langs"], lang_lines=30, threads=1, cache=str(cache))
    base.update(kw)
    return StudyConfig(**base)


def study_numbers(table) -> list[dict]:
    """The figures of each row that two runs of one grid must share."""
    keep = ("cell", "status", "ppl", "kl", "top1", "snr_db", "cont_change", "acc:piqa", "ppl:eng", "ppl:deu",
            "change:deu")
    return [{k: r[k] for k in keep} for r in table.rows()]
