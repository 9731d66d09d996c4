"""`python -m participant.diagrams [--write]`: the Gym side's state diagrams, drawn from the tables of
`participant.states`, printed or written into docs/state-machines.md between its markers."""

from __future__ import annotations

import sys
from pathlib import Path

from participant.states import generated_doc, with_generated
from protocol.generated_docs import section_main

DOC = Path(__file__).resolve().parent.parent / "docs" / "state-machines.md"


def main(argv: list[str]) -> int:
    return section_main(argv, DOC, generated_doc, with_generated, "participant.diagrams")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
