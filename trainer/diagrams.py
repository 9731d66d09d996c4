"""`python -m trainer.diagrams [--write]`: the group's moves, drawn from the table of
`trainer.core.group`, printed or written into docs/state-machines.md between its markers."""

from __future__ import annotations

import sys
from pathlib import Path

from trainer.core.group import generated_doc, with_generated

DOC = Path(__file__).resolve().parent.parent / "docs" / "state-machines.md"


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        DOC.write_text(with_generated(DOC.read_text()))
        return 0
    if argv:
        print("usage: python -m trainer.diagrams [--write]", file=sys.stderr)
        return 2
    print(generated_doc())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
