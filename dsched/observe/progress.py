"""Progress as an observer: a callback for every chunk that finished well (a progress bar's update)."""

from __future__ import annotations

from dsched.checks import check_callable
from dsched.observe.hooks import RunObserver

__all__ = ["ChunkCallback"]


class ChunkCallback(RunObserver):
    """Call ``fn(record)`` for each chunk that succeeded, on the calling thread.

    This is what ``WorkDispatcher(on_chunk_done=fn)`` installs; ``dsched run``
    drives its tqdm bar with it.

    Examples
    --------
    >>> import dsched
    >>> sizes = []
    >>> d = dsched.WorkDispatcher(dsched.SimpleScheduler("cpu", 4), lambda w, dev: None, mode="sync",
    ...                           observers=[ChunkCallback(lambda r: sizes.append(r.size))])
    >>> _ = d.run(dsched.SliceGenerator(0, 10)); sizes
    [4, 4, 2]
    """

    def __init__(self, fn):
        check_callable(fn, "on_chunk_done")
        self.fn = fn

    def chunk_completed(self, record):
        if record.error is None:
            self.fn(record)
