"""`slurmgpu serve --workers N`: the workers as deployed (a subprocess: a fork of the threaded test
process would not be the daemon), their shared connection counts, and the faster tree evaluator."""

from __future__ import annotations

import fcntl
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_serve import sock  # noqa: F401 - fixture

from slurmgpu.apps import serve
from slurmgpu.apps.serve_workers import SharedCounts
from slurmgpu.pipeline.bundle import StackedTrees, TreeEnsemble
from slurmgpu.pipeline.features import NUMERIC

SAMPLE = Path(__file__).resolve().parent.parent / "contrib" / "slurmgpu.toml"
JOB = {"script": "#!/bin/bash\ntrue\n", "tres_per_node": "gres:gpu:v100:1", "partition": "gpu-small",
       "user_name": "ann"}


def reference(trees: TreeEnsemble, x: list[float]) -> float:
    """The evaluator predict replaced: a test per split, leaves summed in tree order."""
    total = 0.0
    for splits, leaves in trees.trees:
        index = 0
        for bit, (feature, border) in enumerate(splits):
            if x[feature] > border:
                index |= 1 << bit
        total += leaves[index]
    return trees.scale * total + trees.bias


def random_trees(rnd: random.Random, depth: int, borders: list[float]) -> TreeEnsemble:
    """300 oblivious trees of 1 to ``depth`` splits on the given borders."""
    data = {"trees": [{"splits": [[rnd.randrange(len(NUMERIC)), rnd.choice(borders)]
                                  for _ in range(rnd.randint(1, depth))]} for _ in range(300)],
            "scale": rnd.uniform(0.5, 2), "bias": rnd.uniform(-1, 1)}
    for tree in data["trees"]:
        tree["leaves"] = [rnd.uniform(-1, 1) for _ in range(1 << len(tree["splits"]))]
    return TreeEnsemble(data)


def random_row(rnd: random.Random, borders: list[float]) -> list[float]:
    """Values on the borders, between them, and NaN."""
    return [rnd.choice([rnd.choice(borders), rnd.uniform(-4, 4), float("nan")]) for _ in NUMERIC]


@pytest.mark.parametrize("depth", [3, 6, 10])
def test_fast_tree_evaluation_is_bit_identical(depth: int) -> None:
    rnd = random.Random(depth)
    borders = [rnd.uniform(-3, 3) for _ in range(40)]
    trees = random_trees(rnd, depth, borders)
    for _ in range(500):
        x = random_row(rnd, borders)
        assert trees.predict(x) == reference(trees, x)


@pytest.mark.parametrize("depth", [3, 6, 10])
def test_ensembles_stacked_in_one_numpy_pass_are_bit_identical(depth: int) -> None:
    """The daemon's evaluation (numpy loaded, several rows): ensembles of different depths in one
    pass give each row the float the per-split reference gives, row by row."""
    pytest.importorskip("numpy")
    rnd = random.Random(depth)
    borders = [rnd.uniform(-3, 3) for _ in range(40)]
    ensembles = [random_trees(rnd, depth, borders), random_trees(rnd, 2, borders), random_trees(rnd, depth, borders)]
    stacked = StackedTrees(ensembles)
    for _ in range(60):
        rows = [random_row(rnd, borders) for _ in range(rnd.randint(2, 30))]
        for trees, got in zip(ensembles, stacked.predict_many(rows), strict=True):
            assert got == [reference(trees, x) for x in rows]
        assert ensembles[0].predict_many(rows) == [reference(ensembles[0], x) for x in rows]


