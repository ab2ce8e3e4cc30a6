"""The model as files and modules: loading and saving policies (HF ids, local dirs, storage URIs,
GGUF sources), the tiny test architectures, and LoRA adapters (wrap, merge, linear weights).

May import config, io; nothing above."""
