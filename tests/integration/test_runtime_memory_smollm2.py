"""Runtime memory on the real SmolLM2-135M int4 export (issue 5).

* Decode steps allocate nothing proportional to context length: the peak RSS of a
  1,024-token generation exceeds a 128-token one by no more than the KV cache the extra
  896 tokens occupy (+10%).
* 10,000 tokens in one run (sliding-window context policy, KV cache of 1,280 tokens):
  no RSS growth after warm-up.

Each measurement runs in a fresh process (``_rss_worker.py``), importing only the runtime.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

WORKER = Path(__file__).with_name("_rss_worker.py")
ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def _run(folder, mode: str, n: int) -> dict:
    r = subprocess.run([sys.executable, str(WORKER), str(folder), mode, str(n)], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_peak_rss_grows_only_by_the_kv_cache(smollm2_int4):
    short, long = _run(smollm2_int4, "peak", 128), _run(smollm2_int4, "peak", 1024)
    kv_delta = long["kv_bytes"] - short["kv_bytes"]          # fp32 K+V of 896 tokens
    assert kv_delta == 896 * 2 * 30 * 3 * 64 * 4
    growth = long["vm_hwm"] - short["vm_hwm"]
    print(f"peak RSS 128 new: {short['vm_hwm'] / MiB:.1f} MiB, 1024 new: {long['vm_hwm'] / MiB:.1f} "
          f"MiB, growth {growth / MiB:.1f} MiB vs KV {kv_delta / MiB:.1f} MiB")
    assert growth <= 1.10 * kv_delta, (growth / MiB, kv_delta / MiB)


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").is_dir(),
                    reason="needs transparent huge pages (Linux)")
def test_prepacked_weights_sit_in_huge_pages(smollm2_int4):
    """The load collapses the ~90 MiB of pre-packed weights into 2 MiB pages (runtime.
    hugepages): at least 64 MiB of anonymous huge pages after a generation, and the peak
    RSS stays that of the same run with 4 KiB pages only (within 4 MiB)."""
    r, small = _run(smollm2_int4, "peak", 8), _run(smollm2_int4, "peak4k", 8)
    print(f"collapsed {r['huge_page_bytes'] / MiB:.0f} MiB; AnonHugePages {r['anon_huge'] / MiB:.0f} "
          f"MiB; peak RSS {r['vm_hwm'] / MiB:.1f} MiB vs {small['vm_hwm'] / MiB:.1f} MiB with 4 KiB pages")
    assert small["huge_page_bytes"] == 0 and small["anon_huge"] < 8 * MiB
    if r["huge_page_bytes"] == 0:
        pytest.skip("this kernel has no MADV_COLLAPSE (Linux 6.1+)")
    assert r["anon_huge"] >= 64 * MiB
    assert abs(r["vm_hwm"] - small["vm_hwm"]) <= 4 * MiB


def test_embedding_rows_cost_pages_not_folios(smollm2_int4):
    """The q8 table shared by the embedding and the head is read a row per token through
    the memory map: 128 prompt tokens spread over the whole vocabulary (one every 221 KB
    of the 28 MiB table) leave the kernel's 64 KiB fault-around window per row resident,
    9.4 MiB with the scales, not a 2 MiB page-cache folio per row: with the file in large
    folios (before the runtime re-read it with readahead off) 18.5 MiB were resident."""
    r = _run(smollm2_int4, "embed", 4)
    print(f"weight-file pages resident after 132 spread tokens: {r['weights_rss'] / MiB:.1f} MiB")
    assert r["weights_rss"] <= 14 * MiB


def test_ten_thousand_tokens_without_rss_growth(smollm2_int4):
    r = _run(smollm2_int4, "long", 10_000)
    assert r["tokens"] == 10_000
    s = r["samples"]
    T = r["seconds"]
    # warm-up: the first 30% of the run. The cache fills at 1,152 new tokens and each
    # re-prefill keeps 640, so re-prefills come at 11.5 %, 17.9 %, 24.3 % ... of the
    # tokens; onnxruntime's arena grows at the first two (measured 2026-12-05: +50 MiB at
    # ~10 % of the run, +22.5 MiB at ~20 %, then +0.4 MiB over the rest). A 20 % window
    # put the second step on its edge.
    WARM = 0.3
    warm = [row[1] for row in s if row[0] <= WARM * T]
    after = [row[1] for row in s if row[0] > WARM * T]
    assert len(after) > 50
    base = max(warm)
    # the resident set split: anonymous (heap, KV cache, onnxruntime's arenas) and
    # file-backed (the mapped weights), each as warm-up max -> max of the last quarter
    split = {name: (max(row[i] for row in s if row[0] <= WARM * T),
                    max(row[i] for row in s if row[0] > 0.75 * T)) for name, i in (("anon", 2), ("file", 3))}
    print(f"10,000 tokens in {T:.0f} s; RSS after warm-up {base / MiB:.1f} MiB, "
          f"max later {max(after) / MiB:.1f} MiB, last {after[-1] / MiB:.1f} MiB; "
          + ", ".join(f"{k} {a / MiB:.1f} -> {b / MiB:.1f} MiB" for k, (a, b) in split.items()))
    # bounded growth: the last quarter's maximum stays within 12 MiB of the warm-up
    # maximum. 2026-12-04 (AVX2 host, 20 % warm-up window): +5.6 and +6.4 MiB, the last
    # samples at the maximum. 2026-12-05 (AVX-512 host, this export, quiet): +0.4 MiB after
    # the arena's two steps, all of it anonymous (the result's token and step-time lists,
    # ~80 B a token), the file-backed part flat. Whether the AVX2 host's growth was a third
    # arena step is not established. The bound still catches a leak of 2 KiB a token or
    # more (~15 MiB by the last quarter)
    last = [row[1] for row in s if row[0] > 0.75 * T]
    assert max(last) - base <= 12 * MiB
    assert max(after) - base <= 12 * MiB
