"""The durable broker's store answers only requests signed with its key pair (streams.s3_store): the SigV4 maths
against AWS's published example, then the real store process against unsigned, forged and tampered requests."""

from __future__ import annotations

import hashlib
import urllib.error
import urllib.request
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from dvi.procs import local_post
from streams import s3_store
from streams.broker import BUCKET, LocalS3

# AWS's worked example of a signed GET (Signature Version 4, "Example: GET Object")
AWS_KEY, AWS_SECRET = "AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
AWS_WHEN = datetime(2013, 5, 24, tzinfo=timezone.utc)
AWS_HEADERS = {"host": "examplebucket.s3.amazonaws.com", "range": "bytes=0-9"}
AWS_SIGNATURE = "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"


def test_signatures_match_aws_published_example():
    headers = s3_store.sign(AWS_KEY, AWS_SECRET, "GET", "https://examplebucket.s3.amazonaws.com/test.txt", AWS_HEADERS,
                            now=AWS_WHEN)
    assert headers["x-amz-content-sha256"] == s3_store.EMPTY_SHA256
    assert headers["authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
        f"SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, Signature={AWS_SIGNATURE}")
    assert s3_store.check(AWS_KEY, AWS_SECRET, "GET", "/test.txt", headers, now=AWS_WHEN) is None


def test_query_and_path_sign_alike_however_they_are_spelled():
    url = "http://h/b/a%20key/x~y?prefix=a/b&list-type=2&marker="
    headers = s3_store.sign("k", "s", "GET", url, {"host": "h"})
    for target in ("/b/a%20key/x~y?list-type=2&prefix=a%2Fb&marker=", "/b/a%20key/x%7Ey?marker=&list-type=2&prefix=a/b"):
        assert s3_store.check("k", "s", "GET", target, headers) is None, target


@pytest.mark.parametrize("change, why", [
    (lambda m, t, h: (m, t, h), None),  # the signed request itself
    (lambda m, t, h: (m, t, {k: v for k, v in h.items() if k != "authorization"}), "no AWS4-HMAC-SHA256"),
    (lambda m, t, h: ("DELETE", t, h), "signature"),
    (lambda m, t, h: (m, t.replace("obj", "other"), h), "signature"),
    (lambda m, t, h: (m, t + "?uploads=", h), "signature"),
    (lambda m, t, h: (m, t, {**h, "host": "evil:1"}), "signature"),
    (lambda m, t, h: (m, t, {**h, "x-amz-content-sha256": hashlib.sha256(b"other").hexdigest()}), "signature"),
    (lambda m, t, h: (m, t, {**h, "x-amz-content-sha256": "UNSIGNED-PAYLOAD"}), "UNSIGNED-PAYLOAD"),
    (lambda m, t, h: (m, t, {k: v for k, v in h.items() if k != "host"}), "not sent"),
    (lambda m, t, h: (m, t, {**h, "authorization": h["authorization"].replace("k1/", "k2/")}), "unknown access key"),
], ids=["signed", "unsigned", "other-method", "other-path", "other-query", "other-host", "other-body", "unsigned-body",
        "missing-header", "other-key"])
def test_a_request_that_is_not_the_signed_one_is_refused(change, why):
    signed = s3_store.sign("k1", "secret", "PUT", "http://h/dvi/obj", {"host": "h"}, b"data")
    method, target, headers = change("PUT", "/dvi/obj", signed)
    got = s3_store.check("k1", "secret", method, target, headers)
    if why is None:
        assert got is None, got
    else:
        assert got is not None and why in got, got


def test_a_wrong_secret_or_a_stale_date_is_refused():
    headers = s3_store.sign("k", "secret", "GET", "http://h/", {"host": "h"})
    assert "signature" in s3_store.check("k", "other-secret", "GET", "/", headers)
    old = s3_store.sign("k", "secret", "GET", "http://h/", {"host": "h"}, now=datetime.now(timezone.utc) - timedelta(minutes=20))
    assert "date" in s3_store.check("k", "secret", "GET", "/", old)


def _plain(url: str, method: str, body: bytes | None = None, headers: dict | None = None) -> int:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def _cmdline(path: Path) -> str:
    try:
        return path.read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_the_store_answers_only_its_key_pair(tmp_path):
    with LocalS3(tmp_path / "data") as store:
        obj = tmp_path / "data" / BUCKET / "segment"
        store.request("PUT", f"/{BUCKET}/segment", b"records")
        assert obj.read_bytes() == b"records"
        assert store.request("GET", f"/{BUCKET}/segment") == b"records"
        url = f"{store.endpoint}/{BUCKET}/segment"
        # anonymous, with another key pair, or with a body that is not the signed one: nothing is read or changed
        assert _plain(url, "GET") == 403
        assert _plain(url, "PUT", b"forged") == 403
        assert _plain(url, "DELETE") == 403
        assert _plain(store.endpoint + "/", "OPTIONS", headers={"Origin": "http://evil.example"}) == 403
        forged = s3_store.sign(store.access_key, "not-the-secret", "DELETE", url, {"host": f"127.0.0.1:{store.port}"})
        assert _plain(url, "DELETE", headers=forged) == 403
        signed = s3_store.sign(store.access_key, store.secret, "PUT", url, {"host": f"127.0.0.1:{store.port}"}, b"records")
        with pytest.raises(urllib.error.HTTPError) as refused:
            local_post(url, b"forged!", method="PUT", headers=signed)
        assert refused.value.code == 400
        assert obj.read_bytes() == b"records"
        assert "refused DELETE" in store.log_tail(4000)
        # the key pair is in no process's command line
        assert not [c for c in map(_cmdline, Path("/proc").glob("[0-9]*/cmdline")) if store.secret in c]
    with LocalS3(tmp_path / "data") as again:  # a new start, a new key pair: the old one is worthless
        assert again.secret != store.secret
        assert again.request("GET", f"/{BUCKET}/segment") == b"records"
