"""Features of a job, from its script and request, the same for training and prediction.

``job_features`` works from plain values (a script text and a request dict) so gsbatch needs
neither pandas nor a database; history statistics come from a snapshot shipped with the model.
The "family" key is the job's main command with numbers and paths taken out, so a user's next
run of the same training with another learning rate or batch size lands in the same family.
"""

from __future__ import annotations

import functools
import math
import re
import shlex
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from slurmgpu.pipeline.model_sizes import acts_per_token, published_size

if TYPE_CHECKING:
    from slurmgpu.pipeline.config import GpuType

LAUNCHERS = ("torchrun", "accelerate", "deepspeed", "horovodrun", "mpirun", "python3", "python", "srun")
# Parameter counts (billions) of model names users commonly pass; a family never seen before
# still gets a size estimate from its name.
# Sizes from the models' papers and model cards (torchvision's ResNet/ViT tables, BERT, GPT-2, T5).
# Names are matched longest first, so resnet152 is not read as resnet15... and gpt2-xl not as gpt2.
MODEL_SIZES_B = {
    "resnet18": 0.0117, "resnet34": 0.0218, "resnet50": 0.0256, "resnet101": 0.0445, "resnet152": 0.0602,
    "vit-base": 0.086, "vit-large": 0.307, "vit-huge": 0.632, "vit_b": 0.086, "vit_l": 0.307, "vit_h": 0.632,
    "bert-base": 0.110, "bert-large": 0.340, "roberta-base": 0.125, "roberta-large": 0.355,
    "gpt2-medium": 0.355, "gpt2-large": 0.774, "gpt2-xl": 1.558, "gpt2": 0.124,
    "t5-small": 0.060, "t5-base": 0.220, "t5-large": 0.770, "t5-3b": 2.85, "t5-11b": 11.0,
    "stable-diffusion": 0.86, "sd-unet": 0.86, "dlrm": 0.54, "unet": 0.03,
}
_BY_LENGTH = sorted(MODEL_SIZES_B, key=len, reverse=True)
_SIZE_IN_NAME = re.compile(r"(?<![\d.])(\d+(?:\.\d+)?)\s*([bm])\b", re.IGNORECASE)
# Size words in model names (bert-base/-large, gpt2-xl, vit-huge): siblings of one architecture.
_SIZE_WORD = re.compile(r"(?<![a-z])(?:tiny|mini|small|base|medium|large|xl|xxl|huge|giant)(?![a-z])")
_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e-?\d+)?")
_OPTION_VALUE = {
    "batch_size": ("--batch-size", "--batch_size", "--per_device_train_batch_size", "--train-batch-size",
                   "--train_batch_size", "--bs", "--micro-batch-size", "--micro_batch_size"),
    "seq_len": ("--seq-len", "--seq_len", "--max_seq_length", "--max-seq-length", "--max_length",
                "--max-length", "--block_size", "--block-size", "--context-length"),
    "model": ("--model", "--model_name_or_path", "--model-name", "--model_name", "--arch", "--pretrained"),
    "steps": ("--max-steps", "--max_steps", "--steps", "--num-steps", "--num_steps", "--iterations", "--iters",
              "--num-batches", "--num_batches", "--max_iters", "--max-iters", "--train-steps", "--train_steps",
              "--total-steps", "--total_steps", "--train-iters", "--train_iters", "--num-iterations",
              "--num_iterations", "--num-train-steps", "--num_train_steps"),
    "new_tokens": ("--max-new-tokens", "--max_new_tokens"),
    "epochs": ("--epochs", "--num_train_epochs", "--num-train-epochs", "--num-epochs", "--num_epochs",
               "--max_epochs", "--max-epochs", "--n_epochs", "--n-epochs", "--trainer.max_epochs"),
    # samples to train on (Megatron's --train-samples, the HF examples' --max_train_samples): steps of a batch
    "samples": ("--train-samples", "--train_samples", "--max_train_samples", "--max-train-samples",
                "--num-samples", "--num_samples"),
    "nproc": ("--nproc_per_node", "--nproc-per-node", "--num_processes", "--num-processes", "--num_gpus",
              "--num-gpus"),
    "zero": ("--zero", "--zero-stage", "--zero_stage"),
    "deepspeed": ("--deepspeed", "--deepspeed_config", "--deepspeed-config"),
    "image_size": ("--image-size", "--image_size", "--img-size", "--resolution"),
}
_KEY_OF = {spelling: key for key, spellings in _OPTION_VALUE.items() for spelling in spellings}
_FLAGS = {
    "fp16": ("--fp16", "--amp", "--half", "--mixed-precision=fp16", "--mixed_precision=fp16"),
    "bf16": ("--bf16", "--mixed-precision=bf16", "--mixed_precision=bf16", "--mixed-precision bf16",
             "--mixed_precision bf16", "bfloat16"),
    "lora": ("--lora", "--use_lora", "--use-lora", "--peft", "--qlora"),
    "ckpt": ("--gradient-checkpointing", "--gradient_checkpointing", "--activation-checkpointing"),
    "int8": ("--load_in_8bit", "--load-in-8bit", "--8bit", "--load_in_4bit", "--load-in-4bit", "--qlora"),
}
# What script_features measures that the models read as numbers.
SCRIPT_NUMERIC = ("params_b", "log_tokens", "batch_size", "seq_len", "precision_bits", "lora", "ckpt", "zero",
                  "int8", "nproc", "log_steps")
