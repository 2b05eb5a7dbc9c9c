"""``--ray local`` on a tiny model gives the table of the local run (Ray starts a local
instance: slower than the unit tests)."""

from __future__ import annotations

import pytest

from study_tiny import study_config, study_inputs_in, study_numbers

pytestmark = pytest.mark.integration


def test_ray_local_gives_the_local_table(tmp_path):
    pytest.importorskip("ray")
    pytest.importorskip("lm_eval")
    study_inputs = study_inputs_in(tmp_path / "inputs")
    from edgeprune.study import run_study

    cfg = study_config(study_inputs, "rtn:4,wanda:0.5", tmp_path / "local")
    local = run_study(cfg, tmp_path / "a", progress=False, log=lambda m: None, plots=False)
    cfg_ray = study_config(study_inputs, "rtn:4,wanda:0.5", tmp_path / "ray")
    remote = run_study(cfg_ray, tmp_path / "b", ray_address="local", progress=False, log=lambda m: None,
                       plots=False)
    assert [o.status for o in remote.outcomes] == ["computed"] * 3
    a, b = study_numbers(local), study_numbers(remote)
    for ra, rb in zip(a, b):
        for k in ra:
            if isinstance(ra[k], float):
                assert rb[k] == pytest.approx(ra[k], rel=1e-5, abs=1e-7), (ra["cell"], k)
            else:
                assert ra[k] == rb[k]
