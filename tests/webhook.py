"""A webhook receiver for tests: a real http.server on loopback, in a thread, that records every
JSON body posted to it (and can answer the first posts with an error). It is as strict as a real
one: a body that is not JSON (Python's bare NaN or Infinity included) is answered 400."""

import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Receiver:
    def __init__(self, server: ThreadingHTTPServer, fail_first: int, status: int):
        self.server, self.fail_first, self.status = server, fail_first, status
        self.posts: list[dict] = []   # {"path": ..., "body": ...} of every post answered 200
        self.refused = 0              # posts answered with the error status
        self.malformed: list[bytes] = []  # bodies answered 400: not JSON
        self.lock = threading.Lock()

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def events(self) -> list[str]:
        with self.lock:
            return [p["body"].get("event") for p in self.posts]


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


@contextmanager
def receiver(fail_first: int = 0, status: int = 500):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                body = json.loads(raw or b"{}", parse_constant=_not_json)
            except ValueError:
                with got.lock:
                    got.malformed.append(raw)
                self.send_response(400)
                self.end_headers()
                return
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