NUMERIC = ("req_gpus", "req_gpu_mem_gib", "gpus", "gpu_mem_gib", "gpu_speed", "params_b", "log_tokens",
           "batch_size", "seq_len", "precision_bits", "lora", "ckpt", "zero", "int8", "nproc", "log_steps",
           "fam_n", "fam_log_peak_max", "fam_log_peak_mean", "fam_log_tokens_at_max", "fam_oom_rate", "base_kind",
           "log_limit")
# No per-user features: the model bundle is readable by every user, so it carries no per-user
# statistics (a user's job count or over-request ratio is that user's business alone).



_BUILTIN_HASHES = {"sha1": ("_sha1",), "sha256": ("_sha2", "_sha256")}  # 3.12+ has _sha2, 3.11 _sha256


def hexdigest(algorithm: str, data: bytes) -> str:
    """sha1 or sha256 of DATA from the interpreter's built-in module where it has one: loading
    hashlib's OpenSSL binding costs a submission more than the hashing itself."""
    module = _builtin_hash(algorithm)
    if module is not None:
        return str(getattr(module, algorithm)(data).hexdigest())
    import hashlib

    return hashlib.new(algorithm, data).hexdigest()


@functools.cache
def _builtin_hash(algorithm: str) -> Any:
    """The built-in module of ALGORITHM, looked for once: a failed import is not remembered by the
    interpreter, and searching the path for 3.12's ``_sha2`` on 3.11 cost each daemon record 0.4 ms."""
    for name in _BUILTIN_HASHES[algorithm]:
        try:
            return __import__(name)
        except ImportError:
            continue
    return None


def command_lines(script: str) -> list[str]:
    """The script's command lines (not comments, not directives), continuation lines joined."""
    text = script.replace("\\\n", " ")
    return [ln for ln in map(str.strip, text.splitlines()) if ln and ln[0] != "#"]


def main_command(lines: list[str]) -> str:
    """The line that launches the work: the first one naming a launcher, else the last line."""
    for line in lines:
        words = line.split()
        if any(w.rsplit("/", 1)[-1] in LAUNCHERS for w in words[:4]):
            return line
    return lines[-1] if lines else ""


_PLAIN_WORD = re.compile(r"[^ \t\r\n]+")  # a word between shlex's whitespace


