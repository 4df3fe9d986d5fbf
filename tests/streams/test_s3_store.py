"""The durable broker's store answers only requests signed with its key pair (streams.s3_store): the SigV4 maths
against AWS's published example, then the real store process against unsigned, forged and tampered requests."""

from __future__ import annotations

import hashlib
import os
import time
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


def _tree(root: Path) -> None:
    """A bucket like Tansu's: partitions of numbered batches, a watermark each, nested folders and an upload in
    progress."""
    for topic in ("t", "t.dlq", "u"):
        for p in range(3):
            part = root / "clusters" / "c" / "topics" / topic / "partitions" / f"{p:010d}"
            (part / "records").mkdir(parents=True)
            (part / "watermark.json").write_text("{}")
            for offset in range(0, 40, 3):
                (part / "records" / f"{offset:020d}.batch").write_bytes(b"x")
    (root / "clusters" / "c" / "meta.json").write_text("{}")
    (root / "clusters" / "c" / "topics" / "t" / "partitions" / f"{0:010d}" / "records" / ".localbucket-tmp").write_text("")
    (root / "a-b").write_text("")
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "c").write_text("")


@pytest.mark.parametrize("prefix", ["", "clusters/", "clusters/c/topics/t", "clusters/c/topics/t/",
                                    f"clusters/c/topics/t/partitions/{1:010d}/records/", "clusters/c/topics/t/partitions/00",
                                    "a", "a/", "a/b/c", "nothing/", "../", "/etc/", "clusters//c/", "./clusters/"])
