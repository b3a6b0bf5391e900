"""Flag publication into "GPU" flag words without a CUDA context, on the paths that run without a GPU.

- the host shadow and the mapped store (efa/csrc/efa_post.c), also from two processes at once;
- the GDRCopy path with a stand-in libgdrapi (tests/efa/gdr_standin.c, built here) over host memory: pin,
  map through a second mapping of the same pages, and the compiled poster's own stores into it;
- the cuda-copy path's bookkeeping over a stand-in for the accessor's word copies whose batches land when
  the test says (`GpuAccessor.post_words` itself: tests/transportd/dataplane/test_gpu_direct_copier.py and,
  on a GPU, tests/gpu/test_fused_kernels.py);
- the loopback path: a real loopback SRD write through the soft EFA device into memory registered with an
  accessor (what GPU memory is to softverbs), one write per slot per pass;
- the choice of path (gdrdrv absent, stand-in library, forced values and what a forced path that cannot
  work says).
"""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing as mp
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from softverbs._memory import HostAccessor
from tests.support.efa_link import Link
from tests.support.waiting import wait_until
from transportd import _core
from transportd.backends.interface import MemoryKey, SignalOp
from transportd.dataplane.flag_publication import (
    CUDA_COPY,
    GDRCOPY,
    HOST_MAPPED,
    LOOPBACK,
    NIC,
    GpuFlagWords,
    PublicationChoice,
    RailFlags,
    choose_publication,
    words_path,
)
from transportd.dataplane.flagfile import FlagFile
from transportd.dataplane.gpu_memory import GPU_PAGE_SIZE, GdrCopy
from transportd.errors import GdrCopyError

STANDIN_SOURCE = Path(__file__).with_name("gdr_standin.c")


