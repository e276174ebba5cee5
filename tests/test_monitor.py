"""slurmgpu-monitor: aggregation against a hand-checked trace, GPU selection, the atomic spool
write, every way it must fail quietly, the record validator, the CLI, and the Prolog/Epilog."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
import types
from datetime import UTC, datetime
from pathlib import Path

import pytest

from slurmgpu.collector import devices, monitor, records
from slurmgpu.collector.devices import DeviceInfo, NvmlDevices, RecordedDevices, select_gpus
from slurmgpu.collector.monitor import Collector, main
from slurmgpu.collector.records import GpuRecord, JobRecord, read_record, write_record

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "tests" / "fixtures" / "nvml_trace_2xa100.json"
CONTRIB = ROOT / "contrib" / "monitor"
MIB = 1 << 20
UUID0 = "GPU-6f2a9c1e-3b4d-4e5f-8a7b-0c1d2e3f4a5b"
UUID1 = "GPU-0b8e7d6c-5a49-4382-9170-fedcba987654"
A100 = "NVIDIA A100-SXM4-80GB"
# By hand from the fixture (MiB): GPU 0 used 512 20480 40960 61440 61952 30720, util 0 40 80 95 100 45;
# GPU 1 used 512 10240 20480 20480 25600 512, util 0 20 30 30 40 0.
HAND = (
    GpuRecord(0, UUID0, A100, 81920.0, 61952.0, 61440.0, 360 / 6, 100.0, 6),
    GpuRecord(1, UUID1, A100, 81920.0, 25600.0, 25088.0, 120 / 6, 40.0, 6),
)


class FakeTime:
    """A clock that only moves when the collector sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def collector(trace: Path = TRACE, **kw: object) -> tuple[Collector, FakeTime]:
    t = FakeTime()
    devices = RecordedDevices(str(trace))
    return Collector(devices, devices.devices(), kw.pop("interval", 5.0), clock=t.clock, sleep=t.sleep,
                     **kw), t  # type: ignore[arg-type]


def write_trace(path: Path, n: int, processes: bool = True) -> Path:
    sample = {"memory": {"used": 1024 * MIB}, "utilization": {"gpu": 50, "memory": 5},
              "processes": [{"pid": 1, "usedGpuMemory": 1000 * MIB}] if processes else None}
    path.write_text(json.dumps({"devices": [{"index": 0, "uuid": UUID0, "name": A100,
                                             "memory": {"total": 81920 * MIB}, "samples": [sample] * n}]}))
    return path


