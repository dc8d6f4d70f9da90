"""`python -m trainkit.recipe.compatibility --markdown`: print docs/compatibility.md."""

from __future__ import annotations

import sys

from .page import load_results, markdown


def main(argv: list[str]) -> int:
    if argv != ["--markdown"]:
        print("usage: python -m trainkit.recipe.compatibility --markdown > docs/compatibility.md", file=sys.stderr)
        return 2
    sys.stdout.write(markdown(load_results()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
