"""The machine-wide lock the local evaluations take turns on: real processes, real flock."""
import json
import signal
import subprocess
import sys
import time

HOLD = """
import json, sys, time
from grpo_core.io.locks import exclusive
with exclusive(sys.argv[1], waiting="waiting for " + sys.argv[2]):
    start = time.time()
    print("held", flush=True)
    sys.stdin.readline() if sys.argv[3] == "until-told" else time.sleep(float(sys.argv[3]))
    print(json.dumps([start, time.time()]), flush=True)
"""


def _holder(lock, name, seconds):
    return subprocess.Popen([sys.executable, "-c", HOLD, str(lock), name, str(seconds)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_holders_take_turns_and_the_waiting_one_says_so(tmp_path):
    lock = tmp_path / "sub" / "eval.lock"  # the folder is made
    first = _holder(lock, "a", "until-told")
    assert first.stdout.readline().strip() == "held"
    second = _holder(lock, "b", 0.1)
    assert second.stderr.readline().strip() == "waiting for b"  # blocked while the first holds it
    (a_out, _), (b_out, _) = first.communicate("go\n", timeout=30), second.communicate(timeout=30)
    a, b = json.loads(a_out), json.loads(b_out.splitlines()[-1])
    assert b[0] >= a[1], (a, b)  # the second started only after the first let go


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    lock = tmp_path / "eval.lock"
    first = _holder(lock, "a", 60)
    assert first.stdout.readline().strip() == "held"
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    t = time.time()
    second = _holder(lock, "b", 0)
    out, err = second.communicate(timeout=30)
    assert second.returncode == 0 and "held" in out and time.time() - t < 20, err