@pytest.fixture
def job_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (*devices.GPU_ENV_VARS, "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "c1")
    monkeypatch.setenv("SLURMD_NODENAME", "node7")
    monkeypatch.setenv("SLURM_JOB_USER", "alice")


def only_warning(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("slurmgpu-monitor: warning: "), err
    return err[0]


# ---- aggregation ---------------------------------------------------------------------------------

def test_aggregates_match_the_hand_computed_values() -> None:
    c, t = collector()
    got = c.run()
    assert got.gpus == HAND
    assert (got.samples, got.peak_gpu_mem_mib, got.mean_gpu_util, got.max_gpu_util) == (6, 61952.0, 40.0, 100.0)
    assert t.sleeps == [5.0] * 6  # the trace ends at the 7th tick; nothing slept for real


def test_duration_bounds_the_run_and_the_last_sleep() -> None:
    c, t = collector(interval=4.0, duration=10.0)
    got = c.run()
    assert got.samples == 3 and t.sleeps == [4.0, 4.0, 2.0]  # ticks at 0, 4, 8; stop at 10
    assert got.gpus[0].peak_mem_mib == 40960.0 and got.gpus[0].mean_util == 40.0


def test_stop_event_ends_the_run() -> None:
    c, t = collector()
    real_sleep = t.sleep

    def sleep(seconds: float) -> None:
        real_sleep(seconds)
        if len(t.sleeps) == 2:
            c.stop.set()

    c._sleep = sleep
    assert c.run().samples == 2


def test_exit_of_the_job_pid_ends_the_run() -> None:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    c, _ = collector(pid=done.pid)
    got = c.run()
    assert got.samples == 1
    assert got.gpus[0].peak_proc_mem_mib == 0.0  # the fixture's PIDs are not below the (gone) job PID
    assert monitor._alive(os.getpid()) and not monitor._alive(done.pid)


def test_process_tree_contains_children() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert {os.getpid(), child.pid} <= monitor._process_tree(os.getpid())
        assert os.getppid() not in monitor._process_tree(os.getpid())
    finally:
        child.kill()
        child.wait()


def test_per_process_memory_filtered_by_pid_and_null_when_unsupported(tmp_path: Path) -> None:
    d = RecordedDevices(str(TRACE))
    d.sample(1, None)
    assert d.sample(1, {4243}).proc_memory == 10200547328
    assert d.sample(1, {4242}).proc_memory == 0
    c, _ = collector(write_trace(tmp_path / "t.json", 3, processes=False))
    assert c.run().gpus[0].peak_proc_mem_mib is None


# ---- which GPUs are the job's -----------------------------------------------------------------------

DEVS = [DeviceInfo(0, UUID0, A100, 81920 * MIB), DeviceInfo(1, UUID1, A100, 81920 * MIB),
        DeviceInfo(2, "GPU-aaaa0000-0000-0000-0000-000000000002", A100, 81920 * MIB)]


@pytest.mark.parametrize(("env", "want"), [
    ({}, [0, 1, 2]),
    ({"CUDA_VISIBLE_DEVICES": "1"}, [1]),
    ({"CUDA_VISIBLE_DEVICES": "2,0"}, [2, 0]),
    ({"SLURM_JOB_GPUS": "0,2"}, [0, 2]),
    ({"GPU_DEVICE_ORDINAL": "1"}, [1]),
    ({"CUDA_VISIBLE_DEVICES": UUID1}, [1]),
    ({"CUDA_VISIBLE_DEVICES": f"{UUID1},{UUID0}"}, [1, 0]),
    ({"CUDA_VISIBLE_DEVICES": "GPU-0b8e7d"}, [1]),  # unique prefix, as CUDA accepts
    ({"CUDA_VISIBLE_DEVICES": "0", "SLURM_JOB_GPUS": "2"}, [0]),  # first variable set wins
    ({"SLURM_JOB_GPUS": "1", "GPU_DEVICE_ORDINAL": "2"}, [1]),
    ({"CUDA_VISIBLE_DEVICES": "1,1, 7"}, [1]),  # repeats and unknown indices dropped
    ({"CUDA_VISIBLE_DEVICES": ""}, []),
    ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, []),
    ({"CUDA_VISIBLE_DEVICES": "MIG-1234"}, []),
    ({"CUDA_VISIBLE_DEVICES": "GPU-"}, []),  # ambiguous prefix
])
def test_select_gpus(env: dict[str, str], want: list[int]) -> None:
    assert [d.index for d in select_gpus(DEVS, env)] == want


# ---- NVML through a stand-in module ------------------------------------------------------------

def fake_pynvml(fail_after: int | None = None, procs_supported: bool = True) -> types.ModuleType:
    """Just the pynvml calls NvmlDevices makes: GPU 1 is hidden by the device cgroup, names come as bytes."""
    nv = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    class NVMLError_NoPermission(NVMLError):  # noqa: N801 - pynvml's names
        pass

    class NVMLError_NotSupported(NVMLError):  # noqa: N801
        pass

    calls = {"mem": 0}

    def memory(handle: int) -> types.SimpleNamespace:
        calls["mem"] += 1
        if fail_after is not None and calls["mem"] > fail_after:
            raise NVMLError("GPU is lost")
        return types.SimpleNamespace(total=40960 * MIB, used=(1000 + handle) * MIB, free=0)

    def handle_by_index(i: int) -> int:
        if i == 1:
            raise NVMLError_NoPermission("Insufficient Permissions")
        return i

    def procs(handle: int) -> list[types.SimpleNamespace]:
        if not procs_supported:
            raise NVMLError_NotSupported("Not Supported")
        return [types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=900 * MIB),
                types.SimpleNamespace(pid=1, usedGpuMemory=50 * MIB)]

    nv.__dict__.update(
        NVMLError=NVMLError, NVMLError_NoPermission=NVMLError_NoPermission,
        NVMLError_NotSupported=NVMLError_NotSupported, nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 3, nvmlDeviceGetHandleByIndex=handle_by_index,
        nvmlDeviceGetUUID=lambda h: f"GPU-{h:08d}".encode(), nvmlDeviceGetName=lambda h: b"NVIDIA A100-PCIE-40GB",
        nvmlDeviceGetMemoryInfo=memory, nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=70, memory=3),
        nvmlDeviceGetComputeRunningProcesses=procs)
    return nv


