"""storage against a real S3 endpoint (moto's server on 127.0.0.1) and the local filesystem."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import boto3
import pytest

from components.core import storage
from tests.helpers.servers import FaultProxy


def make_tree(root: Path, n: int = 5, size: int = 1000) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        sub = root / ("sub" if i % 2 else "") / f"f{i}.bin"
        sub.parent.mkdir(parents=True, exist_ok=True)
        sub.write_bytes(bytes([i % 251]) * (size + i))
    return root


def same_tree(a: Path, b: Path) -> bool:
    files = lambda r: {p.relative_to(r).as_posix(): p.read_bytes() for p in r.rglob("*")  # noqa: E731
                       if p.is_file() and p.name != storage.MANIFEST}
    return files(a) == files(b)


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "store")
    bucket = request.getfixturevalue("bucket")
    return f"s3://{bucket}/prefix"


def test_file_roundtrip_and_listing(root, tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("hello")
    storage.put_file(src, storage.join(root, "x/a.txt"))
    storage.write_text(storage.join(root, "x/b.txt"), "line1\nline2\n")
    assert storage.exists(storage.join(root, "x/a.txt"))
    assert not storage.exists(storage.join(root, "x/missing.txt"))
    assert storage.read_text(storage.join(root, "x/a.txt")) == "hello"
    assert list(storage.open_byte_lines(storage.join(root, "x/b.txt"))) == [b"line1\n", b"line2\n"]
    names = [u.rsplit("/", 1)[-1] for u in storage.list_uris(storage.join(root, "x"))]
    assert names == ["a.txt", "b.txt"]
    out = storage.get_file(storage.join(root, "x/a.txt"), tmp_path / "dl" / "a.txt")
    assert out.read_text() == "hello"
    with pytest.raises(FileNotFoundError):
        storage.read_text(storage.join(root, "x/nope.txt"))


def test_directory_roundtrip(root, tmp_path):
    src = make_tree(tmp_path / "src", n=7)
    manifest = storage.put_dir(src, storage.join(root, "model"))
    assert len(manifest["files"]) == 7
    assert storage.is_complete(storage.join(root, "model"))
    dst = storage.get_dir(storage.join(root, "model"), tmp_path / "dst")
    assert same_tree(src, dst)
    # a second upload replaces the first whole
    (src / "f0.bin").write_bytes(b"changed")
    storage.put_dir(src, storage.join(root, "model"))
    dst2 = storage.get_dir(storage.join(root, "model"), tmp_path / "dst2")
    assert (dst2 / "f0.bin").read_bytes() == b"changed"


def test_reader_refuses_directory_without_manifest(root, tmp_path):
    src = make_tree(tmp_path / "src")
    for p in src.rglob("*"):
        if p.is_file():
            storage.put_file(p, storage.join(root, "partial", p.relative_to(src).as_posix()))
    with pytest.raises(storage.IncompleteDirectoryError, match="no _MANIFEST"):
        storage.get_dir(storage.join(root, "partial"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_reader_refuses_a_file_that_disagrees_with_the_manifest(bucket, tmp_path):
    uri = f"s3://{bucket}/m"
    storage.put_dir(make_tree(tmp_path / "src"), uri)
    storage.write_text(f"{uri}/f0.bin", "tampered")
    with pytest.raises(storage.IncompleteDirectoryError, match="does not match"):
        storage.get_dir(uri, tmp_path / "out")


def _upload_until_killed(proxy: FaultProxy, src: Path, uri: str, kill_after_requests: int, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("AGENTRL_S3_MAX_ATTEMPTS", "2")
    errors: list[BaseException] = []

    def upload():
        try:
            storage.put_dir(src, uri)
        except BaseException as exc:  # noqa: BLE001 - the failure is what we test
            errors.append(exc)

    t = threading.Thread(target=upload)
    t.start()
    deadline = time.time() + 60
    while proxy.forwarded < kill_after_requests and t.is_alive() and time.time() < deadline:
        time.sleep(0.005)
    proxy.kill()
    t.join(timeout=120)
    assert not t.is_alive()
    return errors


def test_server_killed_mid_upload_leaves_nothing_a_reader_accepts(s3_endpoint, bucket, tmp_path, monkeypatch):
    src = make_tree(tmp_path / "src", n=60, size=20_000)
    uri = f"s3://{bucket}/ckpt"
    proxy = FaultProxy(s3_endpoint).start()
    errors = _upload_until_killed(proxy, src, uri, kill_after_requests=20, monkeypatch=monkeypatch)
    assert errors, "the upload should have failed when its server died"
    # Read through the real endpoint: some files made it, the manifest did not.
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="ckpt/").get("Contents", [])]
    assert 0 < len(keys) < 60
    assert not storage.is_complete(uri)
    with pytest.raises(storage.IncompleteDirectoryError):
        storage.get_dir(uri, tmp_path / "out")


def test_killed_reupload_over_complete_directory_is_refused_not_mixed(s3_endpoint, bucket, tmp_path, monkeypatch):
    uri = f"s3://{bucket}/ckpt2"
    storage.put_dir(make_tree(tmp_path / "old", n=60, size=20_000), uri)
    assert storage.is_complete(uri)
    new = make_tree(tmp_path / "new", n=60, size=30_000)
    proxy = FaultProxy(s3_endpoint).start()
    errors = _upload_until_killed(proxy, new, uri, kill_after_requests=20, monkeypatch=monkeypatch)
    assert errors
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    # old and new files are mixed in the bucket now; the old manifest went first, so no reader accepts it
    with pytest.raises(storage.IncompleteDirectoryError):
        storage.get_dir(uri, tmp_path / "out")


def test_injected_503s_are_retried_and_succeed(s3_endpoint, bucket, tmp_path, monkeypatch):
    proxy = FaultProxy(s3_endpoint, fail_every=3).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        src = make_tree(tmp_path / "src", n=9)
        uri = f"s3://{bucket}/throttled"
        storage.put_dir(src, uri)
        dst = storage.get_dir(uri, tmp_path / "dst")
        assert same_tree(src, dst)
        assert storage.read_text(f"{uri}/{storage.MANIFEST}")
        assert proxy.failed >= 5, f"expected several 503s to be injected, got {proxy.failed}"
    finally:
        proxy.stop()


def test_local_put_dir_is_atomic_when_interrupted(tmp_path, monkeypatch):
    src = make_tree(tmp_path / "src", n=4)
    dest = tmp_path / "store" / "m"
    storage.put_dir(src, str(dest))
    calls = {"n": 0}
    real = storage.shutil.copytree

    def boom(*a, **kw):
        calls["n"] += 1
        raise OSError("disk full")

    monkeypatch.setattr(storage.shutil, "copytree", boom)
    (src / "f0.bin").write_bytes(b"new")
    with pytest.raises(OSError):
        storage.put_dir(src, str(dest))
    monkeypatch.setattr(storage.shutil, "copytree", real)
    # the old complete directory is untouched and no staging folder is left behind
    assert storage.is_complete(str(dest))
    assert (dest / "f0.bin").read_bytes() != b"new"
    assert [p.name for p in dest.parent.iterdir()] == ["m"]


def test_bad_uris():
    with pytest.raises(storage.StorageError):
        storage.split_s3("s3://")
    with pytest.raises(storage.StorageError):
        storage.split_s3("/local/path")


def test_endpoint_restarted_mid_upload_never_gives_a_complete_directory(aws_env, tmp_path, monkeypatch):
    """An S3 endpoint that restarts without its data while a directory goes up: the objects acknowledged before
    the restart are gone, boto's retries put the rest up; the listing check refuses to write the manifest."""
    from tests.helpers.servers import MotoServer

    server = MotoServer(tmp_path).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.url)
        monkeypatch.setenv("AGENTRL_PHASE", "grpo")
        boto3.client("s3", endpoint_url=server.url).create_bucket(Bucket="ckpt")
        src = make_tree(tmp_path / "src", n=50, size=2_000)
        real, calls = storage.put_file, {"n": 0}

        def put_file(local, uri):
            calls["n"] += 1
            if calls["n"] == 36:  # 35 objects acknowledged, then the endpoint restarts empty
                server.stop()
                server.start()
                boto3.client("s3", endpoint_url=server.url).create_bucket(Bucket="ckpt")
            real(local, uri)

        monkeypatch.setattr(storage, "put_file", put_file)
        with pytest.raises(storage.IncompleteDirectoryError) as err:
            storage.put_dir(src, "s3://ckpt/run/step-00000002")
        msg = str(err.value)
        assert "35 of 50 objects missing" in msg and "s3://ckpt/run/step-00000002" in msg and str(src) in msg
        assert "(phase grpo)" in msg and "no manifest written" in msg
        assert not storage.exists(f"s3://ckpt/run/step-00000002/{storage.MANIFEST}")
        assert not storage.is_complete("s3://ckpt/run/step-00000002")
    finally:
        server.stop()


