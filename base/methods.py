"""The decoding methods, named once: what `--method`, the engine and a deployment choose from.

eagle3: an EAGLE-3 head and a tree; eagle2: an EAGLE-1/2 head and a tree; eagle1: an EAGLE-1/2 head and EAGLE-1's
static tree; vanilla: no drafting."""

METHODS = ("eagle3", "eagle2", "eagle1", "vanilla")
