"""Subprocess for the runtime memory tests: one generation in a fresh process, RSS out.

Usage: ``python _rss_worker.py FOLDER MODE N`` with MODE

* ``peak``: greedy generation of ``N`` new tokens (EOS ignored) after a 128-token
  prompt; prints JSON ``{"vm_hwm", "kv_bytes", "huge_page_bytes", "anon_huge"}`` (peak
  resident set of this process from ``/proc/self/status`` ``VmHWM``, bytes; KV bytes held
  at the final length; bytes the load collapsed into huge pages; ``AnonHugePages`` of
  ``/proc/self/smaps_rollup`` at the end).
* ``peak4k``: the same with ``huge_pages=False`` (4 KiB pages only).
* ``embed``: a prompt of 128 token ids spread evenly over the vocabulary, ``N`` new
  tokens; prints JSON ``{"weights_rss"}``: bytes of the weight file's mappings still
  resident (the embedding rows read through the memory map).
* ``long``: ``N`` new tokens in one run with the sliding-window context policy, RSS
  sampled every 20 ms by a thread into a buffer allocated before the run (so the
  sampling itself adds no RSS); prints JSON ``{"samples": [[t_s, rss_bytes, anon_bytes,
  file_bytes], ...], "seconds", "tokens", "weights_bytes"}``: the whole resident set, its
  anonymous part (heap, KV cache, onnxruntime's arenas) and its file-backed part (the
  mapped weight file's pages: each new token's embedding row read through the map
  brings its page, and the fault-around window beside it, in), from ``/proc/self/status``.

Fresh process per measurement: ``VmHWM`` is per process, so nothing earlier leaks in.
Imports only the runtime (torch-free), as an app would.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import numpy as np

#: samples the ``long`` mode's buffer holds (~44 min at one per 20 ms; then halved)
SAMPLE_CAP = 1 << 17


def _hwm() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _status_rss() -> tuple[int, int, int]:
    """``(VmRSS, RssAnon, RssFile)`` of this process, bytes."""
    got = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "RssAnon:", "RssFile:")):
                got[line.split(":")[0]] = int(line.split()[1]) * 1024
    return got["VmRSS"], got.get("RssAnon", -1), got.get("RssFile", -1)


def main() -> None:
    folder, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])

    import edgeprune_runtime as runtime

    policy = "sliding_window" if mode == "long" else "error"
    huge = mode != "peak4k"
    mode = "peak" if mode == "peak4k" else mode
    sess = runtime.load(folder, threads=2, context_policy=policy, huge_pages=huge)
    sess.eos_token_ids = []                      # generate exactly n tokens
    prompt = list(range(1000, 1128))             # 128 tokens
    if mode == "embed":
        from edgeprune_runtime.memory import weight_mappings
        step = sess.vocab_size // 128
        sess.generate(list(range(0, 128 * step, step)), max_new_tokens=n)
        print(json.dumps({"weights_rss": sum(m["Rss"] for m in weight_mappings(folder))}))
        return
    if mode == "peak":
        r = sess.generate(prompt, max_new_tokens=n)
        assert len(r.token_ids[0]) == n, len(r.token_ids[0])
        kv = sess.kv_cache_bytes(len(prompt) + n)
        huge = [int(x.split()[1]) * 1024 for x in open("/proc/self/smaps_rollup")
                if x.startswith("AnonHugePages:")]
        print(json.dumps({"vm_hwm": _hwm(), "kv_bytes": kv["k"] + kv["v"],
                          "huge_page_bytes": sess.huge_page_bytes, "anon_huge": sum(huge)}))
        return
    # the samples go to a buffer allocated and touched before the run: a growing list
    # costs ~136 B a sample, 4.5 MiB over a 15-minute run on a loaded machine, which the
    # test would read as the runtime's growth
    buf = np.full((SAMPLE_CAP, 4), -1.0)
    count, stop = [0], threading.Event()
    t0 = time.perf_counter()

    def sample():
        i, interval = 0, 0.02
        while not stop.is_set():
            if i == SAMPLE_CAP:                  # full: keep every other sample, sample half as often
                buf[:SAMPLE_CAP // 2] = buf[::2].copy()
                i, interval = SAMPLE_CAP // 2, 2 * interval
            buf[i] = (time.perf_counter() - t0, *_status_rss())
            i += 1
            count[0] = i
            time.sleep(interval)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    r = sess.generate(prompt, max_new_tokens=n)
    stop.set()
    th.join()
    samples = [[t, int(rss), int(anon), int(fb)] for t, rss, anon, fb in buf[:count[0]].tolist()]
    print(json.dumps({"samples": samples, "seconds": time.perf_counter() - t0,
                      "tokens": len(r.token_ids[0]), "weights_bytes": int(sess.weights_bytes)}))


if __name__ == "__main__":
    main()
