"""Regenerate the OpenRLHF flag table and its summary sentence in docs/openrlhf_compat.md, in place.

    python scripts/render_openrlhf_compat.py [docs/openrlhf_compat.md]

The table is data (``openrlhf_shape/config/openrlhf.py``); tests/config/test_openrlhf_flag_table.py fails when
the page and the table differ.
"""

from __future__ import annotations

import os
import sys

from openrlhf_shape.config.openrlhf import render_doc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(path: str) -> None:
    with open(path) as f:
        doc = render_doc(f.read())
    with open(path, "w") as f:
        f.write(doc)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "docs", "openrlhf_compat.md"))
