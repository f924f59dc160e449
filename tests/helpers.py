"""Small helpers shared by the tests."""
from __future__ import annotations

import json
from pathlib import Path


def write_prompt_file(tmp_path: Path, prompts: list[list[int]], n: int) -> Path:
    """The first `n` prompts as an `--prompts` JSONL file ({"input_ids": [...]} per line) in tmp_path."""
    f = Path(tmp_path) / "prompts.jsonl"
    f.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts[:n]))
    return f
