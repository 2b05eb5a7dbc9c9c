"""bench/compare_methods.py's cases: every shipped preset by name, any recipe file as
``recipe:PATH``, and an unknown case refused before any model is loaded."""

from __future__ import annotations

import pytest

from bench_modules import load_bench


def test_every_preset_and_any_recipe_file_is_a_case(benchlib, tmp_path, capsys):
    cm = load_bench("compare_methods")
    from edgeprune.pipeline import preset_names
    from edgeprune.recipe import Recipe

    names = [c[0] for c in cm.cases()]
    assert set(preset_names()) <= set(names) and "best-w4-refit" in names
    recipe = next(c for c in cm.cases() if c[0] == "best-w4-refit")[1]()
    assert isinstance(recipe, Recipe) and recipe.name == "best-w4-refit"
    f = tmp_path / "mine.yaml"
    f.write_text("name: mine\nstages:\n  - method: rtn\n    bits: 4\n    group_size: 64\n")
    name, factory, peer = cm.recipe_case(f"recipe:{f}")
    assert (name, peer) == (f"recipe:{f}", None) and factory().name == "mine"
    assert cm.recipe_case("best-w4") is None
    with pytest.raises(SystemExit):
        cm.main(["--cases", "no_such_case", "--no-peer"])
    assert "recipe:PATH" in capsys.readouterr().err
