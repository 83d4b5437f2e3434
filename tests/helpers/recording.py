"""A local HTTP server on 127.0.0.1 that records every request and answers with `answer()`:
the base of the recording KFP and Kubernetes API servers used by the tests."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse


class RecordingServer:
    def __init__(self) -> None:
        self.requests: list[dict] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _handle(self, method: str) -> None:
                url = urlparse(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:  # e.g. a multipart upload: keep the text
                    body = raw.decode(errors="replace")
                query = parse_qs(url.query)
                recorder.requests.append({"method": method, "path": url.path, "query": query, "body": body})
                code, out, ctype = recorder.answer(method, url.path, query, body)
                data = out.encode() if isinstance(out, str) else json.dumps(out).encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

            def do_DELETE(self):
                self._handle("DELETE")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def answer(self, method: str, path: str, query: dict, body) -> tuple[int, dict | str, str]:
        raise NotImplementedError

    def stop_extra(self) -> None:
        """What a subclass started besides the server."""

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_extra()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
