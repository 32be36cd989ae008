"""An HTTP proxy in front of an S3-compatible server that answers chosen requests with 503 (a
throttled or unavailable service), for tests/faults/test_object_storage_faults.py. It runs in its own
process: deltalake holds the GIL while it waits for a reply, so a proxy thread in the test's process
would never answer. `python -m tests.faults.faulty_proxy UPSTREAM_URL` prints its port; then
`PUT /__fault__` with a JSON body {"methods": [...], "contains": "..."} makes it refuse the requests of
those methods whose path contains that text (`{}`: none), and `GET /__fault__` answers how many it
refused so far."""

from __future__ import annotations

import http.client
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

CONTROL = "/__fault__"


class FaultyProxy(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, upstream: str):
        super().__init__(("127.0.0.1", 0), _Forward)
        self.upstream = urlsplit(upstream).netloc
        self.rule: dict = {}
        self.refused = 0

    def failing(self, method: str, path: str) -> bool:
        return method in self.rule.get("methods", ()) and self.rule.get("contains", "") in path


class _Forward(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FaultyProxy

    def _reply(self, status: int, data: bytes, headers: list[tuple[str, str]] = ()) -> None:
        self.send_response(status)
        length = str(len(data))
        for key, value in headers:
            if key.lower() == "content-length" and self.command == "HEAD":
                length = value  # the size of what a GET would answer
            elif key.lower() not in ("content-length", "transfer-encoding", "connection"):
                self.send_header(key, value)
        self.send_header("Content-Length", length)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _body(self) -> bytes:
        """The request body as it came: a chunked one with its framing and trailers (the S3 client
        sends its checksum as a trailer), forwarded unchanged."""
        if "chunked" not in self.headers.get("Transfer-Encoding", ""):
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))
        raw = b""
        while size := int((line := self.rfile.readline()).split(b";")[0], 16):
            raw += line + self.rfile.read(size) + self.rfile.readline()
        raw += line
        while (line := self.rfile.readline()).strip():  # trailers, then the blank line
            raw += line
        return raw + line

    def _any(self) -> None:
        body = self._body()
        if self.path == CONTROL:
            if self.command == "PUT":
                self.server.rule = json.loads(body)
            return self._reply(200, json.dumps({"refused": self.server.refused}).encode())
        if self.server.failing(self.command, self.path):
            self.server.refused += 1
            return self._reply(503, b"<Error><Code>SlowDown</Code><Message>injected fault</Message></Error>")
        upstream = http.client.HTTPConnection(self.server.upstream, timeout=60)
        try:
            upstream.request(self.command, self.path, body=body, headers=dict(self.headers))
            answer = upstream.getresponse()
            self._reply(answer.status, answer.read(), answer.getheaders())
        finally:
            upstream.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

    def log_message(self, *args: object) -> None:  # quiet
        pass


def main() -> None:
    server = FaultyProxy(sys.argv[1])
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