def test_a_worker_killed_holding_the_count_lock_does_not_stall_the_others() -> None:
    shared = SharedCounts(rows=4, slots=8)
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child takes the lock and waits to be killed
        with shared.lock:
            os.write(ready_w, b"x")
            time.sleep(60)
        os._exit(0)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"x"
        with pytest.raises(OSError):  # held by another process: the lock is between processes
            fcntl.lockf(shared.lock.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(ready_r)
    taken = threading.Event()

    def take() -> None:
        with shared.lock:
            shared.view(0).add(1000, 1)
            taken.set()

    threading.Thread(target=take, daemon=True).start()
    assert taken.wait(5), "the dead worker's lock was never released"
    assert shared.view(1)[1000] == 1


def test_shared_counts_across_workers_reused_slots_and_a_dead_worker() -> None:
    """Totals kept per worker row and uids' slots remembered per process stay what counting every
    slot says: through slots freed and taken by another uid, from two processes' views, and after
    a dead worker's row is cleared."""
    shared = SharedCounts(rows=3, slots=4)
    mine, other = shared.view(0), shared.view(1)

    def counted() -> dict[int, int]:
        return {uid - 1: shared.of(slot) for slot, uid in enumerate(shared.uids[:]) if uid}

    with shared.lock:
        mine.add(1000, 2)
        other.add(1000, 1)
        other.add(2000, 1)
    assert counted() == {1000: 3, 2000: 1} and mine.total() == other.total() == 4
    with shared.lock:
        mine.add(1000, -2)
        other.add(1000, -1)  # 1000's slot is free now ...
        other.add(3000, 1)  # ... and taken by 3000, where this process last found 1000
    assert mine[1000] == 0 and mine[3000] == 1 and counted() == {2000: 1, 3000: 1}
    with shared.lock:
        mine.add(1000, 1)
    assert mine[1000] == 1 and counted() == {1000: 1, 2000: 1, 3000: 1} and mine.total() == 3
    shared.clear(1)  # worker 1 died
    assert counted() == {1000: 1} and mine.total() == 1 and other[2000] == 0


def workers_of(pid: int) -> set[int]:
    return {int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}


def wait_for(what: Callable[[], bool], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_serve_workers_answer_reload_without_dropping_a_request_and_replace_a_killed_one(sock: str,  # noqa: F811
                                                                                         tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "slurmgpu"
    log = (tmp_path / "serve.log").open("w")  # a line per decision: a pipe nobody reads would fill and stall it
    proc = subprocess.Popen([str(exe), "--config", str(SAMPLE), "serve", "--socket", sock, "--group", "",
                             "--slurm-user", "", "--workers", "2"], stderr=log)
    answers: list[dict | None] = []
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            answers.append(serve.ask(sock, JOB, timeout_s=5))

    try:
        wait_for(lambda: serve.call(sock, {"op": "health"}) is not None and len(workers_of(proc.pid)) == 2)
        first = workers_of(proc.pid)
        sender = threading.Thread(target=traffic)
        sender.start()
        try:
            wait_for(lambda: len(answers) > 20)
            proc.send_signal(signal.SIGHUP)  # new workers first, then the old ones drain
            wait_for(lambda: not workers_of(proc.pid) & first and len(workers_of(proc.pid)) == 2)
            during = len(answers)
            wait_for(lambda: len(answers) > during + 20)
        finally:
            stop.set()
            sender.join(10)
        assert answers and all(a is not None and a["apply"] == {"partition": "gpu"} for a in answers)
        second = workers_of(proc.pid)
        killed = min(second)
        os.kill(killed, signal.SIGKILL)
        wait_for(lambda: killed not in workers_of(proc.pid) and len(workers_of(proc.pid)) == 2)
        assert all(serve.ask(sock, JOB, timeout_s=5) for _ in range(10))
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        log.close()
    err = (tmp_path / "serve.log").read_text()
    assert proc.returncode == 0, err[-2000:]
    assert f"worker {killed} ended (signal 9): starting another" in err
    assert not os.path.exists(sock)


def test_every_thread_of_the_supervisor_leaves_sigterm_to_it(sock: str, tmp_path: Path) -> None:  # noqa: F811
    """The metrics server's thread took a SIGTERM that came while the supervisor waited for its
    workers: the default action killed the supervisor and left the workers running, orphaned."""
    exe = Path(sys.executable).parent / "slurmgpu"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(exe), "--config", str(SAMPLE), "serve", "--socket", sock, "--group", "",
                             "--slurm-user", "", "--workers", "2", "--metrics-port", str(port),
                             "--metrics-dir", str(tmp_path / "metrics")], stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: serve.call(sock, {"op": "health"}) is not None and len(workers_of(proc.pid)) == 2)
        workers = workers_of(proc.pid)
        threads = [t for t in os.listdir(f"/proc/{proc.pid}/task") if t != str(proc.pid)]
        blocked = {t: int(next(ln for ln in Path(f"/proc/{proc.pid}/task/{t}/status").read_text().splitlines()
                               if ln.startswith("SigBlk:")).split()[1], 16) for t in threads}
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert threads, "the metrics server runs in a thread of the supervisor"
    assert all(mask & 1 << (signal.SIGTERM - 1) for mask in blocked.values()), blocked
    assert proc.returncode == 0, err[-2000:]
    assert not [w for w in workers if os.path.exists(f"/proc/{w}")]