def shell_words(line: str, posix: bool = True) -> list[str]:
    """``shlex.split(line, comments=posix, posix=posix)``, or ``line.split()`` where that fails. A
    line with nothing shlex reads specially (quotes; in posix mode backslashes and comments too) is
    split in C: shlex reads one character at a time in Python, seconds on a megabyte line."""
    if not any(c in line for c in ("\"'\\#" if posix else "\"'")):
        return _PLAIN_WORD.findall(line)
    try:
        return shlex.split(line, comments=posix, posix=posix)
    except ValueError:
        return line.split()


def option_values(words: list[str]) -> dict[str, str]:
    """The first value each _OPTION_VALUE key is given (``--name=value`` or ``--name value``)."""
    out: dict[str, str] = {}
    for i, w in enumerate(words):
        name, eq, val = w.partition("=")
        key = _KEY_OF.get(name)
        if key is not None and key not in out:
            if eq:
                out[key] = val
            elif i + 1 < len(words) and not words[i + 1].startswith("--"):
                out[key] = words[i + 1]
    return out


def family_key(command: str) -> str:
    """Same command with other numbers, paths or quoting: the same family; but the model stays
    whole (resnet18 and resnet152, llama-7b and 70b are different families: what drives memory
    and time is the model), and so does a parameter count written anywhere (``7b``, ``350m``)."""
    words = shell_words(command)
    model_values = {i + 1 for i, w in enumerate(words[:-1]) if w in _OPTION_VALUE["model"]}
    norm = []
    for i, word in enumerate(words):
        if word.startswith("$"):
            continue
        name, eq, value = word.partition("=")
        if i in model_values or (eq and name in _OPTION_VALUE["model"]):
            norm.append(f"{name}{eq}{value.rsplit('/', 1)[-1].lower()}" if eq else word.rsplit("/", 1)[-1].lower())
        elif _SIZE_IN_NAME.fullmatch(word.rsplit("/", 1)[-1]):
            norm.append(word.rsplit("/", 1)[-1].lower())
        else:
            norm.append(_NUMBER.sub("N", word.rsplit("/", 1)[-1]))
    return hexdigest("sha1", " ".join(norm).encode("utf-8", "surrogateescape"))[:12]


def model_size_b(name: str | None, text: str) -> float:
    """Parameter count in billions: a size written in the model's name (7b, 1.3B, 350m) first, then
    a known name, then the same in the whole command; 0.1 when nothing says."""
    hay, lowered = (name or "").lower(), text.lower()
    for source in (hay, lowered):
        m = _SIZE_IN_NAME.search(source)
        if m:
            return float(m.group(1)) / (1 if m.group(2).lower() == "b" else 1000)
        known = next((key for key in _BY_LENGTH if key in source), None)
        if known:
            return MODEL_SIZES_B[known]
    return 0.1


def arch_key(model: str | None) -> str | None:
    """The architecture a model name belongs to, its size taken out: resnet18 and resnet152,
    llama-2-7b-hf and llama-2-70b-hf, bert-base and bert-large are each one architecture. A model
    size never seen in history is estimated from its siblings' measured peaks (bundle.arch_base_mib)."""
    if not model:
        return None
    name = _SIZE_WORD.sub("S", _SIZE_IN_NAME.sub("S", model.rsplit("/", 1)[-1].lower()))
    return _NUMBER.sub("N", name)


# Size words in the order of the sizes they name: the place of a model among its siblings when the
# name gives no number and the table of published sizes does not know it (convnext_tiny..large).
_SIZE_ORDER = ("tiny", "mini", "small", "base", "medium", "large", "xl", "xxl", "huge", "giant")


