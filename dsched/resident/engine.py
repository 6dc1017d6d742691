"""A mutation-aware dependency engine: operations tagged with what they read and what they write.

This is the threaded engine of MXNet as the dependency-engine lecture
(``shared/seeds/001_…``) presents it, with no Dask in it, so it can be tested
on its own. Every resource (here: one field of one chunk of a resident batch)
is a :class:`Variable`. An operation is pushed with the variables it reads and
the variables it writes (mutates), in program order, and the engine orders it
per variable:

- reads of one variable run together;
- a write waits for the earlier write and for every earlier read of that
  variable (write after read: a mutation in place must not pull the data out
  from under a reader);
- a later read waits for the write (read after write).

Nothing else is ordered: two operations that share no variable, or that only
read the ones they share, may run in any order or at once. Running the
operations so is equal to running them one after another in program order
(``tests/test_engine.py`` checks this as a property).

Each variable keeps the head of its queue: the last write pushed and the reads
pushed since that have not completed. That is all the state an operation pushed
later needs, and it is what makes memory recycling work: a completed read, and
every earlier version once a write is pushed, are let go of, and a finished
operation that nothing references any more is freed (the lecture's
``A.__del__()`` is a write with nothing after it).

The engine can drive execution itself (:meth:`Engine.ready`, :meth:`Engine.complete`,
the wait counters of the lecture), or hand each operation's predecessors
(:attr:`Op.after`) to a task system that waits on them (Dask futures in
:mod:`dsched.batch`).
"""

from __future__ import annotations

import itertools
import threading

__all__ = ["Engine", "Op", "Variable"]


class Variable:
    """A resource the engine orders operations on: the last write pushed, and the reads pushed since."""

    __slots__ = ("name", "last_write", "reads")

    def __init__(self, name):
        self.name = name
        self.last_write: Op | None = None
        self.reads: dict[int, Op] = {}  # pending reads since the last write, by op index

    def __repr__(self):
        return f"Variable({self.name!r})"


class Op:
    """One pushed operation.

    Attributes
    ----------
    index : int
        Its position in program order.
    reads, writes : tuple of Variable
        What it reads, and what it writes (a variable both read and written counts as written).
    after : tuple of Op
        The earlier operations it must follow: the last write of every
        variable it touches and, for the variables it writes, the reads since.
    waiting : int
        How many of ``after`` have not completed (the lecture's wait counter).
    payload : object
        Whatever the caller attaches (a Dask future, a function).
    """

    __slots__ = ("index", "label", "reads", "writes", "after", "waiting", "done", "payload", "_dependents")

    def __init__(self, index, label, reads, writes, after, payload):
        self.index, self.label, self.reads, self.writes = index, label, reads, writes
        self.after = after
        self.waiting = 0
        self.done = False
        self.payload = payload
        self._dependents: list[Op] = []

    def __repr__(self):
        return f"Op({self.index}, {self.label!r})"


class Engine:
    """Orders operations per variable; thread-safe.

    Parameters
    ----------
    queue_ready : bool
        Keep the operations that are ready when pushed for :meth:`ready`. Turn
        off when another system waits on :attr:`Op.after` (the engine would
        otherwise keep them).

    Examples
    --------
    The lecture's write-after-read example: ``B = A + 1; C = A + 2; A = 3``.

    >>> engine = Engine()
    >>> a, b, c = (engine.new_variable(n) for n in "ABC")
    >>> set_a = engine.push(writes=[a], label="A = 2")
    >>> b_op = engine.push(reads=[a], writes=[b], label="B = A + 1")
    >>> c_op = engine.push(reads=[a], writes=[c], label="C = A + 2")
    >>> mutate = engine.push(writes=[a], label="A = 3")
    >>> [op.label for op in mutate.after]
    ['A = 2', 'B = A + 1', 'C = A + 2']
    >>> [op.label for op in engine.ready()]
    ['A = 2']
    >>> [op.label for op in engine.complete(set_a)]
    ['B = A + 1', 'C = A + 2']
    """

    def __init__(self, *, queue_ready=True):
        self._lock = threading.Lock()
        self._count = itertools.count()
        # Ops ready at push, kept for ready(); off for a caller whose task system does the waiting
        # (the list would otherwise hold every such op, and its payload, forever).
        self._queue_ready = queue_ready
        self._ready: list[Op] = []

    def new_variable(self, name=None) -> Variable:
        """A new resource to order operations on."""
        return Variable(name)

    def push(self, reads=(), writes=(), *, label=None, payload=None) -> Op:
        """Push an operation in program order; returns it, with the operations it must follow in ``after``."""
        writes = tuple(dict.fromkeys(writes))
        reads = tuple(v for v in dict.fromkeys(reads) if v not in writes)
        with self._lock:
            after = {}
            for var in reads + writes:
                if var.last_write is not None:
                    after[id(var.last_write)] = var.last_write
            for var in writes:
                for reader in var.reads.values():
                    after[id(reader)] = reader
            op = Op(next(self._count), label, reads, writes, tuple(sorted(after.values(), key=lambda o: o.index)),
                    payload)
            for var in reads:
                var.reads[op.index] = op
            for var in writes:
                var.last_write, var.reads = op, {}
            for earlier in op.after:
                if not earlier.done:
                    op.waiting += 1
                    earlier._dependents.append(op)
            if op.waiting == 0 and self._queue_ready:
                self._ready.append(op)
        return op

    def ready(self) -> list:
        """Operations whose predecessors have all completed and that were not handed out yet (handed out now)."""
        with self._lock:
            ready, self._ready = self._ready, []
        return ready

    def complete(self, op: Op) -> list:
        """Mark ``op`` completed; returns the operations that became ready (not handed out again by :meth:`ready`)."""
        with self._lock:
            if op.done:
                raise RuntimeError(f"operation {op.index} ({op.label}) completed twice")
            op.done = True
            woken = []
            for dependent in op._dependents:
                dependent.waiting -= 1
                if dependent.waiting == 0:
                    woken.append(dependent)
            op._dependents = []
            # A completed read is no longer pending: a later write need not wait for it, and the
            # variable lets go of it (with its payload) at once, however long the variable is only read.
            for var in op.reads:
                var.reads.pop(op.index, None)
            op.after = ()  # nor does it need its predecessors any more: they can be freed
            return woken
