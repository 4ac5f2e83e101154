"""The model registry: partitioned models in an S3-compatible object store (S3, MinIO; moto's server in tests).

A model lives at ``s3://<bucket>/<prefix>/`` as the folder ``quartctl partition`` writes: ``manifest.json``,
``stage-<i>.safetensors``, the tokenizer. ``upload`` writes the manifest last, so a model whose upload
stopped halfway has no manifest and is never resolved. ``fetch_stage`` streams one stage object in file
order (the partitioner writes tensors layer by layer, so bytes arrive layer after layer; a progress
callback sees each chunk) into host memory under a temporary name, verifies its size and sha256 against the
manifest, and only then renames it into place: nothing half-fetched or corrupt is ever loaded.
``materialize`` builds a local model folder (manifest, tokenizer, one stage) a zygote loads as usual.

Endpoint and credentials: boto3's own configuration (``AWS_ENDPOINT_URL``, ``AWS_SHARED_CREDENTIALS_FILE``
— a file, mode 0600 —, ``AWS_ACCESS_KEY_ID`` …) or ``QUART_REGISTRY_ENDPOINT``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from quart_stage.manifest import TOKENIZER_EXTRAS, check_file_name
from quart_stage.settings import setting

from keysmanager.transfer import (
    CHUNK_BYTES,
    FetchResult,
    LayerCheck,
    Progress,
    StreamInto,
    TransferError,
    VerifiedWriter,
    fetch_first,
    sha256_file,
)

if TYPE_CHECKING:
    from keysmanager.landing import LandingReserve

MODEL_URL_ENV = "QUART_MODEL_URL"  # s3://bucket/prefix of a partitioned model (stack.yml environment)
ENDPOINT_ENV = "QUART_REGISTRY_ENDPOINT"  # S3 endpoint URL when not AWS (MinIO, a local server)
MANIFEST = "manifest.json"
LIVE_MANIFEST = "manifest.live.json"  # written first by a live fetch: a live replica reads it before MANIFEST exists
PROGRESS_SUFFIX = ".layers"  # <stage file>.layers: the verified-layer count of a live fetch (quart_stage.progress)


class RegistryError(TransferError):
    """The registry could not give what was asked; the message names the cause (unreachable, missing
    object, access denied, checksum mismatch)."""


def parse_model_url(url: str) -> tuple[str, str]:
    """(bucket, key prefix without trailing slash) of ``s3://bucket/prefix``; RegistryError if malformed."""
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise RegistryError(f"{MODEL_URL_ENV} must look like s3://bucket/path/to/model, got {url!r}")
    return parsed.netloc, parsed.path.strip("/")


def s3_client(endpoint_url: str | None = None) -> Any:
    """A boto3 S3 client with short connect/read timeouts and few retries (a dead registry fails fast)."""
    import boto3
    from botocore.config import Config

    endpoint = endpoint_url or setting(ENDPOINT_ENV, str, "") or None
    config = Config(connect_timeout=5, read_timeout=30, retries={"max_attempts": 2, "mode": "standard"},
                    s3={"addressing_style": "path"})
    return boto3.client("s3", endpoint_url=endpoint, config=config,
                        region_name=setting("AWS_DEFAULT_REGION", str, "us-east-1"))


