"""A webhook receiver for tests: a real http.server on loopback, in a thread, that records every
JSON body posted to it (and can answer the first posts with an error)."""

import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Receiver:
    def __init__(self, server: ThreadingHTTPServer, fail_first: int, status: int):
        self.server, self.fail_first, self.status = server, fail_first, status
        self.posts: list[dict] = []   # {"path": ..., "body": ...} of every post answered 200
        self.refused = 0              # posts answered with the error status
        self.lock = threading.Lock()

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def events(self) -> list[str]:
        with self.lock:
            return [p["body"].get("event") for p in self.posts]


@contextmanager
def receiver(fail_first: int = 0, status: int = 500):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            with got.lock:
                failing = got.refused < got.fail_first
                if failing:
                    got.refused += 1
                else:
                    got.posts.append({"path": self.path, "body": body})
            self.send_response(got.status if failing else 200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    got = Receiver(server, fail_first, status)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield got
    finally:
        server.shutdown()
        server.server_close()
