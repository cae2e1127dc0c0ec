"""A real Redis/Valkey server on loopback for the remote-tier tests (no mocks).

``.ci/run`` installs the server binary and starts one (``TIERCACHE_TEST_REDIS_URL``) for the
tests that only need a server; tests that stop, pause or reconfigure a server start their
own private one here.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from typing import Optional

SKIP_REASON = ("no redis-server or valkey-server binary on PATH (Debian: apt-get install redis-server; "
               ".ci/run installs it)")


def server_binary() -> Optional[str]:
    return shutil.which("valkey-server") or shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One server process; ``args`` are extra ``--name value`` options (maxmemory, cluster...)."""

    def __init__(self, workdir: str, *args: str, tls_ca: Optional[str] = None) -> None:
        self.binary = server_binary()
        if self.binary is None:
            raise RuntimeError(SKIP_REASON)
        self.workdir = workdir
        os.makedirs(workdir, exist_ok=True)
        self.port = free_port()
        self.args = list(args)
        self.tls_ca = tls_ca  # with TLS: a self-signed cert (cert.pem, key.pem) beside this CA file
        self.proc: Optional[subprocess.Popen] = None
        self.start()

    @property
    def url(self) -> str:
        if self.tls_ca:
            return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls_ca}"
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        ports = ["--port", str(self.port)]
        if self.tls_ca:
            d = os.path.dirname(self.tls_ca)
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", os.path.join(d, "cert.pem"),
                     "--tls-key-file", os.path.join(d, "key.pem"), "--tls-ca-cert-file", self.tls_ca,
                     "--tls-auth-clients", "no"]
        cmd = [self.binary, *ports, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", self.workdir, "--daemonize", "no", *self.args]
        self.log = open(os.path.join(self.workdir, f"server-{self.port}.log"), "ab")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.wait_ready()

    def client(self, **kw):
        import redis
        if self.tls_ca:
            kw.update(ssl=True, ssl_ca_certs=self.tls_ca)
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, **kw)

    def wait_ready(self, timeout: float = 10.0) -> None:
        import redis
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.client().ping():
                    return
            except redis.AuthenticationError:  # up, with --requirepass: refuses the unauthenticated ping
                return
            except (redis.ConnectionError, redis.TimeoutError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis server on port {self.port} did not start; see {self.log.name}")
                time.sleep(0.05)
            except redis.ResponseError:  # e.g. a cluster node before its slots are assigned
                return

    def stop(self) -> None:
        """Kill the server (SIGKILL: no goodbye to clients) and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        self.stop()
        self.log.close()


def self_signed_cert(directory: str) -> Optional[str]:
    """cert.pem/key.pem for 127.0.0.1 in ``directory`` (the cert is its own CA); None
    without openssl."""
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    os.makedirs(directory, exist_ok=True)
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    os.path.join(directory, "key.pem"), "-out", os.path.join(directory, "cert.pem"), "-days", "2",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return os.path.join(directory, "cert.pem")