def test_a_listing_answers_what_localbucket_answers(tmp_path, prefix):
    """The store walks only the prefix's folder; every page (with and without a delimiter, after a key or a common
    prefix, any page size) is the one LocalBucket's own walk of the whole bucket gives."""
    import localbucket

    _tree(tmp_path)
    keys = s3_store.bucket_keys(tmp_path, prefix, localbucket.TEMP_PREFIX)
    everything = [k for k, _ in s3_store.bucket_keys(tmp_path, "", localbucket.TEMP_PREFIX)]
    markers = ["", prefix, everything[len(everything) // 2], everything[-1], prefix + "zzz", "clusters/c/"]
    for delimiter in ("", "/"):
        for marker in markers:
            for marker_is_prefix in (False, True):
                for max_keys in (0, 1, 7, 1000):
                    args = (prefix, delimiter, marker, marker_is_prefix, max_keys)
                    want = localbucket.S3Handler._list_entries(None, tmp_path, *args)
                    assert s3_store.list_page(keys, *args) == want, args


def test_paging_a_partitions_records_reads_every_batch_once(tmp_path):
    """Tansu's fetch: a partition's records, page after page by continuation, in offset order."""
    import localbucket

    _tree(tmp_path)
    prefix = f"clusters/c/topics/t/partitions/{0:010d}/records/"
    keys = s3_store.bucket_keys(tmp_path, prefix, localbucket.TEMP_PREFIX)
    seen, marker = [], ""
    while True:
        contents, _, truncated, last = s3_store.list_page(keys, prefix, "", marker, False, 4)
        seen += [k for k, _ in contents]
        if not truncated:
            break
        marker = last[2:]
    assert seen == [f"{prefix}{o:020d}.batch" for o in range(0, 40, 3)]


def test_a_folder_stamp_changes_with_every_key_and_is_withheld_while_the_folder_is_fresh(tmp_path):
    _tree(tmp_path)
    prefix = f"clusters/c/topics/t/partitions/{1:010d}/records/"
    later = time.time_ns() + 10 * s3_store.SETTLE_NS
    before = s3_store.folder_stamp(tmp_path, prefix, now_ns=later)
    assert before is not None and s3_store.folder_stamp(tmp_path, prefix, now_ns=later) == before
    (tmp_path / prefix / f"{99:020d}.batch").write_bytes(b"x")
    assert s3_store.folder_stamp(tmp_path, prefix) is None  # just changed: not to be trusted yet
    assert s3_store.folder_stamp(tmp_path, prefix, now_ns=later) not in (None, before)
    # a change below the prefix's folder changes its stamp too
    whole = s3_store.folder_stamp(tmp_path, "clusters/", now_ns=later)
    os.utime(tmp_path / prefix, ns=(later, later))
    assert s3_store.folder_stamp(tmp_path, "clusters/", now_ns=later + s3_store.SETTLE_NS) != whole
    for nothing in ("missing/", "../", "/etc/", "a//b/"):
        assert s3_store.folder_stamp(tmp_path, nothing, now_ns=later) is None


def test_remembered_listings_answer_only_their_stamp_and_keep_the_newest():
    listings = s3_store.Listings(size=2)
    listings.put(("b", "q1"), ("s1",), b"one")
    listings.put(("b", "q2"), None, b"unsettled")  # no stamp: not kept
    assert listings.get(("b", "q1"), ("s1",)) == b"one"
    assert listings.get(("b", "q1"), ("s2",)) is None and listings.get(("b", "q1"), None) is None
    assert listings.get(("b", "q2"), None) is None
    listings.put(("b", "q2"), ("s1",), b"two")
    assert listings.get(("b", "q1"), ("s1",)) == b"one"  # used: the newest
    listings.put(("b", "q3"), ("s1",), b"three")  # one too many: the least recently used goes
    assert listings.get(("b", "q2"), ("s1",)) is None and listings.get(("b", "q1"), ("s1",)) == b"one"


def test_the_store_answers_a_listing_again_from_memory_until_its_folder_changes(tmp_path):
    """A key removed behind the store's back, its folder's time put back, is still listed: that answer came from
    memory. A PUT changes the folder: the next listing is fresh."""
    with LocalS3(tmp_path / "data") as store:
        folder = tmp_path / "data" / BUCKET / "p" / "records"
        for name in ("1", "2"):
            store.request("PUT", f"/{BUCKET}/p/records/{name}", b"batch")

        def listing() -> bytes:
            return store.request("GET", f"/{BUCKET}?list-type=2&prefix=p%2Frecords%2F")

        settled = time.time_ns() - 10 * s3_store.SETTLE_NS
        os.utime(folder, ns=(settled, settled))
        assert b"p/records/1" in listing() and b"p/records/2" in listing()
        (folder / "2").unlink()
        os.utime(folder, ns=(settled, settled))
        assert b"p/records/2" in listing()  # remembered
        store.request("PUT", f"/{BUCKET}/p/records/3", b"batch")
        fresh = listing()
        assert b"p/records/3" in fresh and b"p/records/2" not in fresh and b"p/records/1" in fresh


def _leading_reference(names, times, now_ns, after_s):
    """`leading_expired` spelled out: every name but the last, taken while old enough, skipping gone ones."""
    out = []
    for name in names[:-1]:
        if times.get(name) is None:
            continue
        if (now_ns - times[name]) / 1e9 <= after_s:
            break
        out.append(name)
    return out


@pytest.mark.parametrize("ages", [[100, 90, 61, 60, 1], [100, 100, 100], [5, 100, 100], [100, None, 100, 1], [100], []])
def test_expiry_takes_the_leading_old_names_and_never_the_last(ages):
    now = 10_000 * 10**9
    names = [f"{i:020d}.batch" for i in range(len(ages))]
    times = {n: None if a is None else now - a * 10**9 for n, a in zip(names, ages)}
    read = []

    def mtime(name):
        read.append(name)
        return times[name]

    got = s3_store.leading_expired(names, mtime, now, 60)
    assert got == _leading_reference(names, times, now, 60)
    assert names[-1] not in got if names else got == []
    assert len(read) <= len(got) + sum(a is None for a in ages) + 1  # no time read past the first young one


def test_an_expiry_rule_names_files_in_folders():
    assert s3_store.expiry_rule("dvi/clusters/*/topics/t/partitions/*/records/*.batch") == (
        "dvi/clusters/*/topics/t/partitions/*/records", "*.batch")
    for bad in ("*.batch", "a//b", "a/../b", "a/**/b", "./a/b", "a/b/"):
        with pytest.raises(ValueError, match="expiry glob"):
            s3_store.expiry_rule(bad)


def test_expiry_removes_old_batches_and_forgets_their_etags(tmp_path):
    """A pass over a tree like Tansu's: the topic's old batches go (and LocalBucket's cached ETag of each), up to the
    first young one of each partition and never its last; the watermarks, other topics and uploads stay."""
    import localbucket

    _tree(tmp_path / "dvi")
    parts = tmp_path / "dvi" / "clusters" / "c" / "topics" / "t" / "partitions"
    old = time.time_ns() - 3600 * 10**9
    everything = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    for path in everything:
        os.utime(path, ns=(old, old))
    young = parts / f"{1:010d}" / "records" / f"{21:020d}.batch"  # partition 1 stops at offset 21
    os.utime(young, None)
    for path in everything:
        localbucket.object_etag(path)
    gone = s3_store.expire(tmp_path, "dvi/clusters/*/topics/t/partitions/*/records/*.batch", 60, s3_store.forget_etag)
    kept = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert sorted(gone) == sorted(set(everything) - set(kept))
    batches = {p: sorted(q.name for q in (parts / f"{p:010d}" / "records").glob("*.batch")) for p in range(3)}
    assert batches == {0: [f"{39:020d}.batch"], 1: [f"{o:020d}.batch" for o in range(21, 40, 3)], 2: [f"{39:020d}.batch"]}
    assert all(p.suffix == ".batch" and "/topics/t/" in p.as_posix() for p in gone)
    assert parts / f"{0:010d}" / "records" / ".localbucket-tmp" in kept
    assert not [p for p in gone if str(p) in localbucket._etag_cache]
    assert all(str(p) in localbucket._etag_cache for p in kept)


def test_the_stores_own_etags_are_forgotten_and_a_removed_object_is_no_error(tmp_path):
    """The handler itself, in this process: objects written and listed through it, expired, are gone from its ETag
    cache (the keys are the ones it stored); a listing leaves out, and a read answers NoSuchKey for, an object
    removed behind it."""
    import threading
    from http.server import ThreadingHTTPServer

    import localbucket

    handler = s3_store._handler("k", "secret")
    handler.data_root = (tmp_path / "data").resolve()
    (handler.data_root / BUCKET).mkdir(parents=True)
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"

    def call(method: str, path: str, body: bytes = b"") -> bytes:
        url = base + path
        return local_post(url, body, method=method, headers=s3_store.sign("k", "secret", method, url,
                                                                          {"host": url.split("/")[2]}, body))

    try:
        for i in range(4):
            call("PUT", f"/{BUCKET}/p/records/{i:020d}.batch", b"batch%d" % i)
        listing = call("GET", f"/{BUCKET}?list-type=2&prefix=p%2Frecords%2F")
        assert listing.count(b"<Contents>") == 4
        folder = handler.data_root / BUCKET / "p" / "records"
        cached = {k for k in localbucket._etag_cache if k.startswith(str(folder))}
        assert len(cached) == 4
        gone = s3_store.expire(handler.data_root, f"{BUCKET}/p/records/*.batch", 60, s3_store.forget_etag,
                               now_ns=time.time_ns() + 3600 * 10**9)
        assert len(gone) == 3 and not {k for k in localbucket._etag_cache if k.startswith(str(folder))} - {str(folder / f"{3:020d}.batch")}
        assert call("GET", f"/{BUCKET}?list-type=2&prefix=p%2Frecords%2F").count(b"<Contents>") == 1
        with pytest.raises(urllib.error.HTTPError) as missing:
            call("GET", f"/{BUCKET}/p/records/{0:020d}.batch")
        assert missing.value.code == 404
        entries = [(f"p/records/{i:020d}.batch", folder / f"{i:020d}.batch") for i in (2, 3)]
        root = s3_store.ET.Element("ListBucketResult")
        handler._add_list_entries(None, root, entries, [], lambda k: k)  # the one at offset 2 is gone: left out
        assert [e.findtext("Key") for e in root.iter("Contents")] == [f"p/records/{3:020d}.batch"]
    finally:
        server.shutdown()
        server.server_close()


def test_the_server_gives_free_heap_pages_back_at_most_once_an_interval(monkeypatch):
    released = []
    monkeypatch.setattr(s3_store, "release_free", lambda: released.append(time.monotonic()) or True)
    server = s3_store.StoreServer(("127.0.0.1", 0), s3_store._handler("k", "secret"))
    try:
        server.release_every_s = 3600.0
        for _ in range(5):
            server.service_actions()
        assert released == []  # within the interval since the server started
        server.release_every_s = 0.0
        server.service_actions()
        server.service_actions()
        assert len(released) == 2
        server.release_every_s = 3600.0
        server.service_actions()
        assert len(released) == 2  # the interval counts from the last release
    finally:
        server.server_close()
