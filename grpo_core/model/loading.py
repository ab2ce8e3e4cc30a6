"""Policy loading and saving, and the tiny offline model used by the local default and tests.

A policy is a Hugging Face causal LM plus its tokenizer. It loads from a hub id, a local
directory, an ``s3://`` URI (downloaded through ``storage`` first) or a GGUF checkpoint
(converted once by ``io.gguf``), always with safetensors
and ``trust_remote_code`` off unless asked for. Since this machine cannot reach the hub,
``build_tiny`` makes a real transformers architecture (Llama or Qwen2) with random weights and
a character-level tokenizer built with ``tokenizers``: every character is a token, plus four
added tokens for the ``<think>``/``<answer>`` tags so the output format is cheap to emit.

    python -m grpo_core.model.loading tiny --out /tmp/tiny --hidden 64 --layers 2
"""
from __future__ import annotations

import argparse
import contextlib
import re
import string
import tempfile
from pathlib import Path

import torch

from grpo_core.io import storage

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]
TAG_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]
# A plain-text chat template: the tiny model has no role tokens, and a template keeps the prompt
# format identical between SFT, GRPO rollouts and evaluation (and travels with the tokenizer).
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}Assistant: {{ m['content'] }}{{ eos_token }}\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)
ARCHITECTURES = ("llama", "qwen2")


