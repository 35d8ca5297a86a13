"""What a conversion reports: :class:`ConversionSummary` and the :class:`SkippedFile` entries it lists.

The writer saves the summary beside the database too, as ``convert_report.json``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_fastdata.store.format import REPORT_FILE
from lightning_fastdata.store.targets import TargetSpec

#: how many classes the summary of a multi-label conversion names, most named first
TOP_CLASSES = 10

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
    #: the target kind written (``None`` when nothing was written)
    targets: TargetSpec | None = None
    #: ``multilabel``: how many samples name each class, over all splits, by class name
    class_counts: dict[str, int] = field(default_factory=dict)
    #: ``float``: the ``min``, ``mean`` and ``max`` of each value over all splits, by the value's name (or index)
    target_stats: dict[str, dict[str, float]] = field(default_factory=dict)

    def add_targets(self, spec: TargetSpec, classes: list[str], splits: dict[str, dict[str, Any]]) -> None:
        """Note the kind written and, from each split's metadata, its class counts or value statistics."""
        self.targets = spec
        if spec.kind == "multilabel":
            totals = [0] * len(classes)
            for info in splits.values():
                for i, count in enumerate(info.get("class_counts", [])):
                    totals[i] += count
            self.class_counts = dict(zip(classes, totals, strict=True))
        if spec.kind == "float":
            stats = [(info["length"], info["target_stats"]) for info in splits.values() if "target_stats" in info]
            total = sum(length for length, _ in stats)
            names = list(spec.names) if len(spec.names) == spec.dim else [str(i) for i in range(spec.dim)]
            for k, name in enumerate(names):
                if not total:
                    break
                self.target_stats[name] = {
                    "min": min(s["min"][k] for _, s in stats),
                    "mean": sum(length * s["mean"][k] for length, s in stats) / total,
                    "max": max(s["max"][k] for _, s in stats),
                }

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
        lines[1:1] = self._target_lines()
        for kind, items in (("skipped", self.skipped), ("ignored", self.ignored)):
            for item in items[:max_skipped]:
                lines.append(f"  {kind} {item.path}: {item.reason}")
            if len(items) > max_skipped:
                lines.append(f"  ... and {len(items) - max_skipped} more, listed in {REPORT_FILE}")
        return "\n".join(lines)

    def _target_lines(self) -> list[str]:
        """The lines on targets: none for classes (as before kinds), the kind and its counts or statistics else."""
        spec = self.targets
        if spec is None or spec.kind == "class":
            return []
        lines = [f"  targets   {spec.describe()}"]
        if spec.kind == "multilabel" and self.class_counts:
            ranked = sorted(self.class_counts.items(), key=lambda item: (-item[1], item[0]))
            shown = ", ".join(f"{name} {count}" for name, count in ranked[:TOP_CLASSES])
            more = f", and {len(ranked) - TOP_CLASSES} more" if len(ranked) > TOP_CLASSES else ""
            lines.append(f"  samples naming each class: {shown}{more}")
        for name, stats in self.target_stats.items():
            lines.append(f"  {name}: min {stats['min']:.4g}  mean {stats['mean']:.4g}  max {stats['max']:.4g}")
        return lines


def human_bytes(n: int) -> str:
    """``n`` bytes for people: ``512 B``, ``1.5 KiB``, ... up to GiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{n} B"
        value /= 1024
    raise AssertionError("unreachable")
