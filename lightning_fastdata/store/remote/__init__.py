"""Databases in object storage: publish one to a bucket, and stage it once per node into the local cache.

An LMDB database is a memory map, fast only on a local disk; so a database at a URL (any fsspec URL: ``s3://``,
``gs://``, ``az://``, ``https://``, ``file://``) is copied once to each node's cache and read there.

A published database is a folder (a key prefix) holding the database's files (``data.mdb``,
``convert_report.json``) and, written last, the completion marker ``published.json``: each file's size, ETag (where
the store gives one) and SHA-256, and an id that changes with every publication. A folder without the marker (an
upload under way or interrupted) is refused, so nothing half-uploaded is ever read.

Staging (:func:`stage`), under the cache's lock of the staged copy
(:func:`~lightning_fastdata.store.ondisk.target_lock`, which works across jobs on one node): read the marker (the only
request when the node already holds this publication) and refuse one that names any file but the published ones, fetch
every file in parallel ranged reads into the hidden working copy ``.NAME.partial`` (the ranges done, synced to disk, are
kept in ``progress.json`` there, so an interrupted staging resumes), hash each file as its ranges complete and compare
it with the marker's SHA-256, rename the working copy into place, and open it. The staged copy keeps the marker it was
staged from in ``staged.json``. A bucket's data is never trusted: nothing is written outside the working copy, nor
through a link planted in it, each range is written once (what is hashed is what is published), a server cannot make
staging hold more than a range per read (over HTTP), and a URL's user-info (and an http(s) query) is shown nowhere
(:func:`redact_url`).

Credentials and endpoints come from fsspec and its backend alone (``AWS_*`` variables, profiles and instance roles
for s3fs, ``FSSPEC_<PROTOCOL>_<OPTION>`` variables such as ``FSSPEC_S3_ENDPOINT_URL``); this package holds none. An
object store's URL holding credentials (``s3://KEY:SECRET@bucket/...``) is refused before any request; an http(s)
URL may hold them (``https://user:password@host/...``, a signed query), and then every error raised here is raised
without the backend's error it came from (whose text holds the full URL), and fsspec's HTTP log records are redacted
while staging or publishing runs (:func:`~lightning_fastdata.store.remote.errors.keeping_secrets`).

One module per job: :mod:`~lightning_fastdata.store.remote.urls` (parsing, redaction, the file system of a URL),
:mod:`~lightning_fastdata.store.remote.errors` (one-line errors, secrets kept out),
:mod:`~lightning_fastdata.store.remote.marker` (``published.json``), :mod:`~lightning_fastdata.store.remote.replies`
(one ranged read), :mod:`~lightning_fastdata.store.remote.fetch` (the parallel fetch, hashed),
:mod:`~lightning_fastdata.store.remote.staging` and :mod:`~lightning_fastdata.store.remote.publishing`. The tunables of
staging are set here (``remote.RANGE_SIZE``, ``remote.READ_THREADS``, ``remote.SYNC_SECONDS``), and read from here at
each call.
"""

from __future__ import annotations

from lightning_fastdata.store.format import PROGRESS_FILE, STAGED_RECORD, partial_path  # a staging's own files
from lightning_fastdata.store.remote.fetch import read_threads
from lightning_fastdata.store.remote.marker import MARKER, PUBLISHED_FILES
from lightning_fastdata.store.remote.publishing import check_destination, publish, publish_database
from lightning_fastdata.store.remote.staging import StagedDatabase, find_staged, stage
from lightning_fastdata.store.remote.urls import (
    check_local,
    filesystem,
    is_url,
    redact_text,
    redact_url,
    staged_path,
)

__all__ = [
    "MARKER",
    "PROGRESS_FILE",
    "PUBLISHED_FILES",
    "RANGE_SIZE",
    "READ_THREADS",
    "STAGED_RECORD",
    "SYNC_SECONDS",
    "StagedDatabase",
    "check_destination",
    "check_local",
    "filesystem",
    "find_staged",
    "is_url",
    "partial_path",
    "publish",
    "publish_database",
    "read_threads",
    "redact_text",
    "redact_url",
    "stage",
    "staged_path",
]

#: bytes per ranged read: the size that staged fastest from a store that serves each range on its own
#: (measured: docs/benchmarks.md#remote-staging-32-mib-ranges). A resumed staging refetches at most one range per
#: reader; the ranges in flight are held in memory.
RANGE_SIZE = 32 * 2**20
#: ranged reads in flight: twice the usable CPUs, 4 to 10 (``None``: decided when staging). Object stores serve each
#: connection at a fraction of a node's bandwidth, so a node with more cores keeps more reads in flight
#: (measured: docs/benchmarks.md#remote-staging-twice-the-usable-cpus-of-reads-in-flight)
READ_THREADS: int | None = None
#: seconds between two records of the ranges done: each syncs the files to disk first (``fdatasync``), then
#: ``progress.json``; a staging killed meanwhile fetches those seconds' ranges again (0: a record after each range)
SYNC_SECONDS = 1.0
