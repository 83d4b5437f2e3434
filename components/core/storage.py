"""Local paths and s3:// URIs through one API.

boto3 does the S3 work (its "standard" retry mode retries throttling and 5xx with exponential
backoff and jitter); this module adds what boto3 does not: one call shape for local and S3, and
atomic directory uploads. A directory is complete only once its manifest (`_MANIFEST.json`: every
file with its size and sha256) is written, last; `get_dir` refuses a directory without one and
checks every file against it. Credentials come only from the environment (boto3's chain: env vars,
IRSA/web identity); the endpoint from `AWS_ENDPOINT_URL` or `MLFLOW_S3_ENDPOINT_URL` (MinIO, moto).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

MANIFEST = "_MANIFEST.json"

__all__ = [
    "MANIFEST",
    "IncompleteDirectoryError",
    "StorageError",
    "exists",
    "get_dir",
    "get_file",
    "is_s3",
    "join",
    "get_listed_dir",
    "list_objects",
    "list_uris",
    "open_byte_lines",
    "put_dir",
    "put_file",
    "read_bytes",
    "read_text",
    "split_s3",
    "staged_dir",
    "write_bytes",
    "write_text",
]


class StorageError(RuntimeError):
    pass


class IncompleteDirectoryError(StorageError):
    """A directory without a manifest (an upload that did not finish), or whose files disagree with it."""


def is_s3(uri: str | os.PathLike) -> bool:
    return str(uri).startswith("s3://")


def split_s3(uri: str) -> tuple[str, str]:
    if not is_s3(uri):
        raise StorageError(f"{uri!r}: expected an s3://bucket/key URI")
    rest = uri[len("s3://"):]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise StorageError(f"{uri!r}: missing bucket name")
    return bucket, key


def join(base: str | os.PathLike, *parts: str) -> str:
    base = str(base)
    if is_s3(base):
        out = base.rstrip("/")
        for p in parts:
            out += "/" + p.strip("/")
        return out
    return str(Path(base, *parts))


# ------------------------------------------------------------------------------------------
# S3 client
# ------------------------------------------------------------------------------------------
def endpoint_url() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or os.environ.get(
        "MLFLOW_S3_ENDPOINT_URL"
    ) or None


def max_attempts() -> int:
    return int(os.environ.get("AGENTRL_S3_MAX_ATTEMPTS", "8"))


@lru_cache(maxsize=8)
def _client(endpoint: str | None, attempts: int, pid: int):
    import boto3
    from botocore.config import Config

    cfg = Config(
        retries={"max_attempts": attempts, "mode": "standard"},
        connect_timeout=5,
        read_timeout=60,
        # path-style works with MinIO and moto as well as AWS
        s3={"addressing_style": "path"},
    )
    session = boto3.session.Session()
    return session.client("s3", endpoint_url=endpoint, config=cfg)


def s3_client():
    """The S3 client for the current environment (cached per endpoint and process)."""
    return _client(endpoint_url(), max_attempts(), os.getpid())


def _transfer_config():
    from boto3.s3.transfer import TransferConfig

    # one thread: a shared 2-core box gains nothing from more, and order of writes stays simple
    return TransferConfig(multipart_threshold=64 * 1024 * 1024, use_threads=False)


# ------------------------------------------------------------------------------------------
# Files
# ------------------------------------------------------------------------------------------
def _atomic_local_write(dest: Path, data: bytes) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def put_file(local: str | os.PathLike, uri: str) -> None:
    """Copy a local file to `uri` (S3 objects appear whole; local copies are renamed into place)."""
    local = Path(local)
    if is_s3(uri):
        bucket, key = split_s3(uri)
        s3_client().upload_file(str(local), bucket, key, Config=_transfer_config())
        return
    dest = Path(uri)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    os.close(fd)
    try:
        shutil.copyfile(local, tmp)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def get_file(uri: str, local: str | os.PathLike) -> Path:
    local = Path(local)
    local.parent.mkdir(parents=True, exist_ok=True)
    if is_s3(uri):
        bucket, key = split_s3(uri)
        fd, tmp = tempfile.mkstemp(prefix=f".{local.name}.", dir=local.parent)
        os.close(fd)
        try:
            s3_client().download_file(bucket, key, tmp, Config=_transfer_config())
            os.replace(tmp, local)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return local
    if Path(uri).resolve() != local.resolve():
        shutil.copyfile(uri, local)
    return local


def write_bytes(uri: str, data: bytes) -> None:
    if is_s3(uri):
        bucket, key = split_s3(uri)
        s3_client().put_object(Bucket=bucket, Key=key, Body=data)
    else:
        _atomic_local_write(Path(uri), data)


def read_bytes(uri: str) -> bytes:
    if is_s3(uri):
        bucket, key = split_s3(uri)
        try:
            return s3_client().get_object(Bucket=bucket, Key=key)["Body"].read()
        except s3_client().exceptions.NoSuchKey:
            raise FileNotFoundError(uri) from None
    return Path(uri).read_bytes()


def write_text(uri: str, text: str) -> None:
    write_bytes(uri, text.encode("utf-8"))


def read_text(uri: str) -> str:
    return read_bytes(uri).decode("utf-8")


def open_byte_lines(uri: str) -> Iterator[bytes]:
    """Stream the lines of a file (local or S3) as bytes, for readers that decode each line themselves (a bad
    byte is then an error of one line, with its number, not of the file)."""
    if is_s3(uri):
        bucket, key = split_s3(uri)
        try:
            body = s3_client().get_object(Bucket=bucket, Key=key)["Body"]
        except s3_client().exceptions.NoSuchKey:
            raise FileNotFoundError(uri) from None
        try:
            yield from body.iter_lines(keepends=True)
        finally:
            body.close()
        return
    with open(uri, "rb") as fh:
        yield from fh


def exists(uri: str) -> bool:
    if is_s3(uri):
        bucket, key = split_s3(uri)
        from botocore.exceptions import ClientError

        try:
            s3_client().head_object(Bucket=bucket, Key=key)
            return True
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                # maybe a "directory": any key under the prefix
                resp = s3_client().list_objects_v2(Bucket=bucket, Prefix=key.rstrip("/") + "/", MaxKeys=1)
                return resp.get("KeyCount", 0) > 0
            raise
    return Path(uri).exists()


def list_uris(uri: str, recursive: bool = True) -> list[str]:
    """All file URIs under a directory or prefix, sorted."""
    if is_s3(uri):
        bucket, key = split_s3(uri)
        prefix = key.rstrip("/") + "/" if key else ""
        out: list[str] = []
        paginator = s3_client().get_paginator("list_objects_v2")
        kwargs = {"Bucket": bucket, "Prefix": prefix}
        if not recursive:
            kwargs["Delimiter"] = "/"
        for page in paginator.paginate(**kwargs):
            out.extend(f"s3://{bucket}/{o['Key']}" for o in page.get("Contents", []))
        return sorted(out)
    root = Path(uri)
    if root.is_file():
        return [str(root)]
    if not root.exists():
        return []
    if not recursive:
        return sorted(str(p) for p in root.iterdir() if p.is_file())
    # os.walk, not Path.rglob: a writer may rename or remove a directory mid-walk (a checkpoint being published,
    # an old one pruned); rglob then raises FileNotFoundError, os.walk skips what vanished
    return sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files)


def list_objects(uri: str) -> list[dict]:
    """Every file under a directory or prefix with its size (and ETag on S3): `{"path", "size", "etag"}`, paths
    relative to `uri`, sorted. For directories written by any tool (no manifest), e.g. `aws s3 sync` of a model."""
    out: list[dict] = []
    if is_s3(uri):
        bucket, key = split_s3(uri)
        prefix = key.rstrip("/") + "/" if key else ""
        for page in s3_client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for o in page.get("Contents", []):
                if not o["Key"].endswith("/"):  # folder placeholder objects some tools write
                    out.append({"path": o["Key"][len(prefix):], "size": int(o["Size"]), "etag": o.get("ETag", "")})
        return sorted(out, key=lambda e: e["path"])
    root = Path(uri)
    for f in list_uris(uri):
        try:
            size = Path(f).stat().st_size
        except FileNotFoundError:  # removed after the walk saw it (an old checkpoint pruned meanwhile): not there
            continue
        out.append({"path": Path(f).relative_to(root).as_posix(), "size": size, "etag": ""})
    return out


def get_listed_dir(uri: str, entries: list[dict], local_dir: str | os.PathLike) -> Path:
    """Download the listed files of `uri` (from `list_objects`) into `local_dir`, replaced whole; each file's size
    is checked against the listing (an object rewritten meanwhile is an error, not a silent mix)."""
    local_dir = Path(local_dir)
    with staged_dir(local_dir) as staging:
        for e in entries:
            target = staging / e["path"]
            get_file(join(uri, e["path"]), target)
            if target.stat().st_size != e["size"]:
                raise IncompleteDirectoryError(f"{join(uri, e['path'])}: {target.stat().st_size} bytes downloaded, "
                                               f"{e['size']} listed (changed while reading?)")
    return local_dir


def delete(uri: str) -> None:
    """Delete a file or everything under a directory/prefix."""
    if is_s3(uri):
        bucket, key = split_s3(uri)
        keys = [split_s3(u)[1] for u in list_uris(uri)]
        try:
            s3_client().head_object(Bucket=bucket, Key=key)
            keys.append(key)
        except Exception:
            pass
        for i in range(0, len(keys), 1000):
            chunk = keys[i : i + 1000]
            if chunk:
                s3_client().delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in chunk]})
        return
    p = Path(uri)
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()


@contextmanager
def staged_dir(dest: str | os.PathLike) -> Iterator[Path]:
    """A staging directory beside `dest`: on success it replaces `dest` whole (a rename), on error it goes."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        yield staging
        if dest.exists():  # the old directory steps aside first, so a reader never finds `dest` missing
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old.", dir=dest.parent))
            old.rmdir()
            os.replace(dest, old)
            os.replace(staging, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


# ------------------------------------------------------------------------------------------
# Directories: atomic through a manifest written last
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ManifestEntry:
    path: str
    size: int
    sha256: str


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_manifest(local_dir: Path) -> dict:
    files = sorted(p for p in local_dir.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = [
        {"path": p.relative_to(local_dir).as_posix(), "size": p.stat().st_size, "sha256": _sha256(p)}
        for p in files
    ]
    return {"schema": "agentrl/manifest/v1", "created": time.time(), "files": entries}


def put_dir(local_dir: str | os.PathLike, uri: str) -> dict:
    """Upload a directory atomically: any old manifest is removed first, files go up, the manifest last.

    A reader that sees the manifest sees a complete directory; one that sees none refuses it.
    """
    local_dir = Path(local_dir)
    if not local_dir.is_dir():
        raise StorageError(f"{local_dir}: not a directory")
    manifest = build_manifest(local_dir)
    man_uri = join(uri, MANIFEST)
    if is_s3(uri):
        from botocore.exceptions import BotoCoreError, ClientError

        where = f"put_dir {local_dir} -> {uri}{_phase()}"
        bucket, key = split_s3(man_uri)
        try:
            s3_client().delete_object(Bucket=bucket, Key=key)  # no-op when absent
            for e in manifest["files"]:
                put_file(local_dir / e["path"], join(uri, e["path"]))
            # an upload the endpoint acknowledged can still be lost (an endpoint restarted without its data):
            # the manifest goes up only once the listing shows every object at its size
            bad = unverified(uri, manifest["files"])
        except (BotoCoreError, ClientError, OSError) as exc:
            raise StorageError(f"{where}: upload failed, no manifest written ({type(exc).__name__}: {exc})") from exc
        if bad:
            raise IncompleteDirectoryError(f"{where}: {len(bad)} of {len(manifest['files'])} objects missing or of "
                                           f"another size after the upload ({', '.join(bad[:5])}); no manifest written")
        write_text(man_uri, json.dumps(manifest, indent=1))
        return manifest
    # local: build a sibling, then swap it in by rename
    with staged_dir(uri) as staging:
        shutil.copytree(local_dir, staging, dirs_exist_ok=True)
        (staging / MANIFEST).unlink(missing_ok=True)
        _atomic_local_write(staging / MANIFEST, json.dumps(manifest, indent=1).encode())
    return manifest


def read_manifest(uri: str) -> dict:
    try:
        manifest = json.loads(read_text(join(uri, MANIFEST)))
    except FileNotFoundError:
        raise IncompleteDirectoryError(
            f"{uri}: no {MANIFEST} — the upload did not finish (or this is not an agentrl directory)"
        ) from None
    if manifest.get("schema") != "agentrl/manifest/v1":
        raise IncompleteDirectoryError(f"{join(uri, MANIFEST)}: unknown manifest schema {manifest.get('schema')!r}")
    return manifest


def unverified(uri: str, entries: list[dict]) -> list[str]:
    """The manifest entries that the store does not hold at their size (one listing, no download)."""
    listed = {e["path"]: e["size"] for e in list_objects(uri)}
    return [e["path"] for e in entries if listed.get(e["path"]) != e["size"]]


def is_complete(uri: str) -> bool:
    """A manifest, and every file it names present at its size: what checkpoint `latest()` and readers trust."""
    try:
        return not unverified(uri, read_manifest(uri)["files"])
    except IncompleteDirectoryError:
        return False


def _phase() -> str:
    """' (phase grpo)' inside a phase (PhaseRun sets AGENTRL_PHASE), for storage errors."""
    phase = os.environ.get("AGENTRL_PHASE")
    return f" (phase {phase})" if phase else ""


def get_dir(uri: str, local_dir: str | os.PathLike) -> Path:
    """Download (or copy) a complete directory, verifying each file's size and sha256 against the manifest."""
    local_dir = Path(local_dir)
    from botocore.exceptions import ClientError

    manifest = read_manifest(uri)
    with staged_dir(local_dir) as staging:
        for e in manifest["files"]:
            target = staging / e["path"]
            try:
                get_file(join(uri, e["path"]), target)
            except FileNotFoundError:
                raise IncompleteDirectoryError(f"{uri}: {e['path']} is in the manifest but missing") from None
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                    raise IncompleteDirectoryError(f"{uri}: {e['path']} is in the manifest but missing") from None
                raise
            if target.stat().st_size != e["size"] or _sha256(target) != e["sha256"]:
                raise IncompleteDirectoryError(f"{uri}: {e['path']} does not match the manifest")
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return local_dir


def cache_dir() -> Path:
    home = Path(os.environ.get("AGENTRL_HOME", ".agentrl"))
    return home / "cache"


def localize_dir(uri: str, cache: str | os.PathLike | None = None) -> Path:
    """A local directory for `uri`: itself when local, else a verified, cached download (keyed by manifest)."""
    if not is_s3(uri):
        return Path(uri)
    manifest = read_manifest(uri)
    digest = hashlib.sha256(json.dumps(manifest["files"], sort_keys=True).encode()).hexdigest()[:16]
    bucket, key = split_s3(uri)
    target = Path(cache or cache_dir()) / bucket / key.strip("/") / digest
    if target.exists() and is_complete(str(target)):
        return target
    return get_dir(uri, target)
