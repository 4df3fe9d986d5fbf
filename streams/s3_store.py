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

Listing: Tansu lists a partition's whole `records/` prefix on every fetch, to find the batch holding an offset.
LocalBucket walks and sorts the whole bucket for every page of a listing, so a fetch cost grew with the size of every
topic (10,000 records: about a second a fetch, a few records a second read back). Here a listing walks only the
folder its prefix names (`prefix_root`) and pages with a binary search (`list_page`), and a listing asked again while
its folders are unchanged (`folder_stamp`) is answered from memory (`Listings`, compressed: a listing's body
grows with the partition); what it answers is LocalBucket's.

Expiry: Tansu's S3 engine keeps every batch it is given (its DeleteRecords is not implemented), so the folder, each
fetch's listing and LocalBucket's ETag cache (an entry per object, kept while the process lives) would grow for as
long as the broker runs. `--expire GLOB --expire-after-s N` is an S3 lifecycle rule: every minute (or N/4 s) the
store removes the objects whose path under its folder matches GLOB and that were last written more than N seconds
ago, but never the last in its folder (`expire`), and their ETags from that cache. Which objects are Tansu's records,
and that their names sort in the order they were written, is the caller's knowledge (`streams.broker.records_glob`).
A listing or a read of an object removed meanwhile answers as S3 does for an object deleted then: the listing
leaves it out, the read is a NoSuchKey.

