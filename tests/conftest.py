from __future__ import annotations

import os
import uuid

import boto3
import pytest

from tests.helpers.servers import MlflowServer, MotoServer

# The vLLM backend's tests run in their own environment (see the Makefile's `test` target).
collect_ignore = ["vllm_backend"]

# Tests never reach a model hub, and use one torch thread like the embedded default.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")


@pytest.fixture(scope="session")
def aws_env():
    keys = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    old = {k: os.environ.get(k) for k in keys}
    os.environ.update(keys)
    yield keys
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory, aws_env):
    server = MotoServer(tmp_path_factory.mktemp("moto")).start()
    yield server
    server.stop()


@pytest.fixture
def s3_endpoint(moto_server, monkeypatch):
    """AWS_ENDPOINT_URL pointing at the moto server, as production points it at MinIO or AWS."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.url)
    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", moto_server.url)
    return moto_server.url


@pytest.fixture
def bucket(s3_endpoint):
    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture
def mlflow_server(tmp_path, s3_endpoint, bucket):
    server = MlflowServer(tmp_path, s3_endpoint, bucket).start()
    yield server
    server.stop()
