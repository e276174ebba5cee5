"""One synthetic job as its user submitted it."""

from __future__ import annotations

from datetime import datetime
from typing import Any, NamedTuple


class JobSpec(NamedTuple):
    """What was submitted, and what the program inside would do.

    ``params`` holds the program's settings: ``model``, ``batch_size`` (per GPU), ``seq_len`` or
    ``image_size``, ``precision``, ``lora`` and ``lora_r``, ``zero`` (ZeRO stage), ``grad_ckpt``,
    ``steps`` (per process), ``nproc`` (GPUs the program drives), ``lr`` and, for generation,
    ``gen_tokens``. GPU types are catalog names ("A100-80"); the cluster maps them to gres names.
    """

    job_id: str  # as sacct prints it: "1234" or "1230_4"
    job_id_raw: int
    user: str
    uid: int
    account: str
    family: str
    params: dict[str, Any]
    submit_time: datetime  # naive UTC
    req_gpu_type: str
    req_gpus: int
    partition: str
    time_limit_s: int
    array: str | None  # the --array value the script carries, e.g. "0-7%4"
    job_name: str
    cpus: int
    mem_mb: int
    script: str
    fails: bool  # a failure other than running out of memory
    cancels: bool  # its owner cancels it while it runs
    stop_frac: float  # how far into its run a failing or cancelled job gets

    @property
    def array_task(self) -> int | None:
        _, sep, task = self.job_id.partition("_")
        return int(task) if sep else None
