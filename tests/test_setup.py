"""The README's setup and test commands, the Makefile and ``.ci/run`` say the same thing (CI
must install and test exactly as a person following the README would)."""

from __future__ import annotations

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parent.parent


def _bash_blocks(section: str) -> list[list[str]]:
    """The command lines (comments and blank lines dropped) of each ```bash block of a README
    section (``## <section>`` up to the next ``## ``)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    body = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", body, flags=re.S)
    return [[line.split("#", 1)[0].strip() for line in block.splitlines()
             if line.split("#", 1)[0].strip()] for block in blocks]


def _make_recipe(target: str) -> list[str]:
    lines = (REPO / "Makefile").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"{re.escape(target)}\s*:", line))
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def test_ci_runs_the_readme_test_command():
    (test_block,) = _bash_blocks("Tests")
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#")]

    assert test_block == ["make test"]
    assert ci[-1] == "make test"


def test_make_installs_exactly_as_the_readme_install_by_hand():
    two_commands, by_hand = _bash_blocks("Install and run: two commands")[:2]
    recipe = _make_recipe("$(INSTALLED)")

    assert two_commands == ["make devnet", "make test"]
    assert by_hand[0] == "python3 -m venv .venv && . .venv/bin/activate"
    # the Makefile calls the venv's pip instead of activating it
    assert recipe[0] == "python3 -m venv $(VENV)"
    assert [line.replace("$(BIN)/", "") for line in recipe[1:-1]] == by_hand[1:]
    assert _make_recipe("test") == ["$(BIN)/python -m pytest -q $(ARGS)"]
    assert _make_recipe("devnet") == ["$(BIN)/ps-node devnet $(ARGS)"]
