"""Deployment targets for eaglex engines (Triton Inference Server today; see docs/triton.md)."""