def build_char_tokenizer():
    """A character-level fast tokenizer (pad/eos/bos/unk, tag tokens, chat template)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + TAG_TOKENS + list(string.printable))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>", padding_side="left")
    fast.add_tokens(TAG_TOKENS)  # matched before the per-character split
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny(arch: str = "llama", hidden: int = 64, layers: int = 2, heads: int = 4,
               max_positions: int = 2048, seed: int = 0):
    """A randomly initialised causal LM of a real transformers architecture + char tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    if arch not in ARCHITECTURES:
        raise ValueError(f"arch={arch!r} is not supported for the tiny model; use one of {ARCHITECTURES}")
    tok = build_char_tokenizer()
    cls = LlamaConfig if arch == "llama" else Qwen2Config
    cfg = cls(vocab_size=len(tok), hidden_size=hidden, intermediate_size=4 * hidden,
              num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
              max_position_embeddings=max_positions, pad_token_id=tok.pad_token_id,
              eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model, tok


def prepare_tokenizer(tok):
    """Left padding for batched generation; pad falls back to eos when a tokenizer has none."""
    if tok.eos_token_id is None:
        raise ValueError("tokenizer has no eos_token; set one (tokenizer.eos_token = ...) so "
                         "generation can stop")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
"""A Hugging Face hub id: ``name`` or ``org/name`` (one slash at most)."""


def _local_model_dir(name_or_path: str) -> str:
    """A local dir to load from (s3:// is downloaded first), or the hub id unchanged.

    An existing directory wins; ``org/name`` that is not a directory is a hub id; anything else
    that looks like a path (absolute, ./, ~, several slashes) must exist.
    """
    if storage.is_s3(name_or_path):
        cache = Path(tempfile.mkdtemp(prefix="grpo_model_"))
        return str(storage.get_dir(name_or_path, cache))
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        return str(local)
    if HUB_ID.match(name_or_path):
        return name_or_path
    raise FileNotFoundError(f"model path {name_or_path!r} does not exist; give a hub id (org/name), "
                            "a local directory or an s3:// URI")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def _check_local_dir(name: str, src: Path) -> None:
    """Fail early, naming the fix, on a local dir without tokenizer or safetensors weights."""
    if not any((src / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"model dir {name!r} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); "
                         "save the tokenizer next to the weights with tokenizer.save_pretrained(dir)")
    if not any(src.glob("*.safetensors")):
        found = sorted(p.name for p in src.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        raise ValueError(f"model dir {name!r} has no *.safetensors weights{f' (found {found})' if found else ''}; "
                         "pickle-based weights are refused because loading them can run code. Convert them "
                         "with model.save_pretrained(dir, safe_serialization=True) where you trust the source")


def _encoder_only_types() -> set[str]:
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES
    except ImportError:  # pragma: no cover - a future transformers layout
        return set()
    return set(MODEL_FOR_MASKED_LM_MAPPING_NAMES)


def check_policy(name: str, model) -> None:
    """Refuse encoder (masked-LM) architectures and weights with NaN/inf values."""
    cfg = model.config
    if cfg.model_type in _encoder_only_types() and not getattr(cfg, "is_decoder", False):
        raise ValueError(f"{name!r} is a {cfg.model_type!r} model ({type(model).__name__}), an encoder "
                         "architecture with bidirectional attention; GRPO needs a decoder-only causal LM "
                         "(e.g. llama, qwen2). Set is_decoder=true in its config.json only if it was "
                         "trained as a causal decoder")
    for pname, p in model.named_parameters():
        if not torch.isfinite(p).all():
            raise ValueError(f"{name!r}: parameter {pname} has {int((~torch.isfinite(p)).sum())} NaN/inf "
                             "values; the weights are corrupt (re-export them, or resume from an earlier "
                             "checkpoint)")


def load_policy(name_or_path: str, *, trust_remote_code: bool = False, dtype: str = "float32"):
    """Load ``(model, tokenizer)`` from a hub id, a local dir, an ``s3://`` URI or a GGUF source
    (a ``.gguf`` file or a packaged name such as ``smollm2-135m-instruct``: converted once into
    ``gguf.default_cache_root()``, then loaded as a dir)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()  # a "Loading weights" bar per load (policy, reference, each evaluation) floods step logs

    from grpo_core.io import gguf
    if gguf.is_gguf_source(name_or_path):
        name_or_path = gguf.convert_gguf(name_or_path, gguf.default_cache_root())["uri"]
    src = _local_model_dir(str(name_or_path))
    if Path(src).is_dir():
        _check_local_dir(str(name_or_path), Path(src))
    try:
        tok = AutoTokenizer.from_pretrained(src, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not load a tokenizer from {name_or_path!r}: {exc}") from exc
    try:
        model = AutoModelForCausalLM.from_pretrained(
            src, trust_remote_code=trust_remote_code, dtype=getattr(torch, dtype), use_safetensors=True)
    except ValueError as exc:
        raise ValueError(f"{name_or_path!r} is not a causal LM with safetensors weights "
                         f"(AutoModelForCausalLM): {exc}") from exc
    check_policy(str(name_or_path), model)
    try:
        tok = prepare_tokenizer(tok)
    except ValueError as exc:
        raise ValueError(f"{name_or_path!r}: {exc}") from exc
    vocab = model.get_input_embeddings().num_embeddings  # pad and eos are fed back in and gathered
    for role, token_id in (("pad", tok.pad_token_id), ("eos", tok.eos_token_id)):
        if token_id >= vocab:
            raise ValueError(f"{name_or_path!r}: the tokenizer's {role} token id {token_id} is outside the "
                             f"model's {vocab} embeddings (a token added to the tokenizer only); call "
                             "model.resize_token_embeddings(len(tokenizer)) and save both, or use an "
                             "existing token")
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def enable_activation_checkpointing(model) -> None:
    """transformers' layer-wise activation (gradient) checkpointing, non-reentrant (the reentrant
    variant drops gradients of inputs passed by keyword). Raises ValueError for a model without it."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x; the old name is deprecated
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@contextlib.contextmanager
def activation_checkpointing_paused(model):
    """Checkpointing off for forwards without a backward (rollouts, evaluation, old-policy
    scoring). transformers >= 5.2x already skips it when grad is off; older 5.x releases
    checkpointed any training-mode forward and dropped its KV cache, breaking the decoder."""
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in layers:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in layers:
            m.gradient_checkpointing = True


def activation_checkpointing(model) -> bool:
    """Whether ``model`` (or the module a torch.compile wrapper holds) has checkpointing on."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(getattr(model, "_orig_mod", model)), name):
            return bool(getattr(model, name))
    return False


def disable_dropout(model) -> int:
    """Set every dropout probability of ``model`` to 0: ``nn.Dropout`` modules, and the float
    ``attention_dropout``/``dropout`` attributes transformers' attention modules read at forward
    time. Returns how many were non-zero."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p:
            module.p, changed = 0.0, changed + 1
        for attr in ("attention_dropout", "dropout"):
            if isinstance(getattr(module, attr, None), float) and getattr(module, attr):
                setattr(module, attr, 0.0)
                changed += 1
    return changed


def unwrap(model):
    """The bare model inside DDP, ``scoring.CompletionScorer`` (both keep it as ``.module``) and
    ``torch.compile`` (``._orig_mod``)."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = getattr(model, "module", None) or model._orig_mod
    return model


def save_policy(model, tok, out_dir: str | Path, state_dict: dict | None = None) -> Path:
    """Write an HF model dir (safetensors + tokenizer) atomically: temp dir, then rename.
    ``state_dict`` replaces the model's own weights (a sharded model's gathered ones)."""
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()  # no "Writing model shards" bar per save in the step logs
    model = unwrap(model)

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        tok.save_pretrained(tmp)

    return storage.replace_dir(out_dir, fill)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tiny", help="write a tiny random model + char tokenizer to --out")
    t.add_argument("--out", required=True)
    t.add_argument("--arch", default="llama", choices=ARCHITECTURES)
    t.add_argument("--hidden", type=int, default=64)
    t.add_argument("--layers", type=int, default=2)
    t.add_argument("--heads", type=int, default=4)
    t.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    model, tok = build_tiny(a.arch, a.hidden, a.layers, a.heads, seed=a.seed)
    print(save_policy(model, tok, a.out))


if __name__ == "__main__":
    main()
