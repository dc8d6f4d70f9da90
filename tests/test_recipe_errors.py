"""The broken-recipe corpus: every file under tests/recipes/broken states the exact messages a
user must see (`# expect:` lines), as `file:line:col: dotted.path: message`. A file may give
command-line overrides on an `# overrides:` line (shell words)."""

import re
import shlex
from pathlib import Path

import pytest

from trainkit.recipe import RecipeError, resolve

BROKEN = Path(__file__).parent / "recipes" / "broken"
CASES = sorted(BROKEN.glob("*.yaml"))


def expected_messages(path: Path) -> list[str]:
    parts = str((BROKEN.parent / "parts").resolve())
    return [line.split("# expect: ", 1)[1].replace("PARTS", parts)
            for line in path.read_text().splitlines() if line.startswith("# expect: ")]


def overrides(path: Path) -> list[str]:
    return [word for line in path.read_text().splitlines() if line.startswith("# overrides: ")
            for word in shlex.split(line.split("# overrides: ", 1)[1])]


@pytest.mark.parametrize("recipe", CASES, ids=[c.stem for c in CASES])
def test_broken_recipe_reports_exact_messages(recipe, monkeypatch):
    monkeypatch.chdir(BROKEN)
    expected = expected_messages(recipe)
    assert expected, f"{recipe.name} has no '# expect:' line"
    with pytest.raises(RecipeError) as err:
        resolve(recipe.name, overrides(recipe))
    assert sorted(str(p) for p in err.value.problems) == sorted(expected)