def test_nvml_devices_read_through_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    d = NvmlDevices()
    assert d.devices() == [DeviceInfo(0, "GPU-00000000", "NVIDIA A100-PCIE-40GB", 40960 * MIB),
                           DeviceInfo(2, "GPU-00000002", "NVIDIA A100-PCIE-40GB", 40960 * MIB)]
    assert d.sample(2, None) == devices.Sample(1002 * MIB, 70.0, 950 * MIB)
    assert d.sample(2, {os.getpid()}).proc_memory == 900 * MIB
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(procs_supported=False))
    d = NvmlDevices()
    d.devices()
    assert d.sample(0, None).proc_memory is None


# ---- the spool record ------------------------------------------------------------------------------

def make_record(**kw: object) -> JobRecord:
    fields = dict(version=1, source="nvml", cluster="c1", job_id="123_4", hostname="node7", user="alice",
                  start=datetime(2024, 5, 1, 12, 0, tzinfo=UTC), end=datetime(2024, 5, 1, 13, 0, tzinfo=UTC),
                  interval_s=5.0, samples=6, gpus=HAND, peak_gpu_mem_mib=61952.0, mean_gpu_util=40.0,
                  max_gpu_util=100.0)
    fields.update(kw)
    return JobRecord(**fields)  # type: ignore[arg-type]


def test_write_record_is_atomic_mode_0640_and_round_trips(tmp_path: Path) -> None:
    path = write_record(make_record(), str(tmp_path))
    assert os.listdir(tmp_path) == ["c1_123_4_node7.json"]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    assert read_record(path) == make_record()
    data = json.loads(Path(path).read_text())
    assert list(data) == list(JobRecord._fields) and data["start"] == "2024-05-01T12:00:00Z"


def test_a_reader_never_sees_a_partial_record(tmp_path: Path) -> None:
    big = tuple(HAND[0]._replace(index=i, name="x" * 2000) for i in range(200))  # ~0.5 MB per write
    stop, seen, bad = threading.Event(), [0], []

    def reader() -> None:
        path = tmp_path / "c1_123_4_node7.json"
        while not stop.is_set():
            try:
                text = path.read_bytes()
            except FileNotFoundError:
                continue
            try:
                json.loads(text)
                seen[0] += 1
            except ValueError:
                bad.append(len(text))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for n in range(30):
            write_record(make_record(gpus=big, samples=n + 1), str(tmp_path))
    finally:
        stop.set()
        t.join()
    assert not bad and seen[0] > 0
    assert os.listdir(tmp_path) == ["c1_123_4_node7.json"]


@pytest.mark.parametrize(("change", "field"), [
    (lambda d: d.pop("hostname"), "hostname: missing"),
    (lambda d: d.update(version=3), "version: expected one of 1, 2, got 3"),
    (lambda d: d.update(version="2"), 'version: expected one of 1, 2, got "2"'),
    (lambda d: d.update(samples="6"), 'samples: expected int, got "6"'),
    (lambda d: d.update(samples=True), "samples: expected int, got true"),
    (lambda d: d.update(user=3), "user: expected string or null, got 3"),
    (lambda d: d.update(start="yesterday"), 'start: expected ISO-8601 UTC time, got "yesterday"'),
    (lambda d: d.update(end="2024-05-01T13:00:00+02:00"), "end: expected ISO-8601 UTC time"),
    (lambda d: d.update(end="2024-05-01T11:00:00Z"), "end: before start"),
    (lambda d: d.update(job_id="abc"), "job_id: expected a Slurm job id"),
    (lambda d: d.update(gpus=[]), "gpus: expected a non-empty list"),
    (lambda d: d["gpus"][1].update(peak_mem_mib="x"), 'gpus[1].peak_mem_mib: expected number, got "x"'),
    (lambda d: d["gpus"][0].pop("uuid"), "gpus[0].uuid: missing"),
    (lambda d: d["gpus"].append(7), "gpus[2]: expected an object"),
    # what a database column cannot hold: a record is checked before it reaches one
    (lambda d: d.update(samples=2**31), "samples: expected int of at most 31 bits"),
    (lambda d: d.update(hostname="n" * 129), "hostname: expected 1 to 128 characters"),
    (lambda d: d.update(source=""), "source: expected 1 to 16 characters"),
    (lambda d: d.update(cluster="c\u0000"), "cluster: expected string of at most 256 characters, no NUL"),
    (lambda d: d["gpus"][0].update(name="\ud800"), "gpus[0].name: expected string of at most 256 characters"),
    (lambda d: d.update(gpus=d["gpus"] * 129), "gpus: expected a non-empty list of at most 256 GPUs"),
])
def test_read_record_names_the_file_and_the_field(tmp_path: Path, change: object, field: str) -> None:
    data = records.record_to_json(make_record())
    change(data)  # type: ignore[operator]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as err:
        read_record(str(path))
    assert str(err.value).startswith(f"{path}: {field}")