Memory: a thread answers each of Tansu's connections, and glibc gives each thread that meets a locked heap an arena
of its own (up to eight per core), where what it frees stays. In the two-hour soak the store's resident memory crept
up (0.04-0.21 MiB a minute); its mappings showed the main heap and Python's object arenas level once the retention
held the topic steady, and the other threads' malloc arenas rising (five of them, 2 -> 7-9 MiB over the first
25-35 minutes of a start). So the store caps the arenas at start (`dvi.alloc.limit_arenas`, as dvi's other long-running
processes do) and its serving loop gives whole free pages back every `dvi.alloc.RELEASE_EVERY_S` (`StoreServer`).
`benchmarks.bench_store` over 10,000 batches kept 30 s, without and with these: the threads' arenas 9.8 and 3.2 MiB
at the end, the store 35.0 and 31.0 MiB (medians of the second half).
"""

from __future__ import annotations

import argparse
import bisect
import fnmatch
import hashlib
import hmac
import logging
import os
import re
import sys
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta, timezone
from http import HTTPStatus
from http.server import ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit
from xml.etree import ElementTree as ET

from dvi.alloc import RELEASE_EVERY_S, limit_arenas, release_free

ACCESS_VAR, SECRET_VAR = "DVI_S3_ACCESS_KEY", "DVI_S3_SECRET_KEY"
ALGORITHM = "AWS4-HMAC-SHA256"
MAX_SKEW = timedelta(minutes=15)  # AWS's own window for a request's date
DATE_FORMAT = "%Y%m%dT%H%M%SZ"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_AUTH = re.compile(r"AWS4-HMAC-SHA256 Credential=([^,\s]+),\s*SignedHeaders=([a-z0-9;\-]+),\s*Signature=([0-9a-f]{64})")
_HEX64 = re.compile(r"[0-9a-f]{64}")
SETTLE_NS = 1_000_000_000  # a folder changed this recently is listed afresh (see `folder_stamp`)
EXPIRE_EVERY_S = 60.0  # how often expiry looks for objects past their age (a quarter of a rule's age, if shorter)

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


def prefix_root(prefix: str) -> str | None:
    """The folder (relative to the bucket, "" for its root) that holds every key starting with `prefix`; None where
    that folder part is not a plain relative path (`..`, `.`, an empty or absolute part): no key starts so."""
    folder = prefix.rpartition("/")[0]
    if folder and any(part in ("", ".", "..") for part in folder.split("/")):
        return None
    return folder


def bucket_keys(bucket_dir: Path, prefix: str, skip: str) -> list[tuple[str, Path]]:
    """(key, file) of every object under the folder `prefix` names, sorted by the key's bytes (S3's order); files
    whose name starts with `skip` (the store's uploads in progress) are left out."""
    folder = prefix_root(prefix)
    if folder is None:
        return []
    keys = []
    for directory, _, files in os.walk(bucket_dir / folder):
        rel = Path(directory).relative_to(bucket_dir).as_posix()
        rel = "" if rel == "." else rel + "/"
        keys += [(rel + name, Path(directory, name)) for name in files if not name.startswith(skip)]
    keys.sort(key=lambda item: item[0].encode())
    return keys


def folder_stamp(bucket_dir: Path, prefix: str, settle_ns: int = SETTLE_NS, now_ns: int | None = None) -> tuple | None:
    """What changes whenever a key under `prefix`'s folder is added, replaced or removed: the modification times of
    that folder and every folder under it. None (do not trust a remembered listing) where the folder is missing, or
    one of them changed within `settle_ns` of now: a file's time has a coarse clock, so a change in the same tick
    as an earlier one could leave it as it was."""
    folder = prefix_root(prefix)
    if folder is None:
        return None
    now_ns = time.time_ns() if now_ns is None else now_ns
    stamp, todo = [], [str(bucket_dir / folder)]
    try:
        while todo:
            path = todo.pop()
            mtime = os.stat(path).st_mtime_ns
            if now_ns - mtime < settle_ns:
                return None
            stamp.append((path, mtime))
            with os.scandir(path) as entries:
                todo += [e.path for e in entries if e.is_dir(follow_symlinks=False)]
    except OSError:
        return None
    return tuple(sorted(stamp))


class Listings:
    """The bodies of the newest listings answered, each with the folder stamp it was answered under: a listing
    asked again while its folders are unchanged is answered from here (Tansu lists a partition's records on every
    fetch). At most `size` are kept, the least recently used dropped first; each is kept compressed (a page of
    1,000 keys is about 300 KB of XML, a tenth of that compressed)."""

    def __init__(self, size: int = 64):
        self.size, self._lock, self._bodies = size, threading.Lock(), OrderedDict()

    def get(self, key: tuple, stamp: tuple | None) -> bytes | None:
        if stamp is None:
            return None
        with self._lock:
            found = self._bodies.get(key)
            if found is None or found[0] != stamp:
                return None
            self._bodies.move_to_end(key)
        return zlib.decompress(found[1])

    def put(self, key: tuple, stamp: tuple | None, body: bytes) -> None:
        if stamp is None:
            return
        packed = zlib.compress(body, 1)
        with self._lock:
            self._bodies[key] = (stamp, packed)
            self._bodies.move_to_end(key)
            while len(self._bodies) > self.size:
                self._bodies.popitem(last=False)


def list_page(keys: list[tuple[str, Path]], prefix: str, delimiter: str, marker: str, marker_is_prefix: bool,
              max_keys: int) -> tuple[list[tuple[str, Path]], list[str], bool, str]:
    """One page of a listing over `keys` (sorted by bytes): the objects and common prefixes after `marker`, whether it
    is truncated, and the last entry ("K:" key or "P:" prefix, the continuation token's text)."""
    contents: list[tuple[str, Path]] = []
    common_prefixes: list[str] = []
    last_entry, truncated = "", False
    encoded = [k.encode() for k, _ in keys]
    start = max(bisect.bisect_left(encoded, prefix.encode()), bisect.bisect_right(encoded, marker.encode()) if marker else 0)
    for key, path in keys[start:]:
        if not key.startswith(prefix):
            break  # sorted: no later key has the prefix
        if marker and marker_is_prefix and key.startswith(marker):
            continue
        common = ""
        if delimiter and (index := key.find(delimiter, len(prefix))) >= 0:
            common = key[: index + len(delimiter)]
        if common and common_prefixes and common_prefixes[-1] == common:
            continue
        if len(contents) + len(common_prefixes) >= max_keys:
            truncated = max_keys > 0
            break
        if common:
            common_prefixes.append(common)
            last_entry = "P:" + common
        else:
            contents.append((key, path))
            last_entry = "K:" + key
    return contents, common_prefixes, truncated, last_entry


def expiry_rule(pattern: str) -> tuple[str, str]:
    """An expiry glob split into (folders, names): the folders' glob under the store's folder and the glob of the
    names in them. ValueError for a rule that names no file in a folder, or has an empty, `.`, `..` or `**` part."""
    folders, _, names = pattern.rpartition("/")
    if not folders or any(p in ("", ".", "..") or "**" in p for p in pattern.split("/")):
        raise ValueError(f"an expiry glob must be folder/.../name with no empty, '.', '..' or '**' part: {pattern!r}")
    return folders, names


def leading_expired(names: list[str], mtime_ns: Callable[[str], int | None], now_ns: int, after_s: float) -> list[str]:
    """Of a folder's `names` in the order they were written, those that expire: the leading run last written
    (`mtime_ns`; None: gone) more than `after_s` seconds before `now_ns`, up to the first younger one (whose followers
    are younger still: their times are not read), and never the last name (as Kafka never removes a partition's
    active segment: a reader from the beginning still finds the end)."""
    limit, out = now_ns - int(after_s * 1e9), []
    for name in names[:-1]:
        t = mtime_ns(name)
        if t is None:
            continue
        if t >= limit:
            break
        out.append(name)
    return out


def expire(root: Path, pattern: str, after_s: float, forget: Callable[[Path], None] | None = None,
           now_ns: int | None = None) -> list[Path]:
    """One pass of an expiry rule: in each folder under `root` matching the rule's folders (`expiry_rule`), remove the
    files matching its names that `leading_expired` names (names must sort in the order they were written, as
    Tansu's zero-padded offsets do) and return them; `forget(path)` is called for each one removed."""
    folders, names = expiry_rule(pattern)
    now_ns = time.time_ns() if now_ns is None else now_ns
    removed = []
    for folder in sorted(root.glob(folders)):
        try:
            listed = sorted(n for n in os.listdir(folder) if fnmatch.fnmatchcase(n, names))
        except (NotADirectoryError, FileNotFoundError):
            continue

        def mtime_ns(name: str, folder: Path = folder) -> int | None:
            try:
                return (folder / name).stat().st_mtime_ns
            except FileNotFoundError:
                return None

        for name in leading_expired(listed, mtime_ns, now_ns, after_s):
            path = folder / name
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            removed.append(path)
            if forget is not None:
                forget(path)
    return removed


def forget_etag(path: Path) -> None:
    """Drop `path` from LocalBucket's ETag cache: an entry per object written or listed, which LocalBucket never drops
    (not even on a DELETE)."""
    import localbucket  # the `local` extra; imported only where the store runs

    with localbucket._etag_lock:
        localbucket._etag_cache.pop(str(path), None)


def _expire_forever(root: Path, pattern: str, after_s: float) -> None:
    """Expiry passes every EXPIRE_EVERY_S (a quarter of a shorter rule's age). Each pass forgets again the ETags of the
    files the pass before removed: a listing that was reading one of them as it went may have cached it again."""
    every, before = min(EXPIRE_EVERY_S, after_s / 4), []
    while True:
        time.sleep(every)
        try:
            for path in before:
                forget_etag(path)
            before = expire(root, pattern, after_s, forget_etag)
            if before:
                log.info("expired %d objects matching %s (last written over %g s ago)", len(before), pattern, after_s)
        except Exception:  # noqa: BLE001 -- the store goes on serving; the next pass tries again
            log.exception("an expiry pass of %s failed", pattern)


def _handler(access_key: str, secret: str):
    """LocalBucket's request handler, answering only requests `check` accepts."""
    import localbucket  # the `local` extra; imported only where the store runs

    listings = Listings()

    class SignedS3Handler(localbucket.S3Handler):
        # headers and body go out in two writes: with Nagle's algorithm each answer waited for the client's delayed
        # ACK (about 40 ms a request, most of a fetch's time)
        disable_nagle_algorithm = True

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

        def _list_entries(self, bucket_dir: Path, prefix: str, delimiter: str, marker: str, marker_is_prefix: bool,
                          max_keys: int):
            keys = bucket_keys(bucket_dir, prefix, localbucket.TEMP_PREFIX)
            return list_page(keys, prefix, delimiter, marker, marker_is_prefix, max_keys)

        def _list_objects_v2(self, bucket: str):
            stamp = folder_stamp(self._bucket_dir(bucket), self.query.get("prefix", ""))  # taken before the listing
            key = (bucket, tuple(sorted(self.query.items())))
            if (body := listings.get(key, stamp)) is not None:
                self._send(HTTPStatus.OK, body, {"Content-Type": "application/xml"})
                return
            self._xml = None
            super()._list_objects_v2(bucket)
            if self._xml is not None:
                listings.put(key, stamp, self._xml)

        def _add_list_entries(self, root, contents, common_prefixes, encode):
            # LocalBucket's, but an object removed after the walk (by expiry) is left out, as S3 may leave out one
            # deleted while it lists, instead of failing the listing
            for key, path in contents:
                try:
                    stat, etag = path.stat(), localbucket.object_etag(path)
                except FileNotFoundError:
                    continue
                item = ET.SubElement(root, "Contents")
                localbucket.sub_element(item, "Key", encode(key))
                localbucket.sub_element(item, "LastModified", localbucket.iso_timestamp(stat.st_mtime))
                localbucket.sub_element(item, "ETag", f'"{etag}"')
                localbucket.sub_element(item, "Size", str(stat.st_size))
                localbucket.sub_element(item, "StorageClass", "STANDARD")
            for common in common_prefixes:
                localbucket.sub_element(ET.SubElement(root, "CommonPrefixes"), "Prefix", encode(common))

        def _get(self, bucket: str, key: str, include_body: bool):
            try:
                super()._get(bucket, key, include_body)
            except FileNotFoundError:  # removed by expiry between LocalBucket's open and its ETag: as if before
                raise localbucket.S3Error(HTTPStatus.NOT_FOUND, "NoSuchKey", "The specified key does not exist.") from None

        def _send_xml(self, root):
            self._xml = ET.tostring(root, encoding="UTF-8", xml_declaration=True)
            self._send(HTTPStatus.OK, self._xml, {"Content-Type": "application/xml"})

        def _read_body(self) -> bytes:
            body = super()._read_body()
            if hashlib.sha256(body).hexdigest() != self.headers.get("x-amz-content-sha256", ""):
                raise localbucket.S3Error(HTTPStatus.BAD_REQUEST, "XAmzContentSHA256Mismatch",
                                          "the body's sha256 is not the one the request states")
            return body

    return SignedS3Handler


class StoreServer(ThreadingHTTPServer):
    """LocalBucket's threaded server, giving the C heap's whole free pages back to the system (`release_free`) at most
    every `release_every_s`, from the serving loop's turns between requests (see the module's docstring, Memory)."""

    release_every_s = RELEASE_EVERY_S

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._released = time.monotonic()

    def service_actions(self) -> None:
        if time.monotonic() - self._released >= self.release_every_s:
            release_free()
            self._released = time.monotonic()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m streams.s3_store", description=__doc__.split("\n")[0])
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--expire", metavar="GLOB", help="remove objects whose path under DATA_DIR matches GLOB ...")
    parser.add_argument("--expire-after-s", type=float, metavar="N", help="... once last written more than N seconds ago")
    args = parser.parse_args(argv)
    if (args.expire is None) != (args.expire_after_s is None) or (args.expire_after_s is not None and args.expire_after_s <= 0):
        print("s3_store: --expire GLOB and --expire-after-s N (> 0) go together", file=sys.stderr)
        return 2
    if args.expire is not None:
        try:
            expiry_rule(args.expire)
        except ValueError as e:
            print(f"s3_store: --expire: {e}", file=sys.stderr)
            return 2
    access_key, secret = os.environ.pop(ACCESS_VAR, ""), os.environ.pop(SECRET_VAR, "")
    if not access_key or not secret:
        print(f"s3_store: set {ACCESS_VAR} and {SECRET_VAR} in the environment", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)  # its refusals (WARNING) and what expiry removed (a line a pass at most)
    handler = _handler(access_key, secret)
    handler.data_root = args.data_dir.resolve()
    limit_arenas()  # before the first request's thread (see the module's docstring, Memory)
    server = StoreServer((args.host, args.port), handler)
    if args.expire:
        threading.Thread(target=_expire_forever, args=(handler.data_root, args.expire, args.expire_after_s),
                         name="expiry", daemon=True).start()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