def name_scale(model: str | None, params_b: float) -> float:
    """Where a model sits among its architecture's sizes: a size written in its name (7b, 350m) as
    the parameter count (``params_b``); else the number its name gives (resnet152 -> 152, vgg19 ->
    19: depth, which drives a CNN's activations more closely than its parameter count does;
    efficientnet_b0 -> 0.5, below b1); else the rank of its size word (tiny 1 .. giant 10);
    else the parameter count."""
    raw = (model or "").rsplit("/", 1)[-1].lower()
    if _SIZE_IN_NAME.search(raw):
        return params_b
    word = _SIZE_WORD.search(raw)
    if word:
        return float(_SIZE_ORDER.index(word.group(0)) + 1)
    number = re.search(r"(?<![\d.])(\d+)", raw)
    if number:
        return float(number.group(1)) or 0.5
    return params_b


MAX_LOG = 700.0  # beyond this a logarithm is of no real size (and math.exp would overflow)


def log_size(value: float) -> float:
    """log(value) of a count written in a script, at least 0 and finite whatever was written."""
    return min(math.log(max(value, 1.0)), MAX_LOG) if value == value else 0.0


def _num(text: str | None, default: float) -> float:
    try:
        return float(text) if text is not None else default
    except ValueError:
        return default


def script_features(script: str) -> dict[str, Any]:
    """What the script says about the work: model, batch, sequence, precision, tricks. Read once
    per script (a submission's decider and its record both ask; a large script costs time to read)."""
    return dict(_script_features(script))


@functools.lru_cache(maxsize=2)
def _script_features(script: str) -> dict[str, Any]:
    lines = command_lines(script)
    command = main_command(lines)
    words = shell_words(command)
    opts = option_values(words)
    lowered = " ".join(lines).lower()
    flags = {k: int(any(s in lowered for s in spellings)) for k, spellings in _FLAGS.items()}
    precision = 16 if (flags["fp16"] or flags["bf16"]) else 32
    batch = _num(opts.get("batch_size"), 32.0)
    seq = _num(opts.get("seq_len"), 0.0) or _num(opts.get("image_size"), 0.0) or 1.0
    # Generation jobs run one step per new token of every batch.
    steps = (_num(opts.get("steps"), 0.0) or _num(opts.get("samples"), 0.0) / max(batch, 1.0)
             or _num(opts.get("epochs"), 1.0) * 1000.0) * _num(opts.get("new_tokens"), 1.0)
    zero_config = re.search(r"zero[_-]?(?:stage)?[_-]?(\d)", opts.get("deepspeed", ""), re.IGNORECASE)
    params_b = model_size_b(opts.get("model"), command)
    return {
        "family": family_key(command),
        "launcher": next((w.rsplit("/", 1)[-1] for w in words if w.rsplit("/", 1)[-1] in LAUNCHERS), "other"),
        "model": (opts.get("model") or "").rsplit("/", 1)[-1].lower() or None,
        "arch": arch_key(opts.get("model")),
        "scale": name_scale(opts.get("model"), params_b),
        "params_b": params_b,
        "batch_size": batch,
        "seq_len": seq,
        "log_tokens": log_size(batch * seq),
        "precision_bits": precision,
        "bf16": flags["bf16"],  # not a model input: the decider keeps bf16 jobs on cards that run it
        "lora": flags["lora"],
        "ckpt": flags["ckpt"],
        "int8": flags["int8"],
        "zero": _num(opts.get("zero"), 0.0) or (float(zero_config.group(1)) if zero_config else
                                                 2.0 if "zero" in lowered or "ds_config" in lowered else 0.0),
        "nproc": _num(opts.get("nproc"), 1.0),
        "log_steps": log_size(steps),
        # Not a model input: whether the amount of work is in the script at all (train.rated).
        "work_shown": int(bool(opts.get("steps") or opts.get("epochs") or opts.get("samples"))),
    }