def test_read_record_rejects_what_is_not_json(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text('{"version": 1, "cluster": ')
    with pytest.raises(ValueError, match=f"^{path}: not JSON"):
        read_record(str(path))
    for text in ('{"version": NaN}', "[" * 100_000 + "]" * 100_000):  # no NaN, no stack overflow
        with pytest.raises(ValueError, match="^where: not JSON"):
            records.parse_record(text.encode(), "where")
    text = json.dumps(records.record_to_json(make_record())).replace('"peak_gpu_mem_mib": 61952.0',
                                                                      '"peak_gpu_mem_mib": 1e999')
    with pytest.raises(ValueError, match="^where: peak_gpu_mem_mib: expected a finite number"):
        records.parse_record(text.encode(), "where")


def test_read_record_accepts_ints_for_floats_and_null_proc_memory(tmp_path: Path) -> None:
    data = records.record_to_json(make_record())
    data["gpus"][0].update(peak_mem_mib=61952, peak_proc_mem_mib=None)
    data["extra"] = "ignored"
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    got = read_record(str(path))
    assert type(got.gpus[0].peak_mem_mib) is float and got.gpus[0].peak_proc_mem_mib is None


# ---- the command line, end to end ---------------------------------------------------------------

@pytest.mark.usefixtures("job_env")
def test_main_replays_the_trace_into_a_valid_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "123")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "4")
    monkeypatch.setenv("SLURM_JOB_ID", "130")
    assert main(["run", "--spool", str(tmp_path), "--recorded", str(TRACE), "--interval", "0.005",
                 "--duration", "30"]) == 0
    assert capsys.readouterr().err == ""
    record = read_record(str(tmp_path / "c1_123_4_node7.json"))
    assert record.gpus == HAND and record.samples == 6 and record.user == "alice"
    assert (record.peak_gpu_mem_mib, record.mean_gpu_util, record.max_gpu_util) == (61952.0, 40.0, 100.0)
    assert record.interval_s == 0.005 and record.start <= record.end
    assert os.listdir(tmp_path) == ["c1_123_4_node7.json"]


@pytest.mark.usefixtures("job_env")
def test_main_keeps_to_the_job_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-0b8e")
    assert main(["run", "--job-id", "77+1", "--cluster", "other", "--spool", str(tmp_path), "--recorded", str(TRACE),
                 "--interval", "0.005"]) == 0
    record = read_record(str(tmp_path / "other_77+1_node7.json"))
    assert record.gpus == HAND[1:]
    assert (record.peak_gpu_mem_mib, record.mean_gpu_util, record.max_gpu_util) == (25600.0, 20.0, 40.0)


@pytest.mark.usefixtures("job_env")
def test_main_stops_after_duration(tmp_path: Path) -> None:
    long = write_trace(tmp_path / "long.json", 5000)
    spool = tmp_path / "spool"
    spool.mkdir()
    t0 = time.monotonic()
    assert main(["run", "--job-id", "8", "--spool", str(spool), "--recorded", str(long),
                 "--interval", "0.01", "--duration", "0.2"]) == 0
    assert time.monotonic() - t0 < 5
    assert 1 <= read_record(str(spool / "c1_8_node7.json")).samples <= 21


@pytest.mark.usefixtures("job_env")
def test_main_needs_a_job_id_and_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--spool", str(tmp_path)])
    assert exit_.value.code == 2
    monkeypatch.delenv("SLURM_CLUSTER_NAME")
    with pytest.raises(SystemExit):
        main(["run", "--job-id", "5", "--spool", str(tmp_path)])
    with pytest.raises(SystemExit):
        main(["run", "--job-id", "5; rm", "--cluster", "c", "--spool", str(tmp_path)])


# ---- it never fails the job -------------------------------------------------------------------------

RUN = ["run", "--job-id", "5", "--duration", "1", "--interval", "0.01"]