def test_a_checkpoint_whose_files_went_missing_is_skipped_and_latest_falls_back(root, tmp_path):
    from components.core.checkpoint import Checkpoints, step_name

    ck = Checkpoints(storage.join(root, "grpo"), tmp_path / "staging")
    for step in (1, 2):
        storage.put_dir(make_tree(tmp_path / f"s{step}", n=4), storage.join(root, "grpo", step_name(step)))
    assert ck.latest()[0] == 2
    # step 2's manifest is there, one of its files is not (lost after the upload)
    storage.delete(storage.join(root, "grpo", step_name(2), "sub", "f1.bin"))
    assert not storage.is_complete(storage.join(root, "grpo", step_name(2)))
    assert ck.latest() == (1, storage.join(root, "grpo", step_name(1)))


def test_a_file_pruned_between_the_walk_and_its_stat_is_left_out(tmp_path, monkeypatch):
    # a reader polls checkpoints while the writer prunes the oldest: the walk saw a file that is gone by its stat
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "kept.bin").write_bytes(b"x" * 3)
    walked = [str(tmp_path / "d" / "gone.bin"), str(tmp_path / "d" / "kept.bin")]
    monkeypatch.setattr(storage, "list_uris", lambda uri, recursive=True: walked)
    assert storage.list_objects(str(tmp_path / "d")) == [{"path": "kept.bin", "size": 3, "etag": ""}]
