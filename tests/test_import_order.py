"""The test process survives Metaflow's Runner API loaded between torch and transformers.

Tests drive flows in-process through ``metaflow.Runner``; a later test that loads a transformers
model class imports torch's DTensor, which failed with a TypeError once Metaflow's vendored
typing_extensions had been loaded (Netflix/metaflow#2462): any run of a subset with a flow test
before a model test errored at setup. ``tests/conftest.py`` binds the vendored name to the installed
typing_extensions; this test checks it in a fresh interpreter, in the order that broke.
"""
from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO

ORDER_THAT_BROKE = """
import tests.conftest
import torch
import metaflow.runner.click_api  # what `from metaflow import Runner` loads: the vendored typeguard
import torch.distributed.tensor   # what transformers' model classes load
from grpo_core.model.loading import build_tiny
model, _ = build_tiny("llama", hidden=32, layers=1, heads=2, seed=0)
print("loaded", type(model).__name__)
"""

PROBE_WITHOUT_ALIAS = """
import torch
import metaflow.runner.click_api
try:
    import torch.distributed.tensor
except TypeError as e:
    print("TypeError", e)
else:
    print("no error")
"""


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_a_model_loads_after_torch_and_metaflows_runner_api_in_one_process():
    out = _python(ORDER_THAT_BROKE)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "loaded LlamaForCausalLM" in out.stdout


def test_the_alias_is_what_keeps_that_order_working():
    """Without conftest's alias the same order fails (while Metaflow vendors the old copy): the
    test above passes because of the alias, not by luck of the import order."""
    out = _python(PROBE_WITHOUT_ALIAS)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("TypeError"), (
        f"torch's DTensor now imports after Metaflow's vendored typing_extensions ({out.stdout.strip()!r}): "
        "Metaflow (#2462) or torch changed; drop the alias in tests/conftest.py and this test")