# Family statistic "held:<GiB>:<GPUs>": the most tokens per GPU (log) a run of the family survived
# on that many GPUs of that size (learning/censored.py says which outcomes count).
HELD = "held:"
# Family statistic "rate:<GPUs>x<type>": the mean over its completed runs on that shape of log(elapsed
# seconds / (steps x tokens)), its measured speed there; the decider compares shapes the family ran
# on by these, not by the datasheet.
RATE = "rate:"
# "rate_n:<shape>": how many runs that mean is over (the weight of the family's own speed evidence).
RATE_N = "rate_n:"
# Family statistics "busy:<GPUs>" and "runs:<GPUs>": the most GPUs the collector saw busy in a
# completed run given that many, and how many such runs it saw (a run given 4 GPUs that only ever
# kept 1 busy runs as well on 1: the decider may trim a count on that evidence).
BUSY, RUNS = "busy:", "runs:"
# Family statistics "util:<type>" and "util_runs:<type>": the highest mean utilisation (%, the share of
# time a kernel ran) the collector saw in a completed run on one GPU of that type, and how many such
# runs it saw: the evidence that a MIG slice's share of the card's compute is enough for the job.
UTIL, UTIL_RUNS = "util:", "util_runs:"


def log_rate(elapsed_s: float, script_feats: Mapping[str, Any]) -> float:
    """A run's measured speed as filed under ``rate:``: log(elapsed seconds / (steps x tokens))."""
    return math.log(max(elapsed_s, 1)) - script_feats["log_steps"] - script_feats["log_tokens"]


def size_scale(script_feats: Mapping[str, Any]) -> float:
    """The job's place among its architecture's sizes (``name_scale``; the parameter count for
    features recorded before there was a scale)."""
    return float(script_feats.get("scale") or script_feats["params_b"])


def slope(points: Iterable[tuple[float, float]]) -> float:
    """The least-squares slope of y on x over POINTS (at least two different x)."""
    pts = list(points)
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def rate_keys(gpus: int, gpu_type: str, log_tokens: float) -> tuple[str, str]:
    """The shape a run's speed is filed under: "<GPUs>x<type>@<tokens>", its batch and sequence as
    run (a type's lead can flip with the batch: a small batch leaves a fast card idle), and the
    shape over all of the family's batches, "<GPUs>x<type>"."""
    return f"{gpus}x{gpu_type}@{round(math.exp(min(log_tokens, MAX_LOG)))}", f"{gpus}x{gpu_type}"


class Family(dict[str, Any]):
    """One family's statistics, its "<shape>@<tokens>" keys grouped by shape on first use: a decision
    looks up the family's speeds shape by shape, and a scan of all its keys per shape was a tenth of
    the daemon's decision. Read-only once made (the grouping is not redone)."""

    __slots__ = ("_at",)

    def __init__(self, stats: Mapping[str, Any]) -> None:
        super().__init__(stats)
        self._at: dict[str, list[tuple[str, Any]]] | None = None

    def grouped(self) -> dict[str, list[tuple[str, Any]]]:
        """Each key holding "@", with its value, under the key's start up to its first "@" (in order)."""
        if self._at is None:
            self._at = {}
            for key, value in self.items():
                at = key.find("@")
                if at >= 0:
                    self._at.setdefault(key[:at + 1], []).append((key, value))
        return self._at


def keys_at(fam: Mapping[str, Any], prefix: str) -> list[tuple[str, Any]]:
    """(key, value) of the family's keys that start with PREFIX (which ends in "@"), in the family's
    order; from a ``Family``'s grouping where PREFIX holds no other "@"."""
    if isinstance(fam, Family) and prefix.find("@") == len(prefix) - 1:
        return fam.grouped().get(prefix, [])
    return [(k, v) for k, v in fam.items() if k.startswith(prefix)]


_NO_FAMILY = Family({})  # what a family the history does not hold reads as


