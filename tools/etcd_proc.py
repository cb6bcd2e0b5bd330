"""Start and stop a throwaway etcd (Debian's etcd-server) on loopback ports.

Used by the cluster tests and the cluster benchmark; never for production.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass

from kvstore.core.errors import PeerUnavailableError
from kvstore.cluster.etcd import EtcdClient


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class EtcdProcess:
    url: str
    proc: subprocess.Popen
    data_dir: str

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def etcd_argv(host: str, client_port: int, peer_port: int, data_dir: str) -> list[str]:
    """A one-member etcd serving clients on ``host:client_port`` (for any launcher,
    e.g. a network namespace's ``node.popen``)."""
    binary = shutil.which("etcd")
    if binary is None:
        raise FileNotFoundError("etcd not installed (Debian package etcd-server; `make setup`)")
    client_url, peer_url = f"http://{host}:{client_port}", f"http://{host}:{peer_port}"
    return [binary, "--name", "kvtest", "--data-dir", data_dir,
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"kvtest={peer_url}", "--log-level", "error"]


def start_etcd(host: str = "127.0.0.1", timeout_s: float = 20.0) -> EtcdProcess:
    client_port, peer_port = free_port(host), free_port(host)
    data_dir = tempfile.mkdtemp(prefix="kvstore-etcd-")
    try:
        argv = etcd_argv(host, client_port, peer_port, data_dir)
    except FileNotFoundError:
        shutil.rmtree(data_dir, ignore_errors=True)
        raise
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    etcd = EtcdProcess(f"etcd://{host}:{client_port}", proc, data_dir)
    client = EtcdClient(etcd.url, timeout_s=1.0)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            etcd.stop()
            raise RuntimeError(f"etcd exited with {proc.returncode}")
        try:
            client.status()
            return etcd
        except PeerUnavailableError:
            time.sleep(0.1)
    etcd.stop()
    raise RuntimeError(f"etcd did not answer within {timeout_s}s")