@pytest.mark.usefixtures("job_env")
def test_nvml_import_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    assert main([*RUN, "--spool", str(tmp_path)]) == 0
    assert "NVML unavailable" in only_warning(capsys)
    assert os.listdir(tmp_path) == []


@pytest.mark.usefixtures("job_env")
def test_nvml_failing_at_init_or_mid_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    broken = fake_pynvml()

    def no_driver() -> None:
        raise broken.NVMLError("Driver Not Loaded")

    broken.nvmlInit = no_driver
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    assert main([*RUN, "--spool", str(tmp_path)]) == 0
    assert "NVML failed: Driver Not Loaded" in only_warning(capsys)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(fail_after=5))  # 2 for devices(), then 3 samples
    assert main([*RUN, "--spool", str(tmp_path)]) == 0
    assert "GPU is lost" in only_warning(capsys)
    assert os.listdir(tmp_path) == []


@pytest.mark.usefixtures("job_env")
def test_fake_nvml_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    monkeypatch.setenv("SLURM_JOB_GPUS", "2")
    assert main([*RUN[:-4], "--duration", "0.05", "--interval", "0.01", "--pid", str(os.getpid()),
                 "--spool", str(tmp_path)]) == 0
    (gpu,) = read_record(str(tmp_path / "c1_5_node7.json")).gpus
    assert (gpu.index, gpu.peak_mem_mib, gpu.peak_proc_mem_mib, gpu.mean_util) == (2, 1002.0, 900.0, 70.0)


@pytest.mark.usefixtures("job_env")
def test_no_gpus_for_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "NoDevFiles")
    assert main([*RUN, "--spool", str(tmp_path), "--recorded", str(TRACE)]) == 0
    assert "no GPUs" in only_warning(capsys) and os.listdir(tmp_path) == []


@pytest.mark.usefixtures("job_env")
def test_broken_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"devices": [{"index": 0}]}')
    spool = tmp_path / "spool"
    spool.mkdir()
    assert main([*RUN, "--spool", str(spool), "--recorded", str(bad)]) == 0
    assert "recorded trace" in only_warning(capsys) and os.listdir(spool) == []


@pytest.mark.usefixtures("job_env")
@pytest.mark.parametrize("kind", ["missing", "a file", "read-only"])
def test_spool_unusable(tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str) -> None:
    spool = tmp_path / "spool"
    if kind == "a file":
        spool.write_text("")
    elif kind == "read-only":
        if os.geteuid() == 0:
            pytest.skip("running as root, which writes into read-only directories")
        spool.mkdir(mode=0o500)
    assert main([*RUN, "--spool", str(spool), "--recorded", str(TRACE)]) == 0
    assert "missing or not writable" in only_warning(capsys)


@pytest.mark.usefixtures("job_env")
@pytest.mark.parametrize("call", ["write", "fsync"])
def test_disk_full_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str], call: str) -> None:
    real_write = os.write

    def half_then_full(fd: int, data: bytes) -> int:
        if len(data) > 100:  # the record, not a pid file
            real_write(fd, bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, call, half_then_full if call == "write" else full)
    assert main([*RUN, "--spool", str(tmp_path), "--recorded", str(TRACE)]) == 0
    assert "No space left on device" in only_warning(capsys)
    assert os.listdir(tmp_path) == []


@pytest.mark.usefixtures("job_env")
def test_run_dir_missing_means_no_collector(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*RUN, "--spool", str(tmp_path), "--recorded", str(TRACE), "--run-dir", str(tmp_path / "no")]) == 0
    assert "not collecting" in only_warning(capsys) and os.listdir(tmp_path) == []


# ---- stop, and the Prolog/Epilog pair ---------------------------------------------------------

def wait_for(path: Path, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


@pytest.mark.usefixtures("job_env")
def test_stop_signals_the_collector_and_waits_for_its_record(tmp_path: Path) -> None:
    long = write_trace(tmp_path / "long.json", 5000)
    spool, run_dir = tmp_path / "spool", tmp_path / "run"
    spool.mkdir()
    run_dir.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "slurmgpu.collector.monitor", "run", "--job-id", "9",
                             "--spool", str(spool), "--run-dir", str(run_dir), "--recorded", str(long),
                             "--interval", "0.01"])
    try:
        wait_for(run_dir / "9.pid")
        assert main(["stop", "--job-id", "9", "--run-dir", str(run_dir), "--wait", "10"]) == 0
        assert proc.wait(timeout=5) == 0
    finally:
        proc.kill()
    assert 1 <= read_record(str(spool / "c1_9_node7.json")).samples < 5000
    assert os.listdir(run_dir) == []


