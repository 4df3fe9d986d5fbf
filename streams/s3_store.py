"""The durable embedded broker's store: LocalBucket (a small S3-compatible server on a folder) behind AWS Signature V4.

LocalBucket checks no credentials, so any local process could PUT or DELETE the broker's segments. Here its request
handler answers only requests signed (AWS SigV4, header form) with the store's secret key: the signature must match,
its date be within 15 minutes of now, and the body must have the sha256 the request signs (Tansu signs every body).
Anything else, presigned URLs, unsigned and streaming bodies included, is a 403 (a body hash that does not match, a 400), logged at
WARNING, and the connection is closed. CORS preflights are refused (the store serves no web page).

`python -m streams.s3_store DATA_DIR --port N` runs it; the key pair comes from the environment (ACCESS_VAR,
SECRET_VAR), never the command line. `streams.broker.LocalS3` makes a fresh key pair at every start and hands
it to Tansu as AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY. `sign` and `check` are the pure SigV4 maths; this
module knows S3 requests, not what Tansu keeps in them.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
import os
import re
import sys
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from http import HTTPStatus
from http.server import ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

ACCESS_VAR, SECRET_VAR = "DVI_S3_ACCESS_KEY", "DVI_S3_SECRET_KEY"
ALGORITHM = "AWS4-HMAC-SHA256"
MAX_SKEW = timedelta(minutes=15)  # AWS's own window for a request's date
DATE_FORMAT = "%Y%m%dT%H%M%SZ"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_AUTH = re.compile(r"AWS4-HMAC-SHA256 Credential=([^,\s]+),\s*SignedHeaders=([a-z0-9;\-]+),\s*Signature=([0-9a-f]{64})")
_HEX64 = re.compile(r"[0-9a-f]{64}")

log = logging.getLogger("dvi.s3_store")


def _enc(text: str, safe: str = "") -> str:
    return quote(text, safe="-_.~" + safe)


def canonical_request(method: str, path: str, query: str, headers: Mapping[str, str], signed: list[str],
                      payload_hash: str) -> str:
    """SigV4's canonical request. `path` and `query` as sent (percent-encoded); they are decoded and encoded again
    the AWS way (S3: once, `/` kept), so two spellings of one URL sign alike."""
    pairs = []
    for item in filter(None, query.split("&")):
        name, _, value = item.partition("=")
        pairs.append((_enc(unquote(name)), _enc(unquote(value))))
    canonical_headers = "".join(f"{name}:{' '.join(headers[name].split())}\n" for name in signed)
    return "\n".join([method, _enc(unquote(path) or "/", safe="/"), "&".join(f"{k}={v}" for k, v in sorted(pairs)),
                      canonical_headers, ";".join(signed), payload_hash])


def signature(secret: str, amz_date: str, scope: str, canonical: str) -> str:
    """The hex signature of a canonical request: HMAC-SHA256 chained over the scope's date, region, service and
    terminator, then over the string to sign."""
    key = ("AWS4" + secret).encode()
    for part in scope.split("/"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    to_sign = "\n".join([ALGORITHM, amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    return hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()


def sign(access_key: str, secret: str, method: str, url: str, headers: Mapping[str, str], payload: bytes = b"",
         now: datetime | None = None, region: str = "us-east-1") -> dict[str, str]:
    """The headers that sign a request (x-amz-date, x-amz-content-sha256, Authorization): what dvi's own calls to
    the store send. `headers` are the other headers to sign, `host` among them."""
    amz_date = (now or datetime.now(timezone.utc)).strftime(DATE_FORMAT)
    scope = f"{amz_date[:8]}/{region}/s3/aws4_request"
    out = {**{k.lower(): v for k, v in headers.items()}, "x-amz-date": amz_date,
           "x-amz-content-sha256": hashlib.sha256(payload).hexdigest()}
    signed = sorted(out)
    parts = urlsplit(url)
    canonical = canonical_request(method, parts.path, parts.query, out, signed, out["x-amz-content-sha256"])
    out["authorization"] = (f"{ALGORITHM} Credential={access_key}/{scope}, SignedHeaders={';'.join(signed)}, "
                            f"Signature={signature(secret, amz_date, scope, canonical)}")
    return out


def check(access_key: str, secret: str, method: str, target: str, headers: Mapping[str, str],
          now: datetime | None = None) -> str | None:
    """Why a request is not signed with this key pair, or None when it is. `target` is the request line's path and
    query; `headers` are looked up by lower-case name."""
    auth = _AUTH.fullmatch(headers.get("authorization", "").strip())
    if auth is None:
        return "no AWS4-HMAC-SHA256 Authorization header"
    credential, signed_list, given = auth.groups()
    key_id, _, scope = credential.partition("/")
    scope_parts = scope.split("/")
    if not hmac.compare_digest(key_id.encode(), access_key.encode()):
        return "an unknown access key"
    if len(scope_parts) != 4 or scope_parts[2:] != ["s3", "aws4_request"]:
        return f"a credential scope that is not <date>/<region>/s3/aws4_request: {scope[:80]!r}"
    signed = signed_list.split(";")
    if "host" not in signed or signed != sorted(set(signed)):
        return "signed headers that leave out host or are not sorted"
    missing = [name for name in signed if name not in headers]
    if missing:
        return f"signed headers that are not sent: {missing}"
    amz_date, payload_hash = headers.get("x-amz-date", ""), headers.get("x-amz-content-sha256", "")
    if "x-amz-date" not in signed:
        return "an unsigned x-amz-date"
    try:
        when = datetime.strptime(amz_date, DATE_FORMAT).replace(tzinfo=timezone.utc)
    except ValueError:
        return f"an x-amz-date that is not {DATE_FORMAT}: {amz_date[:40]!r}"
    if abs((now or datetime.now(timezone.utc)) - when) > MAX_SKEW or scope_parts[0] != amz_date[:8]:
        return f"a date outside {MAX_SKEW} of now, or not the credential's: {amz_date}"
    if not _HEX64.fullmatch(payload_hash) or "x-amz-content-sha256" not in signed:
        return f"no signed sha256 of the body (UNSIGNED-PAYLOAD and streaming are refused): {payload_hash[:40]!r}"
    path, _, query = target.partition("?")
    canonical = canonical_request(method, path, query, headers, signed, payload_hash)
    if not hmac.compare_digest(signature(secret, amz_date, scope, canonical), given):
        return "a signature that does not match"
    return None


def _handler(access_key: str, secret: str):
    """LocalBucket's request handler, answering only requests `check` accepts."""
    import localbucket  # the `local` extra; imported only where the store runs

    class SignedS3Handler(localbucket.S3Handler):
        def _dispatch(self, action):
            headers = {name.lower(): value for name, value in self.headers.items()}
            why = check(access_key, secret, self.command, self.path, headers)
            if why is not None:
                log.warning("refused %s %s from %s: %s", self.command, self.path[:200], self.client_address[0], why)
                self.close_connection = True  # its body is left unread
                self._send_error(localbucket.S3Error(HTTPStatus.FORBIDDEN, "AccessDenied", f"refused: {why}"))
                return
            super()._dispatch(action)

        def do_OPTIONS(self):
            self.close_connection = True
            self._send_error(localbucket.S3Error(HTTPStatus.FORBIDDEN, "AccessDenied", "no cross-origin access"))

        def _read_body(self) -> bytes:
            body = super()._read_body()
            if hashlib.sha256(body).hexdigest() != self.headers.get("x-amz-content-sha256", ""):
                raise localbucket.S3Error(HTTPStatus.BAD_REQUEST, "XAmzContentSHA256Mismatch",
                                          "the body's sha256 is not the one the request states")
            return body

    return SignedS3Handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m streams.s3_store", description=__doc__.split("\n")[0])
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    access_key, secret = os.environ.pop(ACCESS_VAR, ""), os.environ.pop(SECRET_VAR, "")
    if not access_key or not secret:
        print(f"s3_store: set {ACCESS_VAR} and {SECRET_VAR} in the environment", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler = _handler(access_key, secret)
    handler.data_root = args.data_dir.resolve()
    server = ThreadingHTTPServer((args.host, args.port), handler)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