@pytest.fixture(scope="session")
def standin_library(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The stand-in libgdrapi, compiled for this run."""
    out = tmp_path_factory.mktemp("gdr") / "libgdrapi_standin.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-Wno-unused-parameter", "-o", str(out),
                    str(STANDIN_SOURCE)], check=True)
    return str(out)


class WordCopies:
    """Stands in for `GpuAccessor.post_words` / `landed` over host memory: a posted batch lands only when the
    test calls :meth:`land`, so it can be late, or land after a later batch of another writer."""

    def __init__(self) -> None:
        self.posts: list[list[tuple[int, int]]] = []
        self.pending: list[tuple[int, list[tuple[int, int]]]] = []
        self.rings = 0

    def open_word_ring(self) -> None:
        self.rings += 1

    def post_words(self, writes: list[tuple[int, int]]) -> int:
        self.posts.append(list(writes))
        self.pending.append((len(self.posts), list(writes)))
        return len(self.posts)

    def landed(self, ticket: int) -> bool:
        return all(t != ticket for t, _ in self.pending)

    def wait_landed(self, ticket: int) -> None:
        self.land(sum(1 for t, _ in self.pending if t <= ticket))

    def land(self, count: int | None = None) -> None:
        """Land the oldest ``count`` batches (all by default), in order, as one stream copies them."""
        n = len(self.pending) if count is None else count
        for _ticket, writes in self.pending[:n]:
            for addr, value in writes:
                ctypes.c_uint64.from_address(addr).value = value
        del self.pending[:n]


def _u64(addr: int, count: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint64 * count).from_address(addr))


# --- shadow and mapped store ------------------------------------------------------------------------------
def test_shadow_update_returns_the_new_value() -> None:
    shadow = np.zeros(2, dtype=np.uint64)
    word = np.zeros(2, dtype=np.uint64)
    addr, waddr = int(shadow.ctypes.data), int(word.ctypes.data)
    assert _core.flag_shadow_publish(waddr, addr, int(SignalOp.ADD), 5) == 5
    assert _core.flag_shadow_publish(waddr, addr, int(SignalOp.ADD), 7) == 12
    assert _core.flag_shadow_publish(0, addr + 8, int(SignalOp.SET), 9) == 9  # shadow alone
    assert shadow.tolist() == [12, 9] and word.tolist() == [12, 0]
    with pytest.raises(ValueError):
        _core.flag_shadow_publish(0, addr + 4, 0, 1)


def _adder(shadow: mmap.mmap, word: mmap.mmap, n: int) -> None:
    s = ctypes.addressof(ctypes.c_char.from_buffer(shadow))
    w = ctypes.addressof(ctypes.c_char.from_buffer(word))
    for _ in range(n):
        _core.flag_shadow_publish(w, s, int(SignalOp.ADD), 1)


def test_two_processes_publishing_one_counter_leave_the_word_at_the_total() -> None:
    """Two rails' workers ADD into one shadow and store into one mapped word: the last store is the total."""
    shadow, word = mmap.mmap(-1, 4096), mmap.mmap(-1, 4096)  # shared: both children see them
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_adder, args=(shadow, word, 20000)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    total = int.from_bytes(shadow[:8], "little")
    assert total == 40000 and int.from_bytes(word[:8], "little") == total


# --- choosing a path ----------------------------------------------------------------------------------------
def test_without_gdrdrv_auto_chooses_loopback_and_says_why(tmp_path: Path) -> None:
    absent = str(tmp_path / "gdrdrv")
    choice = choose_publication("auto", receiver_publishes=True, loopback=None, gdrdrv_device=absent)
    assert choice.path == LOOPBACK and not choice.forced and choice.gdr is None
    assert f"{absent} is absent" in choice.reason
    with pytest.raises(ValueError, match="gdrcopy.*is absent"):
        choose_publication("gdrcopy", receiver_publishes=True, loopback=None, gdrdrv_device=absent)


def test_without_gdrdrv_or_loopback_flags_go_to_host_memory(tmp_path: Path) -> None:
    choice = choose_publication("auto", receiver_publishes=True, loopback="no RDMA write", gdrdrv_device=str(tmp_path))
    # (tmp_path exists but the library does not load: no GDRCopy either way)
    assert choice.path == HOST_MAPPED and "no RDMA write" in choice.reason
    with pytest.raises(ValueError, match="loopback.*no RDMA write"):
        choose_publication("loopback", receiver_publishes=True, loopback="no RDMA write", gdrdrv_device="/nonexistent")


def test_forced_paths_and_nic_written_flags() -> None:
    absent = "/nonexistent/gdrdrv"
    for setting, path in (("loopback", LOOPBACK), ("host-mapped", HOST_MAPPED), ("cuda-copy", CUDA_COPY)):
        choice = choose_publication(setting, receiver_publishes=True, loopback=None, gdrdrv_device=absent)
        assert (choice.path, choice.forced) == (path, True)
    assert "2.38 ms" in choose_publication("cuda-copy", receiver_publishes=True, loopback=None,
                                           gdrdrv_device=absent).reason
    assert choose_publication("auto", receiver_publishes=False, loopback=None, gdrdrv_device=absent).path == NIC
    with pytest.raises(ValueError, match="unknown"):
        choose_publication("bogus", receiver_publishes=True, loopback=None, gdrdrv_device=absent)


def test_gpu_flag_words_on_every_rail_path() -> None:
    """Device flags registered on a rail: its own path into GPU memory, else copies (host-mapped rails warn;
    on ib rails the NIC writes them and nothing here publishes)."""
    assert [words_path(p) for p in (GDRCOPY, LOOPBACK, CUDA_COPY, HOST_MAPPED, NIC)] == [
        GDRCOPY, LOOPBACK, CUDA_COPY, CUDA_COPY, CUDA_COPY]
    for path in (GDRCOPY, LOOPBACK, CUDA_COPY):  # each is one GpuFlagWords accepts
        shadow, fd = FlagFile.create_memfd(1)
        os.close(fd)
        GpuFlagWords(0, 1, shadow, path).release()
    shadow, fd = FlagFile.create_memfd(1)
    os.close(fd)
    with pytest.raises(ValueError, match="nic"):
        GpuFlagWords(0, 1, shadow, NIC)
    shadow.close()


def test_gdrdrv_present_but_no_library_falls_through(tmp_path: Path) -> None:
    node = tmp_path / "gdrdrv"
    node.touch()
    choice = choose_publication("auto", receiver_publishes=True, loopback=None, gdrdrv_device=str(node),
                                gdrcopy_library=str(tmp_path / "libgdrapi.so.2"))
    assert choice.path == LOOPBACK and "cannot load libgdrapi" in choice.reason
    with pytest.raises(GdrCopyError, match="not libgdrapi"):
        GdrCopy("libc.so.6")


def test_gdrdrv_and_a_library_choose_gdrcopy(tmp_path: Path, standin_library: str) -> None:
    node = tmp_path / "gdrdrv"
    node.touch()
    choice = choose_publication("auto", receiver_publishes=True, loopback=None, gdrdrv_device=str(node),
                                gdrcopy_library=standin_library)
    try:
        assert choice.path == GDRCOPY and choice.gdr is not None and standin_library in choice.reason
    finally:
        assert choice.gdr is not None
        choice.gdr.close()


# --- GDRCopy through the stand-in -----------------------------------------------------------------------------
class _Device:
    """'GPU memory' for the stand-in: a shared mapping (its pages can be mapped a second time), 64 KiB aligned."""

    def __init__(self) -> None:
        self.mm = mmap.mmap(-1, 4 * GPU_PAGE_SIZE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.base = (base + GPU_PAGE_SIZE - 1) & ~(GPU_PAGE_SIZE - 1)


def test_gdrcopy_maps_the_flag_pages_and_unmaps_them(standin_library: str) -> None:
    lib = ctypes.CDLL(standin_library)
    gdr = GdrCopy(standin_library)
    dev = _Device()
    flags_at = dev.base + GPU_PAGE_SIZE - 64  # straddles a GPU page boundary: two pages pinned
    mapping = gdr.map(flags_at, 16 * 8)
    try:
        assert (lib.standin_pins(), lib.standin_maps()) == (1, 1)
        assert mapping.size == 2 * GPU_PAGE_SIZE and mapping.ptr != flags_at
        shadow = np.zeros(16, dtype=np.uint64)
        _core.flag_shadow_publish(mapping.ptr + 8 * 3, int(shadow.ctypes.data) + 8 * 3, int(SignalOp.ADD), 41)
        assert _u64(flags_at, 16)[3] == 41  # the store through the mapping landed in the "GPU" memory
    finally:
        mapping.release()
        gdr.close()
    assert (lib.standin_pins(), lib.standin_maps(), lib.standin_open()) == (0, 0, 0)


def test_gdrcopy_flags_are_stored_by_the_compiled_path(make_link, standin_library: str) -> None:
    """The poster stores mapped flags itself (no Python publisher call), ADD through the shadow, SET too."""
    link: Link = make_link()
    gdr = GdrCopy(standin_library)
    dev = _Device()
    mapping = gdr.map(dev.base + 128, 8 * 8)
    shadow = np.zeros(8, dtype=np.uint64)
    words = _u64(dev.base + 128, 8)
    try:
        link.b.set_mapped_flags("job", 1, mapping.ptr, 8, int(shadow.ctypes.data))
        rows = [link.write(0, 4096, 0), link.signal(2, 5, 0), link.write(4096, 4096, 0), link.signal(2, 6, 0),
                link.signal(5, 99, 1, SignalOp.SET)]
        link.post(rows)
        wait_until(lambda: link.poll() >= 0 and words[2] == 11 and words[5] == 99, "the mapped flags", 10, interval=0)
        assert shadow[2] == 11 and shadow[5] == 99
        assert link.published == []  # no flag went to Python
        assert link.b.stats["published_mapped"] == 3 and link.b.stats["published_host"] == 0
        assert bytes(link.dst[:8192]) == bytes(link.src[:8192])
        link.b.clear_host_flags("job", 1)
    finally:
        mapping.release()
        gdr.close()


# --- loopback ------------------------------------------------------------------------------------------------
def _accessor_memory(link: Link, count: int = 8) -> tuple[np.ndarray, MemoryKey, HostAccessor]:
    """``count`` words the soft device reaches only through an accessor (as GPU memory), registered for remote
    writes and atomics: the words, their key, the accessor."""
    target = np.zeros(count, dtype=np.uint64)
    accessor = HostAccessor()
    key = link.b.register_memory(int(target.ctypes.data), target.nbytes, remote_write=True, remote_atomic=True,
                                 accessor=accessor)
    return target, key, accessor


def _loopback_words(link: Link, count: int = 8) -> tuple[GpuFlagWords, np.ndarray, HostAccessor]:
    """Flag words in memory the soft device reaches only through an accessor (as GPU memory), loopback path."""
    target, key, accessor = _accessor_memory(link, count)
    shadow, fd = FlagFile.create_memfd(count)
    os.close(fd)
    words = GpuFlagWords(int(target.ctypes.data), count, shadow, LOOPBACK, loopback=link.b.open_flag_loopback())
    words.rkey = key.rkey
    return words, target, accessor


def _settle(words: GpuFlagWords) -> None:
    """Hand completed loopback writes back and post what is owed until nothing is (RailFlags.end_pass, for one
    array of words)."""
    def done() -> bool:
        for w, slot, value in words.loopback.reap():
            w.written(slot, value)
        words.end_pass()
        return not words.busy

    wait_until(done, "the loopback writes", 10, interval=0)


def test_loopback_write_puts_the_shadow_value_into_the_flag_word(make_link) -> None:
    link: Link = make_link()
    words, target, accessor = _loopback_words(link)
    try:
        for _ in range(10):
            words.publish(3, SignalOp.ADD, 2)
        words.publish(4, SignalOp.SET, 77)
        assert target.tolist() == [0] * 8  # queued until the end of the pass
        words.end_pass()
        assert words.inflight == 2 and words.loopback.inflight == 2  # posted, not waited for
        _settle(words)
        assert target[3] == 20 and target[4] == 77 and words.shadow.values[3] == 20
        assert words.loopback.writes == 2  # one write per slot per pass, whatever the number of ADDs
        assert accessor.writes == 2 and accessor.reads == 0  # written through the "GPU" accessor, never read
        assert words.loopback.batches == 1 and words.loopback.wait_ns > 0
    finally:
        words.loopback.close()
        words.release()


def test_a_slot_published_while_its_write_is_on_the_wire_is_written_after_that_one(make_link) -> None:
    """SRD may deliver two writes of one word in either order: the second waits for the first's completion,
    then carries the shadow's value of that moment."""
    link: Link = make_link()
    words, target, _accessor = _loopback_words(link)
    try:
        words.publish(3, SignalOp.ADD, 2)
        words.end_pass()
        words.publish(3, SignalOp.ADD, 5)
        words.publish(5, SignalOp.ADD, 1)
        words.end_pass()  # slot 5 goes; slot 3 waits: its first write is still on the wire (nothing reaped)
        assert words.inflight == 2 and words.loopback.batches == 2
        _settle(words)
        assert target[3] == 7 and target[5] == 1
        assert words.loopback.writes == 3 and words.loopback.batches == 3
    finally:
        words.loopback.close()
        words.release()


def test_a_rail_whose_write_completes_after_the_shadow_moved_writes_again(make_link) -> None:
    """Two rails' workers publish one counter through the shared shadow, each with its own loopback QP, and
    their writes may land in either order: a write that completes after the shadow moved is followed by
    another carrying the shadow's value."""
    link: Link = make_link()
    words_a, target, _accessor = _loopback_words(link)
    words_b = GpuFlagWords(words_a.address, words_a.count, words_a.shadow, LOOPBACK,
                           loopback=link.b.open_flag_loopback())
    words_b.rkey = words_a.rkey
    try:
        words_a.publish(0, SignalOp.ADD, 1)
        words_a.end_pass()  # carries 1
        wait_until(lambda: target[0] == 1, "rail a's write", 10, interval=0)
        words_b.publish(0, SignalOp.ADD, 1)
        _settle(words_b)  # carries 2
        assert target[0] == 2 and words_a.busy  # a's completion not reaped yet
        target[0] = 1  # as if a's write had landed after b's
        _settle(words_a)
        assert target[0] == 2 == words_a.shadow.values[0]
        assert words_a.loopback.writes == 2  # its first, then the shadow's value once it moved
    finally:
        words_a.loopback.close()
        words_b.loopback.close()
        words_a.release()


def test_loopback_flags_of_arrivals_through_the_backend(make_link) -> None:
    """End to end on the soft NIC: arrivals -> on_pass -> shadow -> loopback writes posted at the end of the poll,
    reaped on the polls after it (the backend calls every poll while some are on the wire)."""
    link: Link = make_link()
    words, target, _accessor = _loopback_words(link)
    rail_flags = RailFlags(link.b, PublicationChoice(LOOPBACK, "test"), gpu=None, conn_jobs={link.conn: "job"},
                           rail=0)
    rail_flags.loopback = words.loopback
    rail_flags.arrays[("job", 1)] = (words, None)
    try:
        for i in range(20):
            link.post([link.write(i * 4096, 4096, 0), link.signal(1, 1, i + 1)])
        link.post([link.signal(6, 1234, 99, SignalOp.SET)])
        wait_until(lambda: link.poll() >= 0 and target[1] == 20 and target[6] == 1234 and not words.busy,
                   "the loopback flags", 20, interval=0)
        assert bytes(link.dst[:20 * 4096]) == bytes(link.src[:20 * 4096])
        assert words.loopback.writes <= 21
        wait_until(lambda: link.poll() >= 0 and not link.b._want_pass, "the last poll that wanted a pass", 10,
                   interval=0)
    finally:
        words.loopback.close()
        words.release()


def test_a_rank_that_leaves_with_loopback_writes_on_the_wire_waits_for_them(make_link) -> None:
    """Its flag words are deregistered as it leaves: a write still on the wire would then fail, and a failed
    write fails the rail's loopback for every rank, so the writes are waited for first."""
    link: Link = make_link()
    target, key, _accessor = _accessor_memory(link)
    shadow, fd = FlagFile.create_memfd(8)
    os.close(fd)
    words = GpuFlagWords(int(target.ctypes.data), 8, shadow, LOOPBACK, loopback=link.b.open_flag_loopback())
    words.rkey = key.rkey
    rail_flags = RailFlags(link.b, PublicationChoice(LOOPBACK, "test"), gpu=None, conn_jobs={link.conn: "job"},
                           rail=0)
    rail_flags.loopback = words.loopback
    rail_flags.arrays[("job", 1)] = (words, key)
    try:
        rail_flags.publish(link.conn, 1, 2, SignalOp.ADD, 5)
        assert rail_flags.end_pass() is True and words.inflight == 1  # posted, not reaped
        rail_flags.drop("job", 1)
        assert words.loopback.inflight == 0 and target[2] == 5 and ("job", 1) not in rail_flags.arrays
        assert rail_flags.end_pass() is False  # nothing owed any more
    finally:
        words.loopback.close()


def _copy_words(target: np.ndarray, shadow: FlagFile, copier: WordCopies) -> GpuFlagWords:
    return GpuFlagWords(int(target.ctypes.data), len(target), shadow, CUDA_COPY, accessor=copier)


@pytest.fixture
def shadow() -> Iterator[FlagFile]:
    flags, fd = FlagFile.create_memfd(8)
    os.close(fd)
    yield flags
    flags.close()


def test_cuda_copy_posts_a_pass_of_flags_as_one_batch_and_waits_for_none(shadow: FlagFile) -> None:
    """Updates go to the shadow; the end of the pass posts each queued slot's value once (adjacent slots
    together) without waiting; the words stay busy until their batch landed."""
    target = np.zeros(8, dtype=np.uint64)
    copier = WordCopies()
    words = _copy_words(target, shadow, copier)
    for _ in range(3):
        words.publish(2, SignalOp.ADD, 1)
    words.publish(3, SignalOp.SET, 7)
    words.publish(6, SignalOp.ADD, 5)
    assert copier.posts == [] and words.busy
    words.end_pass()
    base = words.address
    assert copier.posts == [[(base + 16, 3), (base + 24, 7), (base + 48, 5)]] and target.sum() == 0
    words.end_pass()  # nothing new: nothing posted, still waiting for the batch
    assert len(copier.posts) == 1 and words.busy
    copier.land()
    words.end_pass()
    assert target.tolist() == [0, 0, 3, 7, 0, 0, 5, 0] and not words.busy and words.copies == 3


def test_a_cuda_copy_of_a_value_the_shadow_passed_is_written_again(shadow: FlagFile) -> None:
    """Two rails' workers publish one counter through the shared shadow, each with its own copy stream: a
    batch that lands after the other's newer value is followed by the shadow's value. A worker's own
    later batch of the slot does not cause a rewrite."""
    target = np.zeros(8, dtype=np.uint64)
    copier_a, copier_b = WordCopies(), WordCopies()
    words_a, words_b = _copy_words(target, shadow, copier_a), _copy_words(target, shadow, copier_b)
    words_a.publish(0, SignalOp.ADD, 1)
    words_a.end_pass()  # carries 1
    words_b.publish(0, SignalOp.ADD, 1)
    words_b.end_pass()  # carries 2
    copier_b.land()
    copier_a.land()  # a's lands last: the word went back to 1
    assert target[0] == 1
    words_b.end_pass()
    assert not words_b.busy and len(copier_b.posts) == 1  # b's value was the shadow's
    words_a.end_pass()  # a's landed with 1, the shadow holds 2: written again
    assert copier_a.posts[-1] == [(words_a.address, 2)]
    copier_a.land()
    words_a.end_pass()
    assert target[0] == 2 and not words_a.busy
    for _ in range(2):  # a's own two batches of one slot: the older one's value is passed, no rewrite
        words_a.publish(1, SignalOp.ADD, 1)
        words_a.end_pass()
    copier_a.land()
    words_a.end_pass()
    assert target[1] == 2 and len(copier_a.posts) == 4 and not words_a.busy


def test_cuda_copy_words_keep_the_pass_asking_until_they_landed(make_link, shadow: FlagFile) -> None:
    """RailFlags: a rank's cuda-copy words are busy from the publish until their batch landed, so the backend
    keeps calling end_pass after its polls, and then stops."""
    target = np.zeros(8, dtype=np.uint64)
    copier = WordCopies()
    words = _copy_words(target, shadow, copier)
    link: Link = make_link()
    rail_flags = RailFlags(link.b, PublicationChoice(CUDA_COPY, "test"), gpu=None, conn_jobs={5: "job"}, rail=0)
    rail_flags.arrays[("job", 1)] = (words, None)
    rail_flags.publish(5, 1, 4, SignalOp.ADD, 9)
    assert rail_flags.end_pass() is True and copier.posts == [[(words.address + 32, 9)]]
    assert rail_flags.end_pass() is True  # not landed yet
    copier.land()
    assert rail_flags.end_pass() is False and target[4] == 9


def test_a_rank_that_leaves_with_flag_copies_posted_waits_for_them(make_link, shadow: FlagFile) -> None:
    """Its flag words' memory is closed as it leaves: a copy still queued would write into memory that is
    gone, so the posted batches land first (owed slots, which nobody waits for any more, are dropped)."""
    link: Link = make_link()
    target, key, _accessor = _accessor_memory(link)
    copier = WordCopies()
    words = _copy_words(target, shadow, copier)
    rail_flags = RailFlags(link.b, PublicationChoice(CUDA_COPY, "test"), gpu=None, conn_jobs={link.conn: "job"},
                           rail=0)
    rail_flags.arrays[("job", 1)] = (words, key)
    rail_flags.publish(link.conn, 1, 2, SignalOp.ADD, 5)
    assert rail_flags.end_pass() is True and copier.pending
    rail_flags.publish(link.conn, 1, 3, SignalOp.ADD, 1)  # owed, not posted
    rail_flags.drop("job", 1)
    assert copier.pending == [] and target[2] == 5 and target[3] == 0 and len(copier.posts) == 1
    assert ("job", 1) not in rail_flags.arrays and rail_flags.end_pass() is False
    assert rail_flags.copied_words() == 1


def test_a_failed_loopback_falls_back_to_copies(make_link) -> None:
    link: Link = make_link()
    words, target, _accessor = _loopback_words(link)
    try:
        words.rkey ^= 0x5A5A  # a bad key: the loopback write fails with a remote access error
        words.publish(0, SignalOp.ADD, 3)
        words.end_pass()  # posted: the failure comes with its completion
        with pytest.raises(Exception, match="loopback flag write failed"):
            words.loopback.reap(wait=True)
        assert words.loopback.inflight == 0  # the failed write's entry is free again
        copier = WordCopies()
        words.fall_back_to_copy(copier)  # what RailFlags.end_pass does: the queued slot is posted
        assert words.path == CUDA_COPY and copier.posts == [[(words.address, 3)]] and target[0] == 0
        copier.land()
        assert target[0] == 3
        words.publish(0, SignalOp.ADD, 4)
        words.end_pass()
        copier.land()
        assert target[0] == 7 and len(copier.posts) == 2
    finally:
        words.loopback.close()
        words.release()