class HistoryStats:
    """Per-family statistics, computed as of training time and shipped in the model (never per user)."""

    def __init__(self, families: Mapping[str, Mapping[str, float]] | None = None,
                 archs: Mapping[str, list[str]] | None = None, whole: bool = False,
                 type_offsets: Mapping[str, float] | None = None) -> None:
        self.families = dict(families or {})
        self.archs = dict(archs or {})  # architecture (arch_key) -> the families of its models
        # What a card adds to a peak (MiB) over the site's cards at large: its CUDA context, cuDNN
        # workspace and framework pool (learning/train.type_offsets). The families' peaks are kept
        # without it, so that a line fitted to runs on several cards is one line.
        self.type_offsets = dict(type_offsets or {})
        # Every family of the history (a bundle's), not the few a training row reads: only then is
        # there a site's line (``counts_line``) to read.
        self.whole = whole
        self._family: dict[str, Family] = {}  # made on first use: training reads a few of many
        self._held: dict[str, list[tuple[int, float, float]]] = {}
        self._lines: dict[float, CountsLine | None] = {}

    def type_offset(self, gpu_type: str | None) -> float:
        """A card's offset (``type_offsets``); 0 for a card the history measured no offset of."""
        return self.type_offsets.get(gpu_type or "", 0.0)

    def counts_line(self, bits: float) -> CountsLine | None:
        """The site's published-counts line at a precision (``counts_line``), once per bundle; None
        for a training row's partial view."""
        if not self.whole:
            return None
        if bits not in self._lines:
            self._lines[bits] = counts_line(self.families.values(), bits)
        return self._lines[bits]

    def family(self, key: str) -> Mapping[str, float]:
        """A family's statistics; only a family the history holds is kept (a daemon is asked about
        any family users write, and an empty entry per unknown one would grow without bound)."""
        fam = self._family.get(key)
        if fam is None:
            if key not in self.families:
                return _NO_FAMILY
            fam = self._family[key] = Family(self.families[key])
        return fam

    def siblings(self, script_feats: Mapping[str, Any]) -> list[Mapping[str, float]]:
        """Statistics of the other families of the job's architecture (other sizes of its model)."""
        arch, own = script_feats.get("arch"), script_feats["family"]
        return [self.family(k) for k in self.archs.get(arch, ()) if k != own] if arch else []

    def held_bound_gib(self, key: str, log_tokens: float, gpus: int) -> float | None:
        """The smallest card (GiB) on which a run of family KEY with at least these tokens per GPU
        held on at most ``gpus`` GPUs (more GPUs never need more memory each: data-parallel copies
        are the same size, sharded state shrinks); None when no outcome covers the job."""
        if key not in self.families:
            return None
        held = self._held.get(key)
        if held is None:  # (GPUs, tokens, card GiB) of each outcome, parsed once
            held = self._held[key] = [(int(count), float(most), float(gib)) for name, most in self.family(key).items()
                                      if name.startswith(HELD) for _, gib, count in [name.split(":")]]
        return min((gib for count, most, gib in held if count <= gpus and most >= log_tokens - 1e-9), default=None)


def util_bound(fam: Mapping[str, Any], gpu_type: str) -> tuple[float, int] | None:
    """(the highest mean utilisation in %, runs seen) of the family's completed one-GPU runs on
    GPU_TYPE; None without any."""
    runs = int(fam.get(f"{UTIL_RUNS}{gpu_type}", 0))
    return (float(fam[f"{UTIL}{gpu_type}"]), runs) if runs else None


def busy_bound(fam: Mapping[str, Any], gpus: int) -> tuple[int, int] | None:
    """(the most GPUs busy, runs seen) over the family's completed runs given GPUS GPUs with per-GPU
    collector figures; None without any."""
    runs = int(fam.get(f"{RUNS}{gpus}", 0))
    return (int(fam[f"{BUSY}{gpus}"]), runs) if runs else None


def measured(fam: Mapping[str, Any]) -> bool:
    """Whether a family's statistics hold measured peaks (a linear fit, or at least one peak)."""
    return bool(fam) and fam.get("n", 0) >= 1 and (fam.get("b", 0.0) > 0 or fam.get("log_peak_max", 0.0) > 0)


