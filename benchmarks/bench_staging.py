"""Staging speed from a local S3 server against `cp` of the same file, side by side in one run (issue 29: >= 0.5x).

Starts moto's S3 server in its own process on 127.0.0.1 (so it does not share this process's GIL), publishes a
database folder whose ``data.mdb`` is SIZE MB of random bytes (staging checks sizes and ETags, not LMDB pages), then
alternates ``cp`` of the local ``data.mdb`` and :func:`lightning_fastdata.store.remote.stage` of the URL into an
empty cache, ROUNDS times each, and prints the median of each and their ratio. Both read a source held in memory
(the page cache; moto's memory) and write through the page cache.

    python benchmarks/bench_staging.py --size-mb 200 --rounds 3

Needs ``pip install 'lightning-fastdata[remote]' 'moto[server]'``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"moto's server did not start on port {port}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="ranged reads in flight (default: the package's)")
    parser.add_argument("--range-mb", type=int, default=None, help="MiB per ranged read (default: the package's)")
    args = parser.parse_args()

    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for(port)
        os.environ.update(
            AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
            AWS_DEFAULT_REGION="us-east-1",
            AWS_EC2_METADATA_DISABLED="true",
        )
        import fsspec

        from lightning_fastdata.store import remote

        if args.threads:
            remote.READ_THREADS = args.threads
        if args.range_mb:
            remote.RANGE_SIZE = args.range_mb * 2**20

        with tempfile.TemporaryDirectory(prefix="bench-staging-") as tmp:
            root = Path(tmp)
            db = root / "src.lmdb"
            db.mkdir()
            size = args.size_mb * 2**20
            with open(db / "data.mdb", "wb") as fh:
                for _ in range(args.size_mb):
                    fh.write(os.urandom(2**20))
            fsspec.filesystem("s3").mkdir("bench")
            url = "s3://bench/db.lmdb"
            t0 = time.perf_counter()
            remote.publish(db, url, progress=False)
            upload = time.perf_counter() - t0
            cp_times, stage_times, get_times = [], [], []
            for _ in range(args.rounds):
                t0 = time.perf_counter()  # the server's ceiling: one plain GET of the whole object, into memory
                subprocess.run(["curl", "-sf", "-o", os.devnull, f"http://127.0.0.1:{port}/bench/db.lmdb/data.mdb"])
                get_times.append(time.perf_counter() - t0)
                dst = root / "cp.mdb"
                t0 = time.perf_counter()
                subprocess.run(["cp", str(db / "data.mdb"), str(dst)], check=True)
                cp_times.append(time.perf_counter() - t0)
                dst.unlink()
                cache = root / "cache"
                t0 = time.perf_counter()
                result = remote.stage(url, cache, progress=False)
                stage_times.append(time.perf_counter() - t0)
                if result.action != "staged" or (result.path / "data.mdb").stat().st_size != size:
                    raise RuntimeError(f"staging did not fetch the file: {result}")
                shutil.rmtree(cache)
            cp_s, stage_s = statistics.median(cp_times), statistics.median(stage_times)
            mb = size / 2**20
            print(f"file: {mb:.0f} MiB data.mdb; upload (publish) {mb / upload:.0f} MiB/s")
            print(f"cp:      median {cp_s:.2f} s  {mb / cp_s:7.0f} MiB/s   ({', '.join(f'{t:.2f}' for t in cp_times)})")
            print(
                f"staging: median {stage_s:.2f} s  {mb / stage_s:7.0f} MiB/s   "
                f"({', '.join(f'{t:.2f}' for t in stage_times)}; {remote.READ_THREADS} threads x "
                f"{remote.RANGE_SIZE // 2**20} MiB ranges)"
            )
            get_s = statistics.median(get_times)
            print(f"one GET: median {get_s:.2f} s  {mb / get_s:7.0f} MiB/s   (curl to /dev/null: the server's ceiling)")
            print(f"staging / cp speed: {cp_s / stage_s:.2f}x (target >= 0.5x)")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
