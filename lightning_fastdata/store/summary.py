"""What a conversion reports: :class:`ConversionSummary` and the :class:`SkippedFile` entries it lists.

The writer saves the summary beside the database too, as ``convert_report.json``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_fastdata.store.format import REPORT_FILE

#: why a file that ends before its image data does is skipped, in one wording whichever command and decoder met it
#: (libjpeg-turbo says "Premature end of JPEG file", Pillow "image file is truncated (N bytes not processed)")
TRUNCATED = "the image file is truncated: it ends before its image data does"


def image_error_reason(err: BaseException, otherwise: str) -> str:
    """:data:`TRUNCATED` when ``err`` (a decoder's error) says the file is cut short, else ``otherwise``."""
    text = str(err).lower()
    return TRUNCATED if "truncated" in text or "premature end" in text else otherwise


@dataclass(frozen=True)
class SkippedFile:
    """A source image that was not written, and why."""

    path: str
    reason: str


@dataclass
class ConversionSummary:
    """What a conversion did; ``format()`` renders it for people, ``to_dict()`` for JSON."""

    destination: str
    written: int = 0
    skipped: list[SkippedFile] = field(default_factory=list)
    ignored: list[SkippedFile] = field(default_factory=list)
    splits: dict[str, int] = field(default_factory=dict)
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    workers: int = 0
    up_to_date: bool = False
    #: for a conversion to a URL: whether the database was uploaded (``False``: the URL already held the same files)
    uploaded: bool | None = None

    @property
    def images_per_sec(self) -> float:
        """Images read per second of wall time (written and skipped)."""
        return (self.written + len(self.skipped)) / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dictionary, as written to the report beside the database."""
        out = asdict(self)
        out["images_per_sec"] = self.images_per_sec
        return out

    def format(self, max_skipped: int = 20) -> str:
        """A human-readable summary, listing at most ``max_skipped`` skipped files."""
        if self.up_to_date and self.uploaded:
            return f"the local conversion was up to date ({self.written} images); uploaded it to {self.destination}."
        if self.up_to_date:
            return f"{self.destination} is up to date ({self.written} images); nothing to do."
        splits = ", ".join(f"{name}={count}" for name, count in self.splits.items())
        lines = [
            f"wrote {self.written} images ({splits}) to {self.destination}",
            f"  skipped   {len(self.skipped)}",
            f"  bytes in  {human_bytes(self.bytes_in)}",
            f"  bytes out {human_bytes(self.bytes_out)}"
            + (f" ({self.bytes_out / self.bytes_in:.0%} of the source)" if self.bytes_in else ""),
            f"  time      {self.seconds:.1f} s, {self.images_per_sec:.0f} images/s ({self.workers} worker processes)",
        ]
        if self.uploaded is False:
            lines.append(f"  {self.destination} already held the same files: nothing uploaded")
        if self.ignored:
            lines.insert(2, f"  ignored   {len(self.ignored)} (not images: other files, empty class folders)")
        for kind, items in (("skipped", self.skipped), ("ignored", self.ignored)):
            for item in items[:max_skipped]:
                lines.append(f"  {kind} {item.path}: {item.reason}")
            if len(items) > max_skipped:
                lines.append(f"  ... and {len(items) - max_skipped} more, listed in {REPORT_FILE}")
        return "\n".join(lines)


def human_bytes(n: int) -> str:
    """``n`` bytes for people: ``512 B``, ``1.5 KiB``, ... up to GiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{n} B"
        value /= 1024
    raise AssertionError("unreachable")
