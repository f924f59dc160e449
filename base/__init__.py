"""The bottom layer: the error type, the decoding methods' names, safe file writing, prompt and tokenizer files,
and the built-in prompt sets. Every layer may import it; it imports nothing of eaglex outside itself."""