def linear_fits(siblings: Iterable[Mapping[str, Any]]) -> dict[float, tuple[float, float]]:
    """The sizes (``scale``) among SIBLINGS with a fitted line a + b*tokens (a, b > 0), and the line."""
    return {fam["scale"]: (fam["a"], fam["b"]) for fam in siblings
            if fam.get("b", 0.0) > 0 and fam.get("a", 0.0) > 0 and fam.get("scale", 0.0) > 0}


def published_counts(script_feats: Mapping[str, Any]) -> tuple[float, float] | None:
    """The job's model's published parameters and activations per token (millions; ``model_sizes``),
    None when the table does not know it."""
    size = published_size(script_feats.get("model"))
    return None if size is None else (size.params_m, acts_per_token(size, float(script_feats["seq_len"])))


def sized_fits(siblings: Iterable[Mapping[str, Any]]) -> list[tuple[float, float, float, float]]:
    """(parameters, activations per token, a, b) of the SIBLINGS with a fitted line a + b*tokens
    whose model has a published size (``published_counts``)."""
    return [(fam["params_m"], fam["acts_m"], fam["a"], fam["b"]) for fam in siblings
            if fam.get("b", 0.0) > 0 and fam.get("a", 0.0) > 0 and fam.get("acts_m", 0.0) > 0
            and fam.get("params_m", 0.0) > 0]


# The fewest families (fitted lines of models with published counts, at one precision) the site's
# published-counts line rests on.
SITE_LINE_MIN = 10
# The base kind of an architecture never run estimated from that line: below the analytic prior's 0,
# so that every split of trees fitted before it existed (training rows never have it: a row reads
# its own family and architecture, not the site) sends it the prior's way.
SITE_KIND = -1.0


class CountsLine(NamedTuple):
    """Peak per GPU (MiB) by published counts across a site's models: fixed + per_param x parameters
    + per_act x activations per token x tokens (counts in millions)."""

    fixed: float
    per_param: float
    per_act: float