class ModelRegistry:
    """One model in the registry, by its ``s3://`` URL."""

    def __init__(self, url: str, endpoint_url: str | None = None, client: Any = None) -> None:
        self.url = url.rstrip("/")
        self.bucket, self.prefix = parse_model_url(url)
        self.endpoint_url = endpoint_url
        self._client = client

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = s3_client(self.endpoint_url)
        return self._client

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    # ------------------------------------------------------------------------------ errors
    def _explain(self, exc: Exception, what: str) -> RegistryError:
        from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError

        if isinstance(exc, ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in {"NoSuchKey", "404", "NotFound"}:
                return RegistryError(f"{what}: no such object in the registry ({self.url})")
            if code == "NoSuchBucket":
                return RegistryError(f"{what}: bucket {self.bucket!r} does not exist")
            if code in {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"}:
                return RegistryError(f"{what}: access denied by the registry ({code}); check the credentials")
            return RegistryError(f"{what}: the registry answered {code or exc}")
        if isinstance(exc, EndpointConnectionError):
            return RegistryError(f"{what}: the registry is unreachable ({exc})")
        if isinstance(exc, BotoCoreError | OSError):
            return RegistryError(f"{what}: {exc}")
        return RegistryError(f"{what}: {exc!r}")

    # ------------------------------------------------------------------------------ upload
    def upload(self, model_dir: Path, progress: bool = False) -> list[str]:
        """Upload a partitioned model folder; the manifest goes last. Returns the keys written."""
        from botocore.exceptions import BotoCoreError, ClientError

        model_dir = Path(model_dir)
        if not (model_dir / MANIFEST).is_file():
            raise RegistryError(f"{model_dir} holds no {MANIFEST}: partition the model first")
        files = sorted(p for p in model_dir.iterdir() if p.is_file() and p.name != MANIFEST)
        files.append(model_dir / MANIFEST)
        total = sum(p.stat().st_size for p in files)
        bar = _bar(total, f"upload {self.url}", progress)
        try:
            self._ensure_bucket()
            for path in files:
                self.client.upload_file(str(path), self.bucket, self.key(path.name),
                                        Callback=bar.update if bar is not None else None)
        except (BotoCoreError, ClientError) as exc:
            raise self._explain(exc, f"uploading {model_dir}") from None
        finally:
            if bar is not None:
                bar.close()
        return [self.key(p.name) for p in files]

    def _ensure_bucket(self) -> None:
        from botocore.exceptions import ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code")) not in {"404", "NoSuchBucket", "NotFound"}:
                raise
            self.client.create_bucket(Bucket=self.bucket)

    # ------------------------------------------------------------------------------ fetch
    def manifest(self) -> dict:
        """The model's manifest (small: one GET)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self.key(MANIFEST))["Body"].read()
        except (BotoCoreError, ClientError) as exc:
            raise self._explain(exc, f"reading {self.url}/{MANIFEST}") from None
        try:
            return json.loads(body)
        except ValueError:
            raise RegistryError(f"{self.url}/{MANIFEST} is not valid JSON") from None

    def fetch(self, name: str, dest: Path, sha256: str | None = None, size: int | None = None,
              on_progress: Progress | None = None, writer: VerifiedWriter | None = None) -> FetchResult:
        """Stream object ``name`` into ``dest`` (via ``dest.partial``, ``keysmanager.transfer``), verified; returns
        bytes and seconds. ``writer``: an open writer to stream into (a KeysManager serves it on to peers)."""
        from botocore.exceptions import BotoCoreError, ClientError

        what = f"{self.url}/{name}"
        try:
            with contextlib.ExitStack() as stack:
                if writer is None:
                    writer = stack.enter_context(VerifiedWriter(Path(dest), sha256, size, what, on_progress))
                reply = self.client.get_object(Bucket=self.bucket, Key=self.key(name))
                return writer.write_all(reply["Body"].iter_chunks(CHUNK_BYTES))
        except (BotoCoreError, ClientError, OSError) as exc:
            raise self._explain(exc, f"fetching {what}") from None
        except TransferError as exc:
            raise RegistryError(str(exc)) from None

    def read_range(self, name: str, start: int, end: int) -> Iterator[bytes]:
        """Bytes ``[start, end)`` of object ``name`` (GetObject with ``Range``), in chunks; RegistryError naming
        the cause. Unverified: the caller checks them (a part start, ``keysmanager.parts``)."""
        from botocore.exceptions import BotoCoreError, ClientError

        what = f"{self.url}/{name} bytes {start}..{end}"
        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=self.key(name), Range=f"bytes={start}-{end - 1}")
            yield from reply["Body"].iter_chunks(CHUNK_BYTES)
        except (BotoCoreError, ClientError, OSError) as exc:
            raise self._explain(exc, f"fetching {what}") from None

    def tokenizer_folder(self, dest_dir: Path) -> Path:
        """A local folder with the model's manifest and tokenizer files (``tokenizer.json`` and those of
        `TOKENIZER_EXTRAS` the model has), no stage: what a gateway needs to tokenize for a registry-only model.
        The manifest is written last, so a folder with one is complete; a folder whose manifest is the
        registry's is kept as it is."""
        from botocore.exceptions import BotoCoreError, ClientError

        dest_dir = Path(dest_dir)
        manifest = self.manifest()
        with contextlib.suppress(OSError, ValueError):
            if json.loads((dest_dir / MANIFEST).read_text()) == manifest:
                return dest_dir
        tokenizer = manifest.get("tokenizer")
        if not tokenizer:
            raise RegistryError(f"{self.url}: model {manifest.get('model')!r} has no tokenizer")
        try:
            check_file_name(tokenizer)
        except ValueError as exc:
            raise RegistryError(f"{self.url}: {exc}") from None
        try:
            listed = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.key(""))
        except (BotoCoreError, ClientError) as exc:
            raise self._explain(exc, f"listing {self.url}") from None
        present = {obj["Key"] for obj in listed.get("Contents") or ()}
        dest_dir.mkdir(parents=True, exist_ok=True)
        for name in (tokenizer, *(x for x in TOKENIZER_EXTRAS if self.key(x) in present)):
            self.fetch(name, dest_dir / name)
        tmp = dest_dir / (MANIFEST + ".partial")
        tmp.write_text(json.dumps(manifest))
        os.replace(tmp, dest_dir / MANIFEST)
        return dest_dir

    def materialize(self, stage_index: int, dest_dir: Path, on_progress: Progress | None = None,
                    peers: Sequence[tuple[str, StreamInto]] = (),
                    on_writer: Callable[[VerifiedWriter], None] | None = None, live: bool = False,
                    landing: LandingReserve | None = None) -> FetchResult:
        """A local model folder holding the manifest, the tokenizer and stage ``stage_index`` (fetched,
        verified), usable as ``QUART_MODEL_DIR``. A stage file already there with the right checksum is kept.

        The manifest always comes from the registry (the authority on what the stage's bytes must be); the stage
        file comes from the first of ``peers`` (label, stream) that delivers it verified, else from the registry.
        ``on_writer`` sees each writer as it opens (a KeysManager serves a transfer in flight on to peers).
        ``live``: when the manifest has per-layer hashes, write the manifest to ``LIVE_MANIFEST`` first and check
        the stage file layer by layer as it arrives (``keysmanager.transfer.LayerCheck``): a live replica serves
        the layers verified so far (``keysmanager.live``). ``landing``: a new stage file lands in its pre-touched
        pages (``keysmanager.landing``)."""
        dest_dir = Path(dest_dir)
        dest_dir.mkdir(parents=True, exist_ok=True)
        manifest = self.manifest()
        stages = manifest.get("stages") or []
        if not 0 <= stage_index < len(stages):
            raise RegistryError(f"{self.url}: model {manifest.get('model')!r} has stages 0..{len(stages) - 1}, "
                                f"not {stage_index}")
        entry = stages[stage_index]
        for extra in filter(None, [manifest.get("tokenizer")]):
            if not (dest_dir / extra).exists():
                self.fetch(extra, dest_dir / extra)
        result = FetchResult(dest_dir, 0, 0.0, "local")
        name = entry.get("file")
        if name:
            target = dest_dir / name
            if not (target.exists() and sha256_file(target) == entry.get("sha256")):
                check = live_check(dest_dir, manifest, stage_index) if live else None

                def open_writer() -> VerifiedWriter:
                    writer = VerifiedWriter(target, entry.get("sha256"), entry.get("file_bytes"),
                                            f"stage {stage_index} of {self.url}", on_progress, layers=check,
                                            landing=landing)
                    if on_writer is not None:
                        on_writer(writer)
                    return writer

                registry = (self.url, lambda w: self.fetch(name, target, writer=w))
                try:
                    result = fetch_first([*peers, registry], open_writer)
                except TransferError as exc:
                    raise RegistryError(str(exc)) from None
        tmp = dest_dir / (MANIFEST + ".partial")  # the manifest last: the folder is complete once it exists
        tmp.write_text(json.dumps(manifest))
        os.replace(tmp, dest_dir / MANIFEST)
        return result


def live_check(dest_dir: Path, manifest: dict, stage_index: int) -> LayerCheck | None:
    """Prepare a live fetch of stage ``stage_index`` into ``dest_dir``: the manifest written to ``LIVE_MANIFEST``
    (a live replica reads it before the folder is complete), no stale partial or progress file; the check its
    writer runs. None when the manifest has no per-layer hashes (an older partition) or the stage no file."""
    entry = manifest["stages"][stage_index]
    spans, hashes, name = entry.get("layer_bytes"), entry.get("layer_sha256"), entry.get("file")
    if not spans or not hashes or not name or not entry.get("file_bytes"):
        return None
    target = dest_dir / name
    progress = target.with_name(target.name + PROGRESS_SUFFIX)
    progress.unlink(missing_ok=True)  # a live replica of an earlier attempt keeps what it read; it never lowers
    target.with_name(target.name + ".partial").unlink(missing_ok=True)
    tmp = dest_dir / (LIVE_MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest))
    os.replace(tmp, dest_dir / LIVE_MANIFEST)
    return LayerCheck(tuple((int(a), int(b)) for a, b in spans), tuple(hashes), progress)


def _bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc)
