"""``--ray local`` on a tiny model gives the table of the local run (Ray starts a local
instance: slower than the unit tests)."""

from __future__ import annotations

import pytest

from study_tiny import study_config, study_inputs_in, study_numbers

pytestmark = pytest.mark.integration


def test_ray_local_gives_the_local_table(tmp_path, monkeypatch):
    """Same numbers as the local loop; the driver's bar counts every unit and compression
    once, read from the cache the workers write (not only when a cell returns)."""
    pytest.importorskip("ray")
    pytest.importorskip("lm_eval")
    study_inputs = study_inputs_in(tmp_path / "inputs")
    from edgeprune.study import run as run_mod
    from edgeprune.study import run_study

    bar = []
    monkeypatch.setattr(run_mod, "RAY_POLL_S", 0.05)
    monkeypatch.setattr(run_mod._Progress, "advance", lambda self, label, text, n: bar.append((label, text, n)))

    cfg = study_config(study_inputs, "rtn:4,wanda:0.5", tmp_path / "local")
    local = run_study(cfg, tmp_path / "a", progress=False, log=lambda m: None, plots=False)
    cfg_ray = study_config(study_inputs, "rtn:4,wanda:0.5", tmp_path / "ray")
    remote = run_study(cfg_ray, tmp_path / "b", ray_address="local", progress=False, log=lambda m: None,
                       plots=False)
    assert [o.status for o in remote.outcomes] == ["computed"] * 3
    assert all(o.error is None and sorted(o.computed) == sorted(o.units) for o in remote.outcomes)
    units = sum(len(o.units) for o in remote.outcomes)
    assert sum(n for _, _, n in bar) == units + 2                     # + the two compressions
    assert sum(n for _, text, n in bar if text.endswith("measured")) > units // 2, bar
    a, b = study_numbers(local), study_numbers(remote)
    for ra, rb in zip(a, b):
        for k in ra:
            if isinstance(ra[k], float):
                assert rb[k] == pytest.approx(ra[k], rel=1e-5, abs=1e-7), (ra["cell"], k)
            else:
                assert ra[k] == rb[k]
