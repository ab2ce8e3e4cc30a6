"""A bad field in a flow config stops `python flows/grpo_flow.py ... run` with the one line naming
the field, before any step runs: no Python traceback, nothing started."""
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

FLOW = str(REPO / "flows" / "grpo_flow.py")
TINY = (REPO / "flows" / "configs" / "tiny.toml").read_text()


def _with_line(table: str, line: str) -> str:
    """tiny.toml with ``line`` set in ``[table]`` (an existing key of the same name replaced)."""
    key = line.split("=")[0].strip()
    out, inside = [], False
    for ln in TINY.splitlines():
        if ln.startswith("["):
            inside = ln.split("]")[0] == f"[{table}"
            if inside:
                out += [ln, line]
                continue
        if not (inside and ln.split("=")[0].strip() == key):
            out.append(ln)
    assert line in out, f"no [{table}] in tiny.toml"
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("table,line,message", [
    ("curriculum.optim", 'lr = "fast"',
     r"config error: curriculum\.optim\.lr = 'fast' has type str; expected .*float.*"),
    ("gsm8k.sampling", "gruop_size = 8",
     r"config error: unknown field gsm8k\.sampling\.gruop_size\. Did you mean 'group_size'\?.*"),
])
def test_a_bad_stage_field_is_one_line_without_a_traceback(tmp_path, table, line, message):
    import re

    cfg = tmp_path / "bad.toml"
    cfg.write_text(_with_line(table, line))
    env = {**os.environ, "PYTHONPATH": str(REPO), "USERNAME": "ci", "METAFLOW_HOME": str(tmp_path / "mfhome"),
           "METAFLOW_DEFAULT_DATASTORE": "local", "METAFLOW_DEFAULT_METADATA": "local",
           "METAFLOW_DATASTORE_SYSROOT_LOCAL": str(tmp_path / "mf")}
    out = subprocess.run([sys.executable, FLOW, "--config", "cfg", str(cfg), "run"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1 and re.fullmatch(message, lines[0]), out.stdout + out.stderr
    assert not (tmp_path / "mf" / "GRPOFlow").exists()  # no run was started
