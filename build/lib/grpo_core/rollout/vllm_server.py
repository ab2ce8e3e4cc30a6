"""A ``vllm serve`` process owned by this process: started on 127.0.0.1, health-checked within a
bounded wait, spoken to over HTTP, and stopped with its whole process group.

vLLM runs from its own virtual environment (``infra/vllm-env.sh``) and is never imported here:
its pins (transformers, fastapi, setuptools) clash with ours. The server is started with
``VLLM_SERVER_DEV_MODE=1`` so that ``/collective_rpc`` (``reload_weights``) and
``/reset_prefix_cache`` exist. It is stopped by ``stop()``, at interpreter exit, on SIGTERM/SIGINT
of this process, and (Linux) when this process dies by any means: the child asks the kernel for
SIGTERM at its parent's death (``PR_SET_PDEATHSIG``), so no server outlives its trainer.
"""
from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path

LOG_TAIL_CHARS = 3000
_LIVE: weakref.WeakSet = weakref.WeakSet()  # servers to stop at exit or on a signal


class VllmServerError(RuntimeError):
    """The vLLM server could not start, died, or refused a request (the message holds its log's tail)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()  # its own process group: stop() signals vLLM's workers too
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not glibc Linux: atexit and the signal handlers still stop it
        pass


class VllmServer:
    """One ``vllm serve`` process. ``start`` returns once ``/health`` answers 200, or raises
    ``VllmServerError`` (with the log's tail) when the process exits or ``startup_timeout_s``
    passes first; the process is stopped in either failure."""

    def __init__(self, python: str, model_dir: str, args: list[str], *, port: int = 0,
                 startup_timeout_s: float = 300.0, log_path: str | Path, env: dict | None = None):
        self.python, self.model_dir, self.args = python, model_dir, list(args)
        self.port, self.startup_timeout_s, self.log_path = port, startup_timeout_s, Path(log_path)
        self.env, self.proc = env or {}, None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        if self.port and not port_is_free(self.port):
            raise VllmServerError(f"vLLM server: port {self.port} on 127.0.0.1 is taken; set vllm.port = 0 "
                                  "(a free port) or free it")
        self.port = self.port or free_port()
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
               "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "PYTHONUNBUFFERED": "1", **self.env}
        env.pop("PYTHONPATH", None)  # never our packages inside vLLM's environment
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         preexec_fn=_die_with_parent)
        _install_stoppers()
        _LIVE.add(self)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise VllmServerError(f"vLLM server exited with code {self.proc.returncode} while starting "
                                      f"({self.python} on {self.model_dir}); its log ends:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        raise VllmServerError(f"vLLM server did not answer /health within vllm.startup_timeout_s = "
                              f"{self.startup_timeout_s:g} s ({self.python} on {self.model_dir}); raise it "
                              f"if the model is large; its log ends:\n{self.log_tail()}")

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except OSError:
            return "(no log)"

    def post(self, path: str, body: dict, timeout_s: float = 600.0) -> dict:
        """POST JSON to the server; its JSON answer (``{}`` for an empty body). A refusal or a dead
        server is a ``VllmServerError`` naming the path, with the server's answer or log."""
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                text = r.read().decode()
        except urllib.error.HTTPError as exc:
            raise VllmServerError(f"vLLM server refused POST {path} ({exc.code}): "
                                  f"{exc.read().decode(errors='replace')[:2000]}") from exc
        except OSError as exc:
            state = "running" if self.proc is not None and self.proc.poll() is None else "dead"
            raise VllmServerError(f"POST {path} to the vLLM server failed ({exc}); the server is {state}; "
                                  f"its log ends:\n{self.log_tail()}") from exc
        return json.loads(text) if text.strip() else {}

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``grace_s``; idempotent."""
        proc, self.proc = self.proc, None
        _LIVE.discard(self)
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


def stop_all() -> None:
    for server in list(_LIVE):
        server.stop()


_STOPPERS_INSTALLED = False


def _install_stoppers() -> None:
    """Stop every live server at exit and on SIGTERM/SIGINT (then die of that signal as before).
    A handler some other code installed stays in charge of its signal; atexit still runs."""
    global _STOPPERS_INSTALLED
    if _STOPPERS_INSTALLED:
        return
    _STOPPERS_INSTALLED = True
    atexit.register(stop_all)
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            previous = signal.getsignal(sig)
            if previous in (signal.SIG_DFL, signal.default_int_handler):
                signal.signal(sig, _stop_then_reraise(sig, previous))
        except ValueError:  # not the main thread: atexit and PR_SET_PDEATHSIG remain
            pass


def _stop_then_reraise(sig, previous):
    def handler(signum, frame):
        stop_all()
        signal.signal(sig, previous)
        if previous is signal.default_int_handler:
            raise KeyboardInterrupt
        os.kill(os.getpid(), sig)
    return handler
