"""Prompt files and tokenizers: `{"prompt": "..."}` lines need the target folder's tokenizer, `{"input_ids": [...]}`
lines need none."""
from __future__ import annotations

import json
from pathlib import Path

from eaglex.base.errors import ModelError

# Demo and check prompts for presets without a prompt file of their own: code openings, which the embedded default
# (trained on Python sources) continues sensibly and which every chat model can complete.
BUILTIN_PROMPTS = (
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n",
    "def read_lines(path):\n    with open(path) as f:\n",
    "    for i, item in enumerate(items):\n",
    "def parse_args():\n    parser = argparse.ArgumentParser(\n",
    "try:\n    import json\nexcept ImportError:\n",
    "    def __repr__(self):\n        return ",
)


# The files of a Hugging Face tokenizer, copied with a model wherever it goes (engines, bundles, checkpoints). A folder
# holds a tokenizer when it has one of the first three; the others only accompany them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")


def has_tokenizer(folder: str | Path) -> bool:
    return any((Path(folder) / f).is_file() for f in TOKENIZER_FILES[:3])


def load_tokenizer(folder: str | Path | None, resolved: str | None = None):
    """The folder's Hugging Face tokenizer, or None when it has none. `resolved`: the tokenizer class AutoTokenizer
    chose for these files when the engine was built (tokenizer_class), loaded directly: AutoTokenizer's own imports
    (every model family's auto mappings) cost about 2 s of each start. A name that is not a tokenizer class of the
    installed transformers falls back to AutoTokenizer."""
    if folder is None or not has_tokenizer(folder):
        return None
    cls = _tokenizer_class(resolved) if resolved else None
    if cls is not None:
        return cls.from_pretrained(folder)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)


def tokenizer_class(folder: str | Path) -> str | None:
    """The name of the class AutoTokenizer loads `folder` with, when load_tokenizer can load it by that name."""
    tok = load_tokenizer(folder)
    name = type(tok).__name__ if tok is not None else None
    return name if name and _tokenizer_class(name) is type(tok) else None


def _tokenizer_class(name: str):
    """transformers' top-level tokenizer class of that name, else None (a manifest is data: nothing else loads)."""
    import transformers
    try:
        cls = getattr(transformers, name)
    except (AttributeError, ImportError, RuntimeError):
        return None
    return cls if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase) else None


def has_chat_template(tokenizer) -> bool:
    return bool(tokenizer is not None and getattr(tokenizer, "chat_template", None))


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """A conversation through the tokenizer's chat template, ending with the assistant's generation prompt."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding (a Mapping, not a dict) where 4.x returned the ids
    return [int(i) for i in (out["input_ids"] if hasattr(out, "keys") else out)]


def encode(record: dict, tokenizer, chat: bool, where: str) -> list[int]:
    """A prompt line's token ids: its "input_ids" as they are, its "messages" (a conversation ending with a user
    turn) always in the chat template, its "prompt" text in the chat template when `chat`."""
    if "input_ids" in record:
        ids = record["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ModelError(f"{where}: input_ids must be a list of integers")
        return ids
    if "messages" in record:
        msgs = record["messages"]
        if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                        and isinstance(m.get("content"), str) for m in msgs)):
            raise ModelError(f"{where}: messages must be a list of {{\"role\": ..., \"content\": ...}} objects")
        if not has_chat_template(tokenizer):
            raise ModelError(f"{where}: a messages line needs a tokenizer with a chat template in the target folder")
        return chat_ids(tokenizer, msgs)
    if "prompt" in record:
        if not isinstance(record["prompt"], str):
            raise ModelError(f"{where}: prompt must be a string")
        if tokenizer is None:
            raise ModelError(f"{where}: a text prompt needs a tokenizer in the target folder; "
                             "give input_ids instead")
        if chat:
            if not has_chat_template(tokenizer):
                raise ModelError(f"{where}: --chat needs a tokenizer with a chat template")
            return chat_ids(tokenizer, [{"role": "user", "content": record["prompt"]}])
        return tokenizer(record["prompt"])["input_ids"]
    raise ModelError(f"{where}: each line needs a \"prompt\", \"messages\" or \"input_ids\" field")


def read_records(path: str | Path) -> list[tuple[str, dict]]:
    """(where, record) for every non-blank line of a JSONL prompt file; `where` is "FILE:LINE" for messages."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"prompt file {path} does not exist")
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ModelError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise ModelError(f"{path}:{n}: each line must be a JSON object")
        records.append((f"{path}:{n}", record))
    if not records:
        raise ModelError(f"prompt file {path} holds no prompts")
    return records


def read_prompts(path: str | Path, tokenizer, chat: bool = False) -> list[list[int]]:
    return [encode(record, tokenizer, chat, where) for where, record in read_records(path)]


def record_seed(record: dict, where: str) -> int | None:
    """A prompt line's own "seed" field (None when it has none)."""
    seed = record.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise ModelError(f"{where}: seed must be an integer >= 0")
    return seed
