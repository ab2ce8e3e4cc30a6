"""Bytes in and out: storage (local paths and s3:// URIs, atomic writes, retries), one-holder file
locks, and GGUF model sources converted to safetensors.

Imports nothing of grpo_core's outside io; boto3 lives only here."""
