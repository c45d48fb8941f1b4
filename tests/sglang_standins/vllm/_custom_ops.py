"""Test-only stand-in: imported by SGLang's rotary layer on CPU, never called there."""


def rotary_embedding(*args: object, **kwargs: object) -> None:
    """Refuse: the CPU path must use SGLang's native rotary embedding."""
    raise RuntimeError("vllm._custom_ops.rotary_embedding is a test stand-in and must not run")
