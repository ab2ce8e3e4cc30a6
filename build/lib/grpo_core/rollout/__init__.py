"""Sampling completions: the engine seam (`engines.build`), the in-process shared-prefix decoder,
the `generate` path, the vLLM engine and the server it talks to (vLLM runs in its own venv and is
never imported), loop detection, and `RolloutBatch`, the record every engine returns.

May import model, config, data, io; nothing above."""
