"""Test-only stand-in: vLLM is not installed on CPU test hosts (see ../README.md)."""
