"""S3 helpers shared by the checkpoint-storage tests: a connection-resetting TCP proxy (a real
network fault) and a checkpoint written locally then put under an s3:// prefix.
"""
from __future__ import annotations

import socket
import struct
import threading
from pathlib import Path

from grpo_core.io import storage
from grpo_core.train import checkpoint
from tests.fault_helpers import small_state


class DroppingProxy:
    """A TCP proxy to ``port`` that resets its first ``drop`` connections: a real network fault."""

    def __init__(self, port: int, drop: int):
        self.target, self.drop, self.dropped = port, drop, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            if self.dropped < self.drop:
                self.dropped += 1
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()  # RST: "connection reset by peer"
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a, b):
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.sock.close()


def put_checkpoint(tmp_path, uri_root: str, it: int) -> Path:
    local = checkpoint.save(tmp_path / "local", it, *small_state(seed=it), {"data_position": it})
    storage.put_dir(local, storage.join(uri_root, local.name))
    return local