def counts_line(families: Iterable[Mapping[str, Any]], bits: float) -> CountsLine | None:
    """The site's line over the families of precision BITS with a fitted line and published counts:
    their fixed parts a least squares on the parameter count (weights, gradients and optimizer
    state are so many bytes each, plus a constant: the CUDA context and workspace), their per-token
    parts b the median cost per activation (it varies threefold between architectures, and a few
    families' lines are degenerate; a log-log slope in the activation count, which the costs
    follow, erred no less on the timm sweep's architectures left out). None with fewer than
    SITE_LINE_MIN such families or one size."""
    fits = sized_fits(fam for fam in families if fam.get("bits") == bits)
    if len(fits) < SITE_LINE_MIN or len({p for p, _, _, _ in fits}) < 2:
        return None
    per_param = max(slope((p, a) for p, _, a, _ in fits), 0.0)
    mp, ma = (sum(v[i] for v in fits) / len(fits) for i in (0, 2))
    costs = sorted(b / x for _, x, _, b in fits)
    return CountsLine(max(ma - per_param * mp, 0.0), per_param, costs[len(costs) // 2])


def placed_by_size(siblings: Iterable[Mapping[str, Any]], script_feats: Mapping[str, Any]) -> float | None:
    """Whether the job's model and two or more siblings of different sizes (both parameters and
    activations) have published sizes, so that the estimate follows those counts
    (bundle.arch_base_mib): 4 when the job's activation count lies among theirs, 5 above the
    largest, 6 below the smallest (each its own margin: carried past the ends, a smaller model's
    cost per activation errs more than a larger one's); None otherwise."""
    fits = sized_fits(siblings)
    if len({p for p, _, _, _ in fits}) < 2 or len({x for _, x, _, _ in fits}) < 2:
        return None
    own = published_counts(script_feats)  # the table is read only for a job whose siblings have sizes
    if own is None:
        return None
    acts = [x for _, x, _, _ in fits]
    return 5.0 if own[1] > max(acts) else 6.0 if own[1] < min(acts) else 4.0


def base_kind(fam: Mapping[str, Any], siblings: list[Mapping[str, Any]], script_feats: Mapping[str, Any],
              history: HistoryStats | None = None) -> float:
    """What the memory estimate rests on (bundle.memory_base_mib), each with its own calibrated
    margin: the family's own measured peaks (3), lines fitted to two or more other sizes of its
    model placed by their published parameter and activation counts (4 among them, 5 above, 6
    below) or by their names' scale (2), other sizes' peaks otherwise (1), for a model with
    published counts whose architecture never ran the site's line in HISTORY (``SITE_KIND``; read
    only then: a scan of every family), the analytic prior alone (0)."""
    if measured(fam):
        return 3.0
    kind = placed_by_size(siblings, script_feats) or (2.0 if len(linear_fits(siblings)) >= 2 else
                                                      1.0 if any(measured(s) for s in siblings) else 0.0)
    if kind or history is None or published_counts(script_feats) is None:
        return kind
    return SITE_KIND if history.counts_line(float(script_feats["precision_bits"])) is not None else kind


def card_features(gpu: GpuType, precision_bits: float | None) -> dict[str, float]:
    """What ``job_features`` reads of a GPU type: its memory (GiB) and the speed a job of this
    precision runs at (``GpuType.speed``), the same in training and at submit time."""
    return {"memory_gib": gpu.memory_gib, "relative_speed": gpu.speed(precision_bits)}


# The feature (outside NUMERIC: the trees never read it) that carries the card's memory offset
# (``HistoryStats.type_offset``) to the estimate (``bundle.memory_base_mib``).
TYPE_OFFSET = "type_offset_mib"


def job_features(script_feats: Mapping[str, Any], request: Mapping[str, Any], gpu: Mapping[str, float],
                 gpus: int, history: HistoryStats, gpu_type: str | None = None) -> dict[str, float]:
    """The model's numeric input for running this job on ``gpus`` GPUs of type ``gpu``.

    ``gpu`` carries the candidate type's memory (GiB) and relative speed, ``gpu_type`` its name
    (its memory offset); ``request`` is the normalised request (``JobRequest.to_json()``) with the
    requested type's memory filled in.
    """
    fam = history.family(script_feats["family"])
    return {
        TYPE_OFFSET: history.type_offset(gpu_type),
        "req_gpus": float(request.get("gpus_total") or 0),
        "req_gpu_mem_gib": float(request.get("req_gpu_mem_gib") or 0.0),
        "gpus": float(gpus),
        "gpu_mem_gib": float(gpu["memory_gib"]),
        "gpu_speed": float(gpu["relative_speed"]),
        **{name: float(script_feats[name]) for name in SCRIPT_NUMERIC},
        "fam_n": float(fam.get("n", 0.0)),
        "fam_log_peak_max": float(fam.get("log_peak_max", 0.0)),
        "fam_log_peak_mean": float(fam.get("log_peak_mean", 0.0)),
        "fam_log_tokens_at_max": float(fam.get("log_tokens_at_max", 0.0)),
        "fam_oom_rate": float(fam.get("oom_rate", 0.0)),
        "base_kind": base_kind(fam, history.siblings(script_feats), script_feats, history),
        "log_limit": log_limit(request.get("time_limit_s")),
    }


def log_limit(limit_s: Any) -> float:
    """The log of the time limit written (seconds), 0 for none. Where work is hidden from the
    script, the limit is its trace: many users pad an estimate of their runtime (the scenario's
    users who do not write one fixed limit), so the runtime model reads it as the steps."""
    if isinstance(limit_s, bool) or not isinstance(limit_s, (int, float)):
        return 0.0
    return log_size(float(limit_s))


def vector(features: Mapping[str, float]) -> list[float]:
    return [features[name] for name in NUMERIC]
