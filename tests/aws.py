"""AWS endpoints for tests, real HTTP servers on loopback: moto_server (reached through the usual
AWS env vars), and a fake EC2 instance metadata service (IMDSv2) with spot notices and an instance
profile's credentials."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from cluster.imds import REBALANCE_PATH, SPOT_ACTION_PATH, TOKEN_HEADER, TOKEN_PATH, TTL_HEADER


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def moto_server(env: dict | None = None, cwd: Path | None = None):
    """A moto_server on a free loopback port, its endpoint yielded once it answers; `env`: added to
    this process's environment for it (moto's settings, such as its request recorder)."""
    port = free_port()
    binary = Path(sys.executable).parent / "moto_server"
    process = subprocess.Popen([str(binary), "-H", "127.0.0.1", "-p", str(port)], env={**os.environ, **(env or {})},
                               cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("moto_server did not start")
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=10)


AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


def s3_env(endpoint: str) -> dict:
    return {**AWS_ENV, "AWS_ENDPOINT_URL": endpoint}


def create_bucket(endpoint: str, name: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=name)


class Outage:
    """A TCP forwarder on loopback to `target_port` (an endpoint such as moto_server's) that can be
    cut: `down()` drops every connection through it and refuses new ones, `up()` serves again.
    The endpoint behind it keeps its state: an outage of the network, not of the service."""

    def __init__(self, target_port: int):
        self.target_port, self.port = target_port, free_port()
        self._lock = threading.Lock()
        self._sockets: set = set()
        self._listener = None
        self.up()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            sockets, self._sockets = self._sockets, set()
        for sock in [listener, *sockets]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _accept(self, listener) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # closed: down
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:  # went down meanwhile
                    client.close(), server.close()
                    return
                self._sockets.update((client, server))
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source, sink) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


# ---------------------------------------------------------------- a fake IMDSv2 on loopback

CREDENTIALS_PATH = "/latest/meta-data/iam/security-credentials/"  # lists the role; + role: its keys


class FakeImds:
    """EC2's metadata service as far as the spot watcher and botocore's credential chain use it:
    PUT a token (TTL header required, 1..21600), GETs only with a live token (401 otherwise, as with
    HttpTokens: required), 404 until a notice is switched on; `role` (None: no instance profile)
    and its temporary credentials under CREDENTIALS_PATH."""

    def __init__(self, role: str | None = None):
        self.tokens: dict[str, float] = {}
        self.spot: dict | None = None
        self.rebalance: dict | None = None
        self.role = role
        self.credentials = {"Code": "Success", "LastUpdated": "2026-12-01T12:00:00Z", "Type": "AWS-HMAC",
                            "AccessKeyId": "ASIAFAKEIMDSKEY", "SecretAccessKey": "fake-imds-secret",
                            "Token": "fake-imds-session-token", "Expiration": "2099-12-01T18:00:00Z"}
        self.puts = self.gets = self.unauthorized = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status: int, body: str = "") -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self):
                ttl = self.headers.get(TTL_HEADER, "")
                if self.path != TOKEN_PATH:
                    return self.reply(404)
                if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                    return self.reply(400)
                token = uuid.uuid4().hex
                with fake.lock:
                    fake.tokens[token] = time.monotonic() + int(ttl)
                    fake.puts += 1
                self.reply(200, token)

            def do_GET(self):
                with fake.lock:
                    expires = fake.tokens.get(self.headers.get(TOKEN_HEADER, ""), 0.0)
                    if expires <= time.monotonic():
                        fake.unauthorized += 1
                        return self.reply(401)
                    fake.gets += 1
                    body = fake.body(self.path)
                self.reply(200, body) if body else self.reply(404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def body(self, path: str) -> str | None:
        notice = {SPOT_ACTION_PATH: self.spot, REBALANCE_PATH: self.rebalance}.get(path)
        if notice:
            return json.dumps(notice)
        if self.role and path == CREDENTIALS_PATH:
            return self.role
        if self.role and path == CREDENTIALS_PATH + self.role:
            return json.dumps(self.credentials)
        return None

    def forget_tokens(self):
        with self.lock:
            self.tokens.clear()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"  # nothing listens once closed
