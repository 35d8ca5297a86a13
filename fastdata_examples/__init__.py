"""The repository's ``examples/`` folder as a package with a name of its own: ``fastdata_examples.classifier``.

``fastdata_examples.classifier`` is ``examples/classifier.py``. The example configs (``examples/configs/*.yaml``) name
their model and data module by this name, not as ``examples.*``: other installed packages ship a top-level
``examples`` of their own, which Python would import instead (a regular package anywhere on ``sys.path`` wins over the
``examples/`` folder, which has no ``__init__.py``). Like ``examples/``, this is not part of the installed package: run
from the repository root (``lightning-fastdata`` imports from the working directory), or put the repository root on
``PYTHONPATH``.
"""

from pathlib import Path

__path__ = [str(Path(__file__).resolve().parents[1] / "examples")]
