"""The dependency engine: per-variable ordering equals program order, whatever runs first among the ready ops."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsched.engine import Engine

N_VARS = 4
TORN = "torn"  # what a reader sees of a variable that a write is in the middle of mutating


def _program_order(ops, n_vars):
    """Every op run one after another: each written variable gets a value made of the op and what it read."""
    values = [("init", v) for v in range(n_vars)]
    for index, (reads, writes) in enumerate(ops):
        seen = tuple(values[v] for v in sorted(reads))
        for v in writes:
            values[v] = (index, v, seen)
    return values


def _engine_order(ops, n_vars, choices):
    """The ops through the engine, started and finished in an order ``choices`` picks among what may run.

    An op reads at its start and writes at its end, and while it runs each
    variable it writes holds ``TORN``: a read running alongside a write of the
    same variable, or a write finishing out of order, changes the result.
    """
    engine = Engine()
    variables = [engine.new_variable(v) for v in range(n_vars)]
    values = [("init", v) for v in range(n_vars)]
    pushed = [engine.push([variables[v] for v in reads], [variables[v] for v in writes], label=i)
              for i, (reads, writes) in enumerate(ops)]
    startable, running, finished = list(engine.ready()), [], 0
    seen = {}
    choices = iter(choices)
    while finished < len(pushed):
        assert startable or running, "the engine stalled with operations left"
        pick = next(choices, 0)
        if startable and (not running or pick % 2 == 0):
            op = startable.pop((pick // 2) % len(startable))
            reads, writes = ops[op.label]
            seen[op.label] = tuple(values[v] for v in sorted(reads))
            for v in writes:
                values[v] = TORN
            running.append(op)
        else:
            op = running.pop((pick // 2) % len(running))
            reads, writes = ops[op.label]
            for v in writes:
                values[v] = (op.label, v, seen[op.label])
            startable += engine.complete(op)
            finished += 1
    return values


op_sets = st.lists(st.tuples(st.frozensets(st.integers(0, N_VARS - 1)),
                             st.frozensets(st.integers(0, N_VARS - 1), min_size=1)), max_size=25)


@settings(max_examples=300, deadline=None)
@given(ops=op_sets, choices=st.lists(st.integers(0, 1000), max_size=120))
def test_any_engine_schedule_equals_program_order(ops, choices):
    # A variable both read and written is a mutation: the op reads it, then writes it.
    ops = [(reads, writes) for reads, writes in ops]
    assert _engine_order(ops, N_VARS, choices) == _program_order(ops, N_VARS)


def test_lecture_enqueue_demonstration():
    # B = A + 1; C = A + 2; A = C * 2; D = A + 3 (the lecture's queue demonstration).
    engine = Engine()
    a, b, c, d = (engine.new_variable(n) for n in "ABCD")
    b_op = engine.push(reads=[a], writes=[b], label="B = A + 1")
    c_op = engine.push(reads=[a], writes=[c], label="C = A + 2")
    a_op = engine.push(reads=[c], writes=[a], label="A = C * 2")
    d_op = engine.push(reads=[a], writes=[d], label="D = A + 3")
    assert [o.label for o in engine.ready()] == ["B = A + 1", "C = A + 2"]  # reads of A run together
    assert a_op.after == (b_op, c_op)  # the write of A waits for both reads of A (and C's write)
    assert d_op.after == (a_op,)  # the read of A waits for the write
    assert (a_op.waiting, d_op.waiting) == (2, 1)
    assert engine.complete(b_op) == []
    assert engine.complete(c_op) == [a_op]
    assert engine.complete(a_op) == [d_op]
    assert engine.complete(d_op) == []
    assert engine.ready() == []


def test_random_number_generator_mutations_are_serialised():
    # B = rnd.uniform(); C = rnd.uniform(): both mutate rnd, so they run one after the other.
    engine = Engine()
    rnd, b, c = (engine.new_variable(n) for n in ("rnd", "B", "C"))
    first = engine.push(writes=[rnd, b])
    second = engine.push(writes=[rnd, c])
    assert engine.ready() == [first] and second.after == (first,)


def test_memory_recycle_drops_references():
    # A = 2; B = A + 1; A.__del__(): the delete waits for the read, then nothing holds the old ops.
    engine = Engine()
    a, b = engine.new_variable("A"), engine.new_variable("B")
    set_a = engine.push(writes=[a], payload="A v1")
    read = engine.push(reads=[a], writes=[b])
    delete = engine.push(writes=[a])
    assert delete.after == (set_a, read)
    assert a.last_write is delete and a.reads == {}
    engine.complete(set_a)
    engine.complete(read)
    assert read.after == () and b.last_write is read


def test_completed_reads_are_let_go():
    # A field only ever read must not keep every reader (and its payload) forever.
    engine = Engine()
    a = engine.new_variable("A")
    first = engine.push(writes=[a])
    engine.complete(first)
    for _ in range(100):
        engine.complete(engine.push(reads=[a]))
    pending = engine.push(reads=[a])
    assert list(a.reads.values()) == [pending]
    assert engine.push(writes=[a]).after == (first, pending)


def test_completing_twice_is_an_error():
    engine = Engine()
    op = engine.push(writes=[engine.new_variable("A")], label="A = 2")
    engine.complete(op)
    with pytest.raises(RuntimeError, match=r"operation 0 \(A = 2\) completed twice"):
        engine.complete(op)


def test_an_engine_that_does_not_queue_ready_ops_keeps_none():
    import gc
    import weakref

    engine = Engine(queue_ready=False)
    a = engine.new_variable("A")

    class Payload:
        pass

    payload = Payload()
    ref = weakref.ref(payload)
    engine.complete(engine.push(writes=[a], payload=payload))
    del payload
    engine.complete(engine.push(writes=[a]))  # the next version: nothing refers to the first one any more
    gc.collect()
    assert ref() is None and engine.ready() == []
