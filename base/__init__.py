"""The bottom layer: the error type, safe file writing, prompt files and the built-in prompt sets. Every layer may
import it; it imports nothing of eaglex."""
