"""The seeded stand-in for the embedded default: `make engine` uses it only when models/tiny is absent (a checkout
without the trained default). Writes a target and an EAGLE-3 head built by eaglex.models.seeded into OUT.

Run: .venv/bin/python tools/seeded_preset.py OUT
"""
from __future__ import annotations

import sys
from pathlib import Path

from eaglex.models.seeded import make_eagle3_head, make_llama_target

if __name__ == "__main__":
    out = Path(sys.argv[1])
    target = make_llama_target(out / "target")
    make_eagle3_head(target, out / "eagle3", draft_vocab_size=40)
    print(f"seeded preset in {out}")
