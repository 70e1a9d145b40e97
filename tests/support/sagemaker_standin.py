"""A loopback stand-in for the SageMaker runtime API, forwarding to a running server.

moto's sagemaker-runtime answers a canned body and 404s the streaming call, so the tests
point boto3 (and the SDK's clients) at this instead: `AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME=
standin.url`. It speaks the REST protocol of the two invoke calls the way SageMaker does:

  POST /endpoints/<name>/invocations                  -> the container's POST /invocations
  POST /endpoints/<name>/invocations-response-stream  -> the same, its body re-sent as AWS
       event-stream frames (`PayloadPart`, one per chunk read from the container)

A container answer other than 2xx becomes `ModelError` (HTTP 424, with OriginalStatusCode
and OriginalMessage), a connection lost mid-stream an exception frame `ModelStreamError`,
and an unknown endpoint `ValidationError` (400), as in SageMaker. Every request is recorded
(`standin.requests`), so a test can count how often a generation was sent.

`moto_session()` gives a boto3 session for moto's SageMaker on which sagemaker-core works:
moto answers `VpcConfig: {}` / `DataCaptureConfig: {}` where SageMaker leaves the members
out, and sagemaker-core's models reject the empty structures.
"""
from __future__ import annotations

import binascii
import http.client
import http.server
import json
import struct
import sys
import threading
import urllib.parse

_STRING = 7  # event-stream header value type


def encode_event(headers: dict[str, str], payload: bytes) -> bytes:
    """One AWS event-stream message: prelude (total length, headers length, CRC32 of the
    two), headers (name length u8, name, type u8, value length u16, value), payload, and
    the CRC32 of everything before it."""
    raw_headers = b""
    for name, value in headers.items():
        n, v = name.encode(), value.encode()
        raw_headers += struct.pack("!B", len(n)) + n + struct.pack("!BH", _STRING, len(v)) + v
    total = 12 + len(raw_headers) + len(payload) + 4
    prelude = struct.pack("!II", total, len(raw_headers))
    prelude += struct.pack("!I", binascii.crc32(prelude))
    message = prelude + raw_headers + payload
    return message + struct.pack("!I", binascii.crc32(message))


def payload_part(data: bytes) -> bytes:
    return encode_event({":event-type": "PayloadPart", ":content-type": "application/octet-stream",
                         ":message-type": "event"}, data)


def stream_error(message: str, code: str = "StreamBroken") -> bytes:
    return encode_event({":exception-type": "ModelStreamError", ":content-type": "application/json",
                         ":message-type": "exception"},
                        json.dumps({"Message": message, "ErrorCode": code}).encode())


class RuntimeStandIn:
    """`RuntimeStandIn({"endpoint-name": "http://127.0.0.1:PORT"})`; `.url`, `.requests`,
    `.stop()`; also a context manager."""

    def __init__(self, endpoints: dict[str, str], timeout: float = 600):
        self.endpoints = {name: urllib.parse.urlsplit(url) for name, url in endpoints.items()}
        self.timeout = timeout
        self.requests: list[dict] = []
        standin = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                standin._handle(self)

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that gave up
                    super().handle_error(request, client_address)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()

    # -- protocol ---------------------------------------------------------------------
    @staticmethod
    def _send(h, status: int, body: bytes, headers: dict[str, str]):
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _error(self, h, status: int, error_type: str, message: str, **extra):
        self._send(h, status, json.dumps({"message": message, **extra}).encode(),
                   {"Content-Type": "application/json", "x-amzn-ErrorType": error_type,
                    "x-amzn-RequestId": "standin"})

    def _model_error(self, h, name: str, status: int, body: bytes):
        text = body.decode(errors="replace")
        kind = "client" if status < 500 else "server"
        self._error(h, 424, "ModelError",
                    f'Received {kind} error ({status}) from primary with message "{text}". See '
                    f"/aws/sagemaker/Endpoints/{name} in account 123456789012 for more information.",
                    OriginalStatusCode=status, OriginalMessage=text,
                    LogStreamArn=f"arn:aws:logs:us-east-1:123456789012:log-group:/aws/sagemaker/Endpoints/{name}")

    def _handle(self, h):
        path = urllib.parse.urlsplit(h.path).path
        parts = path.strip("/").split("/")
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        stream = parts[-1:] == ["invocations-response-stream"]
        if len(parts) != 3 or parts[0] != "endpoints" or parts[2] not in ("invocations",
                                                                         "invocations-response-stream"):
            return self._error(h, 404, "UnknownOperationException", f"no operation at {path}")
        name = urllib.parse.unquote(parts[1])
        accept = h.headers.get("X-Amzn-SageMaker-Accept" if stream else "Accept")
        content_type = h.headers.get("Content-Type", "application/octet-stream")
        self.requests.append({"endpoint": name, "stream": stream, "body": body,
                              "content_type": content_type, "accept": accept})
        target = self.endpoints.get(name)
        if target is None:
            return self._error(h, 400, "ValidationError",
                               f"Endpoint {name} of account 123456789012 not found.")
        conn = http.client.HTTPConnection(target.hostname, target.port, timeout=self.timeout)
        headers = {"Content-Type": content_type}
        if accept:
            headers["Accept"] = accept
        try:
            conn.request("POST", "/invocations", body=body, headers=headers)
            resp = conn.getresponse()
        except OSError as e:
            conn.close()
            return self._model_error(h, name, 502, f"cannot reach the container: {e}".encode())
        try:
            if not 200 <= resp.status < 300:
                return self._model_error(h, name, resp.status, resp.read())
            ctype = resp.headers.get("Content-Type", "application/octet-stream")
            common = {"x-Amzn-Invoked-Production-Variant": "AllTraffic", "x-amzn-RequestId": "standin"}
            if not stream:
                return self._send(h, 200, resp.read(), {"Content-Type": ctype, **common})
            h.send_response(200)
            for k, v in {"Content-Type": "application/vnd.amazon.eventstream",
                         "X-Amzn-SageMaker-Content-Type": ctype, "Transfer-Encoding": "chunked",
                         **common}.items():
                h.send_header(k, v)
            h.end_headers()

            def chunk(data: bytes):
                h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                h.wfile.flush()

            try:
                while data := resp.read1(65536):
                    chunk(payload_part(data))
            except (OSError, http.client.HTTPException) as e:
                chunk(stream_error(f"the container closed the stream: {type(e).__name__}"))
            h.wfile.write(b"0\r\n\r\n")
        finally:
            conn.close()


def _drop_empty_structures(parsed, **_):
    for key in [k for k, v in parsed.items() if v == {} and k != "ResponseMetadata"]:
        del parsed[key]


def moto_session(region: str = "us-east-1"):
    """A boto3 session whose SageMaker answers lose moto's empty structures."""
    import boto3

    session = boto3.session.Session(region_name=region)
    session.events.register("after-call.sagemaker", _drop_empty_structures)
    return session


def smoothed_init():
    """A boto3 Session.__init__ that registers the same handler, for code that builds its
    own sessions (the CLI, a notebook kernel): install it with monkeypatch.setattr(
    boto3.session.Session, "__init__", smoothed_init())."""
    import boto3.session

    original = boto3.session.Session.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.events.register("after-call.sagemaker", _drop_empty_structures)
    return init
