"""Storage: how images become a database, what a database is on disk, and how it is read back.

One module per concern, in the order a sample travels:

* :mod:`~lightning_fastdata.store.sources`: reading a source (image folders, split folders, list files) into a plan,
  with :mod:`~lightning_fastdata.store.listfiles` (``path,label`` list files) and
  :mod:`~lightning_fastdata.store.plan` (the ``ConversionPlan`` and what every layout shares);
* :mod:`~lightning_fastdata.store.hf`: the Hugging Face ``datasets`` adapter of ``convert_dataset``;
* :mod:`~lightning_fastdata.store.encode`: the per-image options and encoding, in worker processes;
* :mod:`~lightning_fastdata.store.writer`: the LMDB writer of a conversion;
* :mod:`~lightning_fastdata.store.ondisk`: what the writer and staging do on disk: the lock per target, the working
  copy, the move into place by rename, files of this user's own;
* :mod:`~lightning_fastdata.store.leftovers`: what interrupted conversions and stagings left, found and cleaned up;
* :mod:`~lightning_fastdata.store.conversion`: the entry points ``convert`` and ``convert_dataset``;
* :mod:`~lightning_fastdata.store.summary`: what a conversion reports (``ConversionSummary``, ``SkippedFile``);
* :mod:`~lightning_fastdata.store.format`: the on-disk format shared by writer and reader (keys, headers, metadata);
* :mod:`~lightning_fastdata.store.environments`: opening a database read-only, walked once (``read_meta``, ...);
* :mod:`~lightning_fastdata.store.reader`: ``LmdbImageDataset``, the reader, with
  :mod:`~lightning_fastdata.store.decoding` (``RecordDecoder``: a record checked against the reader's limits, then
  decoded) and :mod:`~lightning_fastdata.store.target_reader` (a split's targets as the reader gives them);
* :mod:`~lightning_fastdata.store.jpeg`: the walk over a JPEG's markers by which the reader holds a record's decode
  to its budget;
* :mod:`~lightning_fastdata.store.targets`: the target kinds (class, multi-label, float, none): their typed arrays,
  written and read back;
* :mod:`~lightning_fastdata.store.labels`: a list file's or a dataset's labels read, and their kind inferred;
* :mod:`~lightning_fastdata.store.remote`: databases at a URL: publishing one to a bucket, and staging it once per
  node into the cache folder (a package: URLs, errors, the marker, replies, fetch, staging, publishing);
* :mod:`~lightning_fastdata.store.cache`: the cache folder, the database a source converts into there, and the
  conversions' upkeep (list, last use, remove, prune), built on :mod:`~lightning_fastdata.store.cachedir` (the
  folder, its slots, the use files) and :mod:`~lightning_fastdata.store.inventory` (what the folder holds).

Nothing is imported here: ``lightning-fastdata --help`` imports neither torch nor Lightning, and only ``reader``
imports torch.
"""
