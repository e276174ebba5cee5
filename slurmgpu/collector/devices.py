"""GPU device layer behind one small interface: NVML on a GPU node, a recorded trace everywhere else."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

MIB = 1024 * 1024



# Where Slurm (or CUDA) says which GPUs are the job's; the first one set wins. Inside a job with
# ConstrainDevices, CUDA_VISIBLE_DEVICES counts only the job's GPUs, as NVML does there; in the
# Prolog only SLURM_JOB_GPUS is set, with node-wide indices, as NVML counts outside the cgroup.
GPU_ENV_VARS = ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_GPUS", "GPU_DEVICE_ORDINAL")



class DeviceError(RuntimeError):
    """The GPUs could not be read (no NVML, no driver, a GPU lost mid-run, a broken trace)."""



class TraceEnded(Exception):
    """A recorded trace has no more samples: for a replay, the job has ended."""



class DeviceInfo(NamedTuple):
    index: int  # type: ignore[assignment]  # field name shadows tuple.index; kept for the JSON schema
    uuid: str
    name: str
    memory_total: int  # bytes



class Sample(NamedTuple):
    memory_used: int  # bytes, the whole device
    util: float  # percent of time a kernel ran
    proc_memory: int | None  # bytes used by the job's processes; None where the driver does not say



class GpuDevices(Protocol):
    def devices(self) -> list[DeviceInfo]: ...

    def sample(self, index: int, pids: Collection[int] | None) -> Sample: ...

    def close(self) -> None: ...



def _proc_memory(procs: Iterable[tuple[int, int | None]], pids: Collection[int] | None) -> int | None:
    """Bytes used by ``pids`` (every process when None); None when a figure is withheld."""
    total = 0
    for pid, used in procs:
        if pids is None or pid in pids:
            if used is None:
                return None
            total += used
    return total



class NvmlDevices:
    """The real GPUs through NVML (the nvidia-ml-py package)."""

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError as exc:
            raise DeviceError(f"NVML unavailable: {exc}") from None
        self._nvml = pynvml
        self._handles: dict[int, Any] = {}
        with self._errors():
            pynvml.nvmlInit()

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except self._nvml.NVMLError as exc:
            raise DeviceError(f"NVML failed: {exc}") from None

    def devices(self) -> list[DeviceInfo]:
        nv, found = self._nvml, []
        with self._errors():
            for i in range(nv.nvmlDeviceGetCount()):
                try:
                    handle = nv.nvmlDeviceGetHandleByIndex(i)
                except nv.NVMLError_NoPermission:
                    continue  # another job's GPU, behind this job's device cgroup
                self._handles[i] = handle
                found.append(DeviceInfo(i, _text(nv.nvmlDeviceGetUUID(handle)), _text(nv.nvmlDeviceGetName(handle)),
                                        int(nv.nvmlDeviceGetMemoryInfo(handle).total)))
        return found

    def sample(self, index: int, pids: Collection[int] | None) -> Sample:
        nv, handle = self._nvml, self._handles[index]
        with self._errors():
            used = int(nv.nvmlDeviceGetMemoryInfo(handle).used)
            util = float(nv.nvmlDeviceGetUtilizationRates(handle).gpu)
            try:
                procs = nv.nvmlDeviceGetComputeRunningProcesses(handle)
            except nv.NVMLError_NotSupported:
                return Sample(used, util, None)
        return Sample(used, util, _proc_memory(((p.pid, p.usedGpuMemory) for p in procs), pids))

    def close(self) -> None:
        with contextlib.suppress(self._nvml.NVMLError):  # the samples are taken; do not lose them here
            self._nvml.nvmlShutdown()



def _text(value: str | bytes) -> str:
    """Old pynvml releases answer bytes, current ones str."""
    return value.decode() if isinstance(value, bytes) else value



class RecordedDevices:
    """A recorded trace replayed sample by sample, so tests and the demo run without a GPU.

    The trace is JSON shaped like NVML's answers::

        {"devices": [{"index": 0, "uuid": "GPU-...", "name": "...", "memory": {"total": BYTES},
                      "samples": [{"memory": {"used": BYTES}, "utilization": {"gpu": PERCENT},
                                   "processes": [{"pid": PID, "usedGpuMemory": BYTES}, ...]}, ...]}]}

    ``"processes": null`` stands for NVML_ERROR_NOT_SUPPORTED. Each sample() call returns the
    device's next sample; past the last it raises TraceEnded.
    """

    def __init__(self, path: str) -> None:
        try:
            with open(path, "rb") as f:
                trace = json.load(f)
            self._devices = [DeviceInfo(int(d["index"]), str(d["uuid"]), str(d["name"]), int(d["memory"]["total"]))
                             for d in trace["devices"]]
            self._samples = {
                int(d["index"]): [(int(s["memory"]["used"]), float(s["utilization"]["gpu"]),
                                   None if s["processes"] is None
                                   else [(int(p["pid"]), p["usedGpuMemory"]) for p in s["processes"]])
                                  for s in d["samples"]]
                for d in trace["devices"]}
        except (OSError, ValueError, LookupError, TypeError) as exc:
            raise DeviceError(f"recorded trace {path}: {type(exc).__name__}: {exc}") from None
        self._next = dict.fromkeys(self._samples, 0)

    def devices(self) -> list[DeviceInfo]:
        return list(self._devices)

    def sample(self, index: int, pids: Collection[int] | None) -> Sample:
        n = self._next[index]
        if n >= len(self._samples[index]):
            raise TraceEnded
        self._next[index] = n + 1
        used, util, procs = self._samples[index][n]
        return Sample(used, util, None if procs is None else _proc_memory(procs, pids))

    def close(self) -> None:
        pass



def select_gpus(devices: Sequence[DeviceInfo], env: Mapping[str, str]) -> list[DeviceInfo]:
    """The job's GPUs, from the first of GPU_ENV_VARS that is set; all devices when none is.

    Entries are indices or GPU UUIDs (a unique prefix is enough, as for CUDA; an ambiguous one
    picks nothing). A set but empty
    variable, or one naming nothing NVML sees (Slurm's ``NoDevFiles``), means no GPUs.
    """
    for var in GPU_ENV_VARS:
        value = env.get(var)
        if value is None:
            continue
        picked: list[DeviceInfo] = []
        for word in (w.strip() for w in value.split(",")):
            hits = [d for d in devices if (d.index == int(word) if word.isdigit() else d.uuid.startswith(word))]
            if word and len(hits) == 1 and hits[0] not in picked:
                picked.append(hits[0])
        return picked
    return list(devices)
