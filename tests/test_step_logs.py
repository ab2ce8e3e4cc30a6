"""What a step's log shows: loading a model prints no progress bar (transformers 5.x draws a
"Loading weights" bar per load: the policy, the reference, every evaluation)."""
import subprocess
import sys

from tests.helpers import REPO, tiny_model_dir

LOAD = """
import sys
from grpo_core.model.loading import load_policy
model, tok = load_policy(sys.argv[1])
model, tok = load_policy(sys.argv[1])  # a reference model, loaded again in the same process
print("loaded", type(model).__name__, len(tok))
"""


def test_loading_a_model_draws_no_progress_bar(tmp_path):
    model = tiny_model_dir(tmp_path / "tiny")  # build_tiny + save_policy
    out = subprocess.run([sys.executable, "-c", LOAD, str(model)], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("loaded LlamaForCausalLM")
    assert "Loading weights" not in out.stderr and "it/s]" not in out.stderr, out.stderr[-2000:]
