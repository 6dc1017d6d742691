"""Shared memory asks for huge pages: every process mapping a large segment advises its whole 2 MiB pieces, so
that where /dev/shm allows huge pages a large array streams from shared memory as fast as from a process's own."""

import os

import numpy as np
import pytest

import dsched
from dsched.dataplane.segments import HUGE_PAGE, SHM_DIR, shared_memory_huge_pages
from dsched.dataplane.store import shared_location

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/smaps") or not os.path.isdir("/sys/kernel/mm/transparent_hugepage"),
    reason="needs Linux with transparent huge pages (reads /proc/self/smaps)")


def advised(path, smaps="/proc/self/smaps") -> list:
    """``[(bytes, huge pages advised)]`` of each of this process's mappings of the file ``path``, in address order."""
    found, current = [], None
    with open(smaps) as table:
        for line in table:
            fields = line.split()
            if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's head: range, perms, offset, dev, inode
                start, stop = (int(x, 16) for x in fields[0].split("-"))
                current = [stop - start, False] if len(fields) > 5 and fields[5] == path else None
                if current is not None:
                    found.append(current)
            elif current is not None and line.startswith("VmFlags:"):
                current[1] = "hg" in fields[1:]
    return [tuple(entry) for entry in found]


def segment_path(array) -> str:
    token, _ = shared_location(array)
    return os.path.join(SHM_DIR, token)


def test_a_large_segment_is_advised_over_its_whole_2_mib_pieces_and_not_its_tail():
    array = dsched.shared_empty((2 * HUGE_PAGE + 4096) // 8)  # two whole pieces and one 4 KiB page
    assert advised(segment_path(array)) == [(2 * HUGE_PAGE, True), (4096, False)]


def test_a_segment_smaller_than_a_huge_page_is_left_as_it_is():
    array = dsched.shared_empty(HUGE_PAGE // 8 - 512)
    assert advised(segment_path(array)) == [(HUGE_PAGE - 4096, False)]


def _advised_here(path):
    return advised(path)


def _total(x):
    return {"s": x.sum(axis=1)}


def test_a_worker_process_mapping_a_large_input_advises_it_too(process_client):
    x = dsched.shared_empty((3 * HUGE_PAGE // 8 // 4, 4))  # 6 MiB: three whole pieces
    x[:] = 1.0
    out = dsched.dispatch(_total, x, scheduler=dsched.StaticHybridScheduler(["cpu", "cuda:0"], [len(x) // 2] * 2),
                          client=process_client)
    np.testing.assert_array_equal(out["s"], np.full(len(x), 4.0))
    for worker, mappings in process_client.run(_advised_here, segment_path(x)).items():
        assert mappings == [(3 * HUGE_PAGE, True)], worker  # each worker's own mapping of the input's segment


@pytest.mark.parametrize(("options", "expected"), [
    ("rw,nosuid,nodev", "never"),
    ("rw,relatime,size=24684084k,huge=advise", "advise"),
    ("rw,huge=within_size,size=1g", "within_size"),
])
def test_the_mount_option_of_dev_shm_is_read_from_the_mount_table(tmp_path, options, expected):
    table = tmp_path / "mounts"
    table.write_text(f"proc /proc proc rw 0 0\ntmpfs /dev/shm tmpfs {options} 0 0\n")
    assert shared_memory_huge_pages(str(table)) == expected


def test_a_table_without_dev_shm_or_no_table_says_unknown(tmp_path):
    table = tmp_path / "mounts"
    table.write_text("proc /proc proc rw 0 0\n")
    assert shared_memory_huge_pages(str(table)) == "unknown"
    assert shared_memory_huge_pages(str(tmp_path / "missing")) == "unknown"
    assert shared_memory_huge_pages() in {"never", "advise", "within_size", "always", "deny", "force", "unknown"}