@pytest.mark.usefixtures("job_env")
def test_stop_without_a_collector(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stop", "--job-id", "9", "--run-dir", str(tmp_path)]) == 0
    assert "no collector running" in only_warning(capsys)
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        (tmp_path / "9.pid").write_text(f"{bystander.pid}\n")  # a stale file, its PID reused
        assert main(["stop", "--job-id", "9", "--run-dir", str(tmp_path)]) == 0
        assert "not a collector" in only_warning(capsys)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def slurm_env(tmp_path: Path, env_file: Path) -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "41", "SLURM_JOB_GPUS": "0,1", "SLURM_CLUSTER_NAME": "c1",
            "SLURMD_NODENAME": "node7", "SLURM_JOB_USER": "alice", "SLURMGPU_MONITOR_ENV": str(env_file)}


@pytest.mark.skipif(shutil.which("setsid") is None, reason="setsid (util-linux) not installed")
def test_prolog_starts_and_epilog_stops_the_collector(tmp_path: Path) -> None:
    spool, run_dir = tmp_path / "spool", tmp_path / "run"
    spool.mkdir()
    long = write_trace(tmp_path / "long.json", 5000)
    wrapper = tmp_path / "monitor"  # the real CLI, fed a trace instead of NVML
    wrapper.write_text(f'#!/bin/sh\ncase "$1" in run) set -- "$@" --recorded {long} --interval 0.01;; esac\n'
                       f'exec {sys.executable} -m slurmgpu.collector.monitor "$@"\n')
    wrapper.chmod(0o755)
    env_file = tmp_path / "monitor.env"
    env_file.write_text(f"SLURMGPU_MONITOR_BIN={wrapper}\nSLURMGPU_MONITOR_SPOOL={spool}\n"
                        f"SLURMGPU_MONITOR_RUN_DIR={run_dir}\nSLURMGPU_MONITOR_LOG={tmp_path / 'log'}\n")
    env = slurm_env(tmp_path, env_file)
    t0 = time.monotonic()
    assert subprocess.run([str(CONTRIB / "prolog.sh")], env=env, timeout=10).returncode == 0
    assert time.monotonic() - t0 < 2  # the Prolog does not wait for the collector
    wait_for(run_dir / "41.pid")
    time.sleep(0.1)
    assert subprocess.run([str(CONTRIB / "epilog.sh")], env=env, timeout=20).returncode == 0
    record = read_record(str(spool / "c1_41_node7.json"))
    assert record.user == "alice" and [g.index for g in record.gpus] == [0]  # the trace has GPU 0 only
    assert os.listdir(run_dir) == [] and (tmp_path / "log").read_text() == ""


@pytest.mark.parametrize("env_text", ["SLURMGPU_MONITOR_BIN=/nonexistent/monitor\n", "if then fi (\n"])
def test_prolog_and_epilog_always_exit_0(tmp_path: Path, env_text: str) -> None:
    env_file = tmp_path / "monitor.env"
    env_file.write_text(f"SLURMGPU_MONITOR_RUN_DIR={tmp_path / 'run'}\nSLURMGPU_MONITOR_LOG={tmp_path / 'log'}\n"
                        + env_text)
    for script in ("prolog.sh", "epilog.sh"):
        res = subprocess.run([str(CONTRIB / script)], env=slurm_env(tmp_path, env_file), timeout=10,
                             capture_output=True)
        assert (res.returncode, res.stdout, res.stderr) == (0, b"", b"")


# ---- the real thing, where there is a GPU -------------------------------------------------------

def _nvml_absent() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # ImportError, or NVMLError without a driver
        return f"no usable NVML here ({type(exc).__name__}: {exc})"
    pynvml.nvmlShutdown()
    return None


@pytest.mark.usefixtures("job_env")
def test_real_nvml(tmp_path: Path) -> None:
    why = _nvml_absent()
    if why:
        pytest.skip(why)
    assert main(["run", "--job-id", "1", "--spool", str(tmp_path), "--interval", "0.1", "--duration", "0.5"]) == 0
    record = read_record(str(tmp_path / "c1_1_node7.json"))
    assert record.samples >= 3 and record.gpus
    for g in record.gpus:
        assert g.uuid.startswith(("GPU-", "MIG-")) and 0 <= g.peak_mem_mib <= g.memory_total_mib
        assert 0 <= g.mean_util <= g.max_util <= 100
