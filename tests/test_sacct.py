"""Parser tests against real sacct output captured from the local Slurm 22.05 cluster.

The fixtures (tests/fixtures/sacct/, see its README) are verbatim sacct output. Expectations
below come from what was submitted and what sacct printed, not from running the parser.
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path

import pytest

from slurmgpu.slurm.sacct import (
    FIELDS,
    JobRecord,
    RowError,
    format_duration,
    format_fields,
    gpu_usage_is_summed,
    gpus_of,
    parse_duration,
    parse_lines,
    parse_size_mib,
    parse_time,
    parse_tres,
)

FIX = Path(__file__).resolve().parent / "fixtures" / "sacct"
PARSABLE2 = FIX / "jobs_parsable2.txt"
HEADER = FIX / "jobs_parsable_header.txt"
REORDERED = FIX / "jobs_reordered.txt"
REORDERED_FIELDS = tuple((FIX / "jobs_reordered.format").read_text(encoding="utf-8").strip().split(","))


@pytest.fixture(autouse=True)
def _utc(monkeypatch):
    # The fixtures were captured on a machine in UTC; sacct prints local wall-clock time.
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines(keepends=True)


def _parse(path: Path, fields=FIELDS) -> list[JobRecord | RowError]:
    return list(parse_lines(_lines(path), fields, "|", None))


def _jobs(out) -> dict[str, dict]:
    assert not [r for r in out if isinstance(r, RowError)]
    jobs = {r.values["job_id"]: r.values for r in out}
    assert len(jobs) == len(out), "a job id came out twice"
    return jobs


def parsable2() -> dict[str, dict]:
    return _jobs(_parse(PARSABLE2))


ARRAY = {f"1088_{i}" for i in range(4)}
ALL_IDS = {"1076", "1077", "1078", "1079", "1080+0", "1080+1", "1082", "1083", "1084", "1085", "1086",
           "1087", "1089", "1090", "1091", "1092"} | ARRAY

# job id -> (state, state_detail, gpu_type, gpu_count), from the submissions (fixtures README).
EXPECTED = {
    "1076": ("TIMEOUT", None, None, 0),                     # -t 1, sleep 120, no GPU
    "1077": ("CANCELLED", "CANCELLED by 0", "a100", 1),     # --gres=gpu:a100:1, scancel while running
    "1078": ("RUNNING", None, "t4", 1),                     # --gres=gpu:t4:1
    "1079": ("COMPLETED", None, "a100", 1),                 # steps job, --gres=gpu:a100:1
    "1080+0": ("CANCELLED", "CANCELLED by 0", "v100", 1),   # het component 0, --gres=gpu:v100:1 (never ran)
    "1080+1": ("CANCELLED", "CANCELLED by 0", None, 0),     # het component 1, CPU only
    "1082": ("FAILED", None, "t4", 1),                      # exit 3, --gres=gpu:t4:1
    "1083": ("COMPLETED", None, "a100", 2),                 # --gres=gpu:a100:2
    "1084": ("COMPLETED", None, "v100", 1),                 # --gpus=v100:1 (sguser)
    "1085": ("COMPLETED", None, "t4", 2),                   # --gpus-per-node=t4:2 -p gpu-small
    "1086": ("COMPLETED", None, "a100", 1),                 # --gres=gpu:1; Slurm allocated an a100
    "1087": ("COMPLETED", None, None, 0),                   # CPU only (sguser)
    "1089": ("COMPLETED", None, None, 0),                   # comment with '|'
    "1090": ("COMPLETED", None, "v100", 1),                 # non-ASCII name
    "1091": ("CANCELLED", "CANCELLED by 0", "a100", 1),     # --hold, scancel while pending
    "1092": ("PENDING", None, "t4", 1),                     # --hold, still pending (sguser)
    **{j: ("COMPLETED", None, "v100", 1) for j in ARRAY},   # --array=0-3 --gres=gpu:v100:1
}


# --- whole fixtures ---------------------------------------------------------------------------

@pytest.mark.parametrize("path,fields", [
    (PARSABLE2, FIELDS), (HEADER, FIELDS), (HEADER, None), (REORDERED, REORDERED_FIELDS),
], ids=["parsable2", "header-fields", "header-detected", "reordered"])
def test_fixture_parses_without_errors(path, fields):
    out = _parse(path, fields)
    errors = [r for r in out if isinstance(r, RowError)]
    assert errors == []
    assert {r.values["job_id"] for r in out} == ALL_IDS


def test_reordered_format_file_is_understood():
    assert format_fields(",".join(REORDERED_FIELDS)) == REORDERED_FIELDS
    assert "JobID" in REORDERED_FIELDS and "State" in REORDERED_FIELDS
    assert REORDERED_FIELDS != FIELDS[:len(REORDERED_FIELDS)]


def test_three_fixtures_agree_on_common_fields():
    a = parsable2()
    b = _jobs(_parse(HEADER, None))
    c = _jobs(_parse(REORDERED, REORDERED_FIELDS))
    assert set(a) == set(b) == set(c) == ALL_IDS
    common = ("state", "state_detail", "gpu_type", "gpu_count", "exit_code", "exit_signal", "elapsed_s",
              "partition", "user", "name", "max_rss_mb", "req_tres", "alloc_tres")
    for job_id in ALL_IDS:
        for key in common:
            assert a[job_id][key] == b[job_id][key] == c[job_id][key], (job_id, key)


def test_states_and_gpus_as_submitted():
    jobs = parsable2()
    got = {j: (v["state"], v["state_detail"], v["gpu_type"], v["gpu_count"]) for j, v in jobs.items()}
    assert got == EXPECTED


def test_header_file_states_and_gpus_as_submitted():
    jobs = _jobs(_parse(HEADER, None))
    got = {j: (v["state"], v["state_detail"], v["gpu_type"], v["gpu_count"]) for j, v in jobs.items()}
    assert got == EXPECTED


def test_steps_are_folded():
    out = _parse(PARSABLE2)
    assert all("." not in r.values["job_id"] for r in out)
    raw_lines = _lines(PARSABLE2)
    step_lines = [ln for ln in raw_lines if ln.split("|", 1)[0].partition(".")[2]]
    assert len(step_lines) == len(raw_lines) - len(ALL_IDS)  # every other line is a step


def _maxrss_kib_of_steps(job_id: str) -> list[int]:
    idx = FIELDS.index("MaxRSS")
    values = []
    for ln in _lines(PARSABLE2):
        parts = ln.rstrip("\n").split("|")
        if parts[0].startswith(job_id + ".") and parts[idx]:
            assert parts[idx].endswith("K")
            values.append(int(parts[idx][:-1]))
    return values


def test_max_rss_is_max_over_steps():
    jobs = parsable2()
    # 1079: .batch printed 12340K, .0 and .1 printed nothing, .2 (300 MiB python) printed 320720K.
    assert _maxrss_kib_of_steps("1079") == [12340, 320720]
    assert jobs["1079"]["max_rss_mb"] == pytest.approx(320720 / 1024)
    for job_id in ("1076", "1077", "1088_0", "1088_3"):
        kib = _maxrss_kib_of_steps(job_id)
        assert len(kib) == 1
        assert jobs[job_id]["max_rss_mb"] == pytest.approx(max(kib) / 1024)
    # No step printed MaxRSS (running batch step, short steps, never-started jobs).
    for job_id in ("1078", "1082", "1083", "1089", "1080+0", "1091", "1092"):
        assert _maxrss_kib_of_steps(job_id) == []
        assert jobs[job_id]["max_rss_mb"] is None


def test_array_tasks():
    jobs = parsable2()
    raw = {"1088_0": 1113, "1088_1": 1114, "1088_2": 1115, "1088_3": 1088}
    for i in range(4):
        v = jobs[f"1088_{i}"]
        assert v["array_job_id"] == 1088
        assert v["array_task_id"] == i
        assert v["job_id_raw"] == raw[f"1088_{i}"]
        assert v["het_job_id"] is None and v["het_offset"] is None
    assert jobs["1083"]["array_job_id"] is None and jobs["1083"]["array_task_id"] is None


def test_het_job():
    jobs = parsable2()
    for offset, raw, partition in ((0, 1080, "gpu"), (1, 1081, "debug")):
        v = jobs[f"1080+{offset}"]
        assert v["het_job_id"] == 1080
        assert v["het_offset"] == offset
        assert v["job_id_raw"] == raw
        assert v["partition"] == partition
        assert v["array_job_id"] is None
        assert v["start_time"] is None  # sacct printed Start "None": cancelled before it started
        assert v["alloc_tres"] is None
    assert jobs["1080+0"]["req_tres"] == "billing=1,cpu=1,gres/gpu:v100=1,gres/gpu=1,mem=500M,node=1"


def test_failed_timeout_cancelled_details():
    jobs = parsable2()
    assert jobs["1082"]["exit_code"] == 3 and jobs["1082"]["exit_signal"] == 0
    assert jobs["1076"]["time_limit_s"] == 60          # -t 1
    assert jobs["1076"]["elapsed_s"] == 72             # 00:01:12
    assert jobs["1077"]["exit_code"] == 0 and jobs["1077"]["elapsed_s"] == 15
    assert jobs["1077"]["time_limit_s"] == 365 * 86400  # printed 365-00:00:00
    assert jobs["1079"]["time_limit_s"] is None        # UNLIMITED
    assert jobs["1092"]["time_limit_s"] is None        # Partition_Limit


def test_running_and_pending_times():
    jobs = parsable2()
    run = jobs["1078"]
    assert run["start_time"] == datetime(2026, 12, 2, 17, 58, 59)
    assert run["end_time"] is None                    # End "Unknown"
    assert run["elapsed_s"] == 5 * 60 + 17
    pend = jobs["1092"]
    assert pend["submit_time"] == datetime(2026, 12, 2, 17, 59, 9)
    assert pend["eligible_time"] is None and pend["start_time"] is None and pend["end_time"] is None
    assert pend["user"] == "sguser" and pend["account"] == "slurmgpu"
    held = jobs["1091"]
    assert held["eligible_time"] is None and held["start_time"] is None
    assert held["end_time"] == datetime(2026, 12, 2, 17, 59, 14)


def test_pending_jobs_have_no_node_list():
    # sacct prints NodeList "None assigned" for jobs that never got nodes.
    jobs = parsable2()
    for job_id in ("1092", "1091", "1080+0", "1080+1"):
        assert jobs[job_id]["node_list"] is None, job_id
    assert jobs["1083"]["node_list"] == "localhost"


def test_other_columns():
    jobs = parsable2()
    v = jobs["1087"]
    assert (v["user"], v["account"], v["partition"], v["cpus"], v["nodes"], v["req_mem_mb"]) == \
        ("sguser", "slurmgpu", "debug", 2, 1, 1000)
    assert v["cluster"] == "slurmgpu" and v["qos"] == "normal"
    assert jobs["1085"]["partition"] == "gpu-small"
    assert jobs["1086"]["req_tres"] == "billing=1,cpu=1,gres/gpu=1,mem=500M,node=1"
    assert jobs["1076"]["submit_time"] == datetime(2026, 12, 2, 17, 58, 58)


def test_comment_with_pipe_survives_parsable2():
    jobs = parsable2()
    assert jobs["1089"]["comment"] == "needs a|b pipe"
    assert jobs["1089"]["name"] == "comment-pipe"
    assert jobs["1083"]["comment"] is None


def test_comment_with_pipe_survives_parsable_trailing_delimiter():
    jobs = _jobs(_parse(HEADER, None))
    assert jobs["1089"]["comment"] == "needs a|b pipe"
    assert jobs["1083"]["comment"] is None


def test_non_ascii_name_survives():
    for out in (_parse(PARSABLE2), _parse(HEADER, None), _parse(REORDERED, REORDERED_FIELDS)):
        assert _jobs(out)["1090"]["name"] == "résumé 测试 job"


def test_record_line_numbers_point_at_job_rows():
    lines = _lines(PARSABLE2)
    for rec in _parse(PARSABLE2):
        assert lines[rec.line - 1].split("|", 1)[0] == rec.values["job_id"]
    hlines = _lines(HEADER)
    for rec in _parse(HEADER, None):
        assert hlines[rec.line - 1].split("|", 1)[0] == rec.values["job_id"]


def test_cluster_argument_only_fills_missing_cluster():
    jobs = _jobs(list(parse_lines(_lines(REORDERED), REORDERED_FIELDS, "|", "other")))
    assert {v["cluster"] for v in jobs.values()} == {"other"}
    assert {v["cluster"] for v in _jobs(list(parse_lines(_lines(PARSABLE2), FIELDS, "|", "other"))).values()} \
        == {"slurmgpu"}


def test_gpu_usage_from_step_tres_usage():
    # A copy of real step line 1079.2 with the GPU usage TRES sacct adds when a GPU plugin measures it.
    lines = _lines(PARSABLE2)
    idx = FIELDS.index("TRESUsageInMax")
    i = next(n for n, ln in enumerate(lines) if ln.startswith("1079.2|"))
    parts = lines[i].rstrip("\n").split("|")
    parts[idx] += ",gres/gpumem=1234M,gres/gpuutil=87"
    lines[i] = "|".join(parts) + "\n"
    jobs = _jobs(list(parse_lines(lines, FIELDS, "|")))
    assert jobs["1079"]["sacct_gpu_mem_mib"] == 1234.0
    assert jobs["1079"]["sacct_gpu_util"] == 87.0
    assert jobs["1083"]["sacct_gpu_mem_mib"] is None and jobs["1083"]["sacct_gpu_util"] is None


# --- malformed rows -----------------------------------------------------------------------------

def _line_index(lines: list[str], job_id: str) -> int:
    return next(n for n, ln in enumerate(lines) if ln.split("|", 1)[0] == job_id)


def test_malformed_rows_become_row_errors_and_neighbours_parse():
    lines = _lines(PARSABLE2)
    # too few fields: job 1083's row cut after four fields
    i_short = _line_index(lines, "1083")
    lines[i_short] = "|".join(lines[i_short].split("|")[:4]) + "\n"
    # bad duration: job 1085's Elapsed
    i_dur = _line_index(lines, "1085")
    parts = lines[i_dur].rstrip("\n").split("|")
    parts[FIELDS.index("Elapsed")] = "00:xx:04"
    lines[i_dur] = "|".join(parts) + "\n"
    # invalid job id: job 1087's JobID
    i_id = _line_index(lines, "1087")
    parts = lines[i_id].rstrip("\n").split("|")
    parts[0] = "10x87"
    lines[i_id] = "|".join(parts) + "\n"

    out = list(parse_lines(lines, FIELDS, "|"))
    errors = {e.line: e.message for e in out if isinstance(e, RowError)}
    assert set(errors) == {i_short + 1, i_dur + 1, i_id + 1}
    assert "field" in errors[i_short + 1]
    assert "Elapsed" in errors[i_dur + 1]
    assert "JobID" in errors[i_id + 1]
    jobs = {r.values["job_id"]: r.values for r in out if isinstance(r, JobRecord)}
    assert set(jobs) == ALL_IDS - {"1083", "1085", "1087"}
    # the rows right around the broken ones are intact
    for job_id in ("1082", "1084", "1086", "1089"):
        assert (jobs[job_id]["state"], jobs[job_id]["state_detail"], jobs[job_id]["gpu_type"],
                jobs[job_id]["gpu_count"]) == EXPECTED[job_id]


def test_malformed_row_line_numbers_count_the_header():
    lines = _lines(HEADER)
    i = _line_index(lines, "1090")
    lines[i] = "1090|1090|slurmgpu|\n"
    out = list(parse_lines(lines, None, "|"))
    assert [e.line for e in out if isinstance(e, RowError)] == [i + 1]
    assert {r.values["job_id"] for r in out if isinstance(r, JobRecord)} == ALL_IDS - {"1090"}


# --- value parsers on formats the local cluster may not print -----------------------------------

@pytest.mark.parametrize("text,seconds", [
    ("1-02:03:04", 93784), ("05:06.789", 306), ("00:01:12", 72), ("365-00:00:00", 365 * 86400),
    ("2-00:00:00", 172800), ("00:00:00", 0), ("10:00", 600),
    ("UNLIMITED", None), ("Partition_Limit", None), ("Unknown", None), ("", None),
])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["1:2:3:4", "abc", "00:xx:04", "-1"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError):
        parse_duration(text)


@pytest.mark.parametrize("text,field,mib", [
    ("1104K", "MaxRSS", 1104 / 1024), ("2.50G", "MaxRSS", 2560.0), ("320720K", "MaxRSS", 320720 / 1024),
    ("4000Mc", "ReqMem", 4000.0), ("500M", "ReqMem", 500.0), ("2000Mn", "ReqMem", 2000.0),
    ("1T", "MaxRSS", 1024.0 ** 2), ("0", "MaxRSS", 0.0), ("", "MaxRSS", None),
    ("16?", "ReqMem", None),  # a just-ended job's row before slurmdbd has it whole (captured on 22.05)
])
def test_parse_size_mib(text, field, mib):
    if mib is None:
        assert parse_size_mib(text, field) is None
    else:
        assert parse_size_mib(text, field) == pytest.approx(mib)


@pytest.mark.parametrize("text", ["12Q", "K", "1.2.3M", "16?"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size_mib(text)


def test_unknown_and_none_times():
    assert parse_time("Unknown", "End") is None
    assert parse_time("None", "Start") is None
    assert parse_time("2026-12-02T17:58:59", "Start") == datetime(2026, 12, 2, 17, 58, 59)
    with pytest.raises(ValueError):
        parse_time("yesterday", "Start")


def test_tres():
    tres = parse_tres("gres/gpu:a100=2,gres/gpu=2")
    assert tres == {"gres/gpu:a100": "2", "gres/gpu": "2"}
    assert gpus_of(tres) == ("a100", 2)
    usage = parse_tres("gres/gpumem=1234M,gres/gpuutil=87")
    assert usage == {"gres/gpumem": "1234M", "gres/gpuutil": "87"}
    assert gpus_of(usage) == (None, 0)
    assert parse_tres("") == {}
    assert gpus_of(parse_tres("billing=1,cpu=1,gres/gpu=1,mem=500M,node=1")) == (None, 1)
    assert gpus_of(parse_tres("cpu=2,gres/gpu:a100=1,gres/gpu:v100=1,gres/gpu=2")) == (None, 2)
    assert gpus_of(parse_tres("cpu=1,mem=500M,node=1")) == (None, 0)


@pytest.mark.parametrize(("version", "summed"), [("22.05.8", False), ("24.05.0", False), ("24.05.1", True),
                                                 ("24.11.1", True), ("slurm-wlm 25.05.2", True)])
def test_gpu_usage_summed_from_24_05_1(version: str, summed: bool) -> None:
    assert gpu_usage_is_summed(version) is summed


def test_summed_gpu_usage_is_per_gpu_for_the_batch_step_and_an_upper_bound_elsewhere():
    # Slurm >= 24.05.1 adds up a step's GPUs: a batch step holding a job's 2 GPUs that peaked at
    # 1000 MiB and 500 MiB reports gpumem=1500M; a srun step's sum is kept as it is.
    lines = _lines(PARSABLE2)
    jobs = _jobs(list(parse_lines(lines, FIELDS, "|")))
    idx = FIELDS.index("TRESUsageInMax")
    multi = next(j for j, v in jobs.items() if (v["gpu_count"] or 0) >= 2 and v["nodes"] == 1
                 and any(ln.startswith(f"{j}.batch|") for ln in lines))
    i = next(n for n, ln in enumerate(lines) if ln.startswith(f"{multi}.batch|"))
    parts = lines[i].rstrip("\n").split("|")
    parts[idx] += ",gres/gpumem=1500M,gres/gpuutil=120"
    lines[i] = "|".join(parts) + "\n"
    gpus = jobs[multi]["gpu_count"]
    summed = _jobs(list(parse_lines(lines, FIELDS, "|", summed_gpu_usage=True)))[multi]
    assert summed["sacct_gpu_mem_mib"] == pytest.approx(1500 / gpus)
    assert summed["sacct_gpu_util"] == pytest.approx(120 / gpus)
    one_gpu = _jobs(list(parse_lines(lines, FIELDS, "|")))[multi]  # before 24.05.1: already one GPU's figure
    assert one_gpu["sacct_gpu_mem_mib"] == 1500.0
    # an srun step of the same job (its batch line, renamed): its tasks may each hold one GPU
    parts = lines[i].rstrip("\n").split("|")
    parts[0] = parts[1] = f"{multi}.0"
    parts[idx] = parts[idx].replace("gres/gpumem=1500M", "gres/gpumem=9000M")
    lines.insert(i + 1, "|".join(parts) + "\n")
    assert _jobs(list(parse_lines(lines, FIELDS, "|", summed_gpu_usage=True)))[multi]["sacct_gpu_mem_mib"] == 9000.0


@pytest.mark.parametrize("seconds", [0, 59, 3600, 86399, 86400, 90061, 10 * 86400 + 5])
def test_format_duration_is_what_parse_duration_reads(seconds: int) -> None:
    assert parse_duration(format_duration(seconds)) == seconds
