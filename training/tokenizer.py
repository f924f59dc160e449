"""A byte-level BPE tokenizer trained with `tokenizers`, saved as a normal Hugging Face tokenizer folder.

Byte-level means every string round-trips (no unknown token). One special token, `<|endoftext|>`, separates
documents and is the model's EOS (and nominal BOS; nothing adds it to prompts).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

EOS = "<|endoftext|>"


@dataclass(frozen=True)
class TokenizerConfig:
    vocab_size: int = 4096
    min_frequency: int = 2


def train_tokenizer(texts: list[str], cfg: TokenizerConfig = TokenizerConfig()):
    """A `tokenizers.Tokenizer`; deterministic for the same texts in the same order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
                                  special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def save_tokenizer(tok, out: str | Path) -> None:
    """Write tokenizer.json + tokenizer_config.json + special_tokens_map.json (AutoTokenizer loads the folder)."""
    from transformers import PreTrainedTokenizerFast

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=None,
                                   clean_up_tokenization_spaces=False)
    fast.model_max_length = 1 << 30
    fast.save_pretrained(str(out))
    # save_pretrained may record the class as "TokenizersBackend" in transformers 5; pin the portable name.
    cfg_file = out / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def load_tokenizer(folder: str | Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(folder))
