"""OpenCV, imported in one place, with its own thread pool switched off for the process.

The package's kernels run OpenCV on small images from many threads or worker processes at once; OpenCV's internal
pool adds nothing there, and a process forked while that pool exists (a DataLoader worker, a conversion worker)
can deadlock in its first OpenCV call, on a lock the pool's threads held at the fork. ``cv2.setNumThreads(0)`` runs
every OpenCV function sequentially in the thread that calls it (as PyTorch's DataLoader documentation advises).
"""

import cv2

cv2.setNumThreads(0)

__all__ = ["cv2"]
