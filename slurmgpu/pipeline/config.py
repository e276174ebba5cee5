"""The admin's one config file: GPU types, partitions and policy knobs (TOML).

Looked up from ``--config``, then ``$SLURMGPU_CONFIG``, then ``/etc/slurmgpu/slurmgpu.toml``.
Everything is validated on load so that a typo is reported once, with the key that holds it,
instead of surfacing as a wrong decision later.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping

from slurmgpu.pipeline.errors import ConfigError
from slurmgpu.pipeline.files import open_regular, read_capped, read_regular
from slurmgpu.pipeline.modes import FAMILY, MODES, REWRITE, Modes, Waiver
from slurmgpu.typing_lite import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from typing import Any

MAX_CONFIG_BYTES = 4 << 20  # a larger file (or its cached parse) is refused unread
SYSTEM_CONFIG = "/etc/slurmgpu/slurmgpu.toml"  # a str: pathlib costs gsbatch start-up time
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
DECIDERS = ("keep", "rules", "model")
OBJECTIVES = ("fastest", "cheapest", "balanced")


class GpuType(NamedTuple):
    name: str
    memory_gib: float
    relative_speed: float = 1.0
    cost: float = 1.0
    features: tuple[str, ...] = ()
    # A MIG instance Slurm schedules as a GPU type of its own (``a100_1g.10gb``): the card it is cut
    # from and the share of that card's compute it has (1/7 for a 1g slice of an A100 or H100).
    mig_of: str | None = None
    compute_fraction: float = 1.0
    shards: int = 0  # gres "shard" units Slurm offers per card of this type (0: not shared)
    # ``relative_speed_fp32``: the type's speed for a job that computes in 32-bit floats, where the
    # datasheets' 32-bit figures (TF32 tensor where the card has it, else FP32) set the cards apart
    # otherwise than the 16-bit tensor ones ``relative_speed`` comes from (a V100 has a tenth of an
    # A100's TF32 rate, two fifths of its FP16 one); 0.0: unset, ``relative_speed`` stands.
    fp32_speed: float = 0.0

    def speed(self, precision_bits: float | None) -> float:
        """The datasheet speed a job of this precision runs at: ``fp32_speed`` for a 32-bit job where
        it is set, else ``relative_speed``."""
        return self.fp32_speed if self.fp32_speed and (precision_bits or 0) >= 32 else self.relative_speed

    @property
    def is_slice(self) -> bool:
        """A part of a card (MIG instance): one process's device, never a member of a multi-GPU job."""
        return self.mig_of is not None


class Partition(NamedTuple):
    name: str
    gpu_types: tuple[str, ...]
    gpus_per_node: int
    nodes: int = 1
    default: bool = False


class Policy(NamedTuple):
    decider: str = "rules"
    objective: str = "balanced"
    min_gain: float = 0.10
    # How likely a move for speed must be to finish sooner where the family measured both shapes
    # (its runs' spread says how sure): such a move needs no ``min_gain``.
    confidence: float = 0.9
    memory_margin: float = 0.10
    min_history: int = 3  # jobs of a family before its predictions are trusted
    scaling_factor: float = 1.25  # fewer GPUs are fine while runtime grows by at most this factor
    mode: str = REWRITE  # "advise": decide and record, submit as written (see pipeline/modes.py)
    oom_retry: bool = False  # `slurmgpu retry` runs a GPU-OOM job again once on a larger card
    # The model may move a job to any configured partition whose Slurm rules admit it, not only
    # among the types of the partition it asked for (a faster or idle card elsewhere).
    move_partitions: bool = False
    # A move to a card the job is predicted to run slower on may lengthen the time limit it wrote, within
    # the partition's MaxTime (pipeline/policy.py LIMIT_MARGIN). Off by default: a QOS's MaxWall is not
    # read, and where it is shorter than a partition's MaxTime such a job would pend for ever.
    lengthen_time_limit: bool = False


class Site(NamedTuple):
    """Where this site keeps its history; None means 'the personal default'."""

    cluster: str | None = None
    database_url: str | None = None
    submission_spool: str | None = None
    gpu_spool: str | None = None
    model_path: str | None = None


class Config(NamedTuple):
    path: str
    gpu_types: Mapping[str, GpuType]
    partitions: Mapping[str, Partition]
    policy: Policy = Policy()
    site: Site = Site()
    modes: Modes = Modes()  # [policy] mode and [policy.modes]: advise or rewrite, per user/account/partition
    waivers: tuple[Waiver, ...] = ()  # [[waivers]]

    @property
    def default_partition(self) -> str | None:
        for p in self.partitions.values():
            if p.default:
                return p.name
        return None

    @property
    def by_precision(self) -> bool:
        """Whether a card's speed depends on the job's precision (a type gives ``relative_speed_fp32``):
        else nothing need read the job's precision for its cards' speeds."""
        return any(t.fp32_speed for t in self.gpu_types.values())

    def at_precision(self, precision_bits: float | None) -> Config:
        """The config as a job of this precision sees its cards: each type's ``relative_speed`` the
        one it runs at (``GpuType.speed``). The decider's comparisons of cards by the datasheet read it."""
        if (precision_bits or 0) < 32 or not self.by_precision:
            return self  # every decision asks: the common case builds nothing
        return self._replace(gpu_types={n: t._replace(relative_speed=t.speed(precision_bits))
                                        for n, t in self.gpu_types.items()})

    def partitions_with(self, gpu_type: str) -> list[Partition]:
        return [p for p in self.partitions.values() if gpu_type in p.gpu_types]

    def gpu_features(self) -> set[str]:
        """Node feature names that mean a GPU type (for --constraint)."""
        return {f for t in self.gpu_types.values() for f in (t.name, *t.features)}

    def memory_gib(self) -> dict[str, float]:
        """Memory per GPU of each type, for what gsbatch says about fitting a card."""
        return {n: t.memory_gib for n, t in self.gpu_types.items()}

    def type_for_feature(self, feature: str) -> str | None:
        for t in self.gpu_types.values():
            if feature.lower() in {t.name.lower(), *(f.lower() for f in t.features)}:
                return t.name
        return None


def find_config(explicit: str | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """The config file to use, or None when none is installed (an explicit path must exist)."""
    env = os.environ if env is None else env
    if explicit:
        return explicit
    if env.get("SLURMGPU_CONFIG"):
        return env["SLURMGPU_CONFIG"]
    return SYSTEM_CONFIG if os.path.exists(SYSTEM_CONFIG) else None


def user_cache_dir(env: Mapping[str, str]) -> str:
    """The submitting user's own cache directory ($XDG_CACHE_HOME/slurmgpu, else ~/.cache/slurmgpu)."""
    return os.path.join(os.path.expanduser(env.get("XDG_CACHE_HOME") or "~/.cache"), "slurmgpu")


def load_config(path: str | os.PathLike[str], cache_dir: str | None = None) -> Config:
    """Read and check the config file.

    With ``cache_dir`` (gsbatch passes the user's own), the parsed file is kept there as JSON,
    keyed by the file's identity (device, inode, size, mtime), so a submission does not pay for
    the TOML parser when the file has not changed; the checks below run on every load.
    """
    path = str(path)
    try:
        with open_regular(path, MAX_CONFIG_BYTES) as fh:  # a FIFO or device would hang gsbatch
            st = os.fstat(fh.fileno())
            key = [path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
            cache = os.path.join(cache_dir, "config-" + path.replace("%", "%25").replace("/", "%2F") + ".json") \
                if cache_dir else None
            raw = _cached(cache, key) if cache else None
            if raw is not None:
                try:
                    return parse_config(raw, path)
                except Exception:  # noqa: BLE001 - the user's cache, edited or broken: the file decides
                    pass
            raw = _parse_toml(fh, path)
    except FileNotFoundError:
        raise ConfigError("config file not found", file=path) from None
    except OSError as exc:
        raise ConfigError(f"cannot read config: {exc.strerror}", file=path) from None
    config = parse_config(raw, path)
    if cache:  # only a config that passed every check is kept
        _store(cache, key, raw)
    return config


def _parse_toml(fh: Any, path: str) -> dict[str, Any]:
    import tomllib  # only when the cache misses: the parser is a good part of gsbatch's start-up

    data = read_capped(fh, MAX_CONFIG_BYTES, path)
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:  # TOML is UTF-8; a Latin-1 'é' in a comment is enough
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(f"not UTF-8 text: byte 0x{data[exc.start]:02x} cannot be decoded", file=path,
                          line=line) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"invalid TOML: {getattr(exc, 'msg', exc)}", file=path,
                          line=getattr(exc, "lineno", None)) from None
    except RecursionError:  # thousands of nested arrays
        raise ConfigError("invalid TOML: nested too deeply", file=path) from None


def _cached(cache: str, key: list[Any]) -> dict[str, Any] | None:
    """The parsed config kept for exactly this file, or None (missing, stale, unreadable)."""
    try:
        stored = json.loads(read_regular(cache, MAX_CONFIG_BYTES))
    except (OSError, ValueError, RecursionError):
        return None
    if isinstance(stored, dict) and stored.get("key") == key and isinstance(stored.get("config"), dict):
        return stored["config"]
    return None


def _iso_date(value: Any) -> str:
    """A TOML date (a waiver's ``expires``) in JSON: as ``YYYY-MM-DD``, which the check reads back."""
    from datetime import date  # loaded already: the TOML parser made the value

    if type(value) is date:
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON")


def _store(cache: str, key: list[Any], raw: dict[str, Any]) -> None:
    """Keep the parsed config for the next load; a config JSON cannot hold (TOML times) is not kept."""
    from slurmgpu.pipeline.spool import write_private

    try:
        write_private(cache, json.dumps({"key": key, "config": raw}, default=_iso_date).encode())
    except (OSError, TypeError, ValueError):
        pass


class _Table:
    """Reads one TOML table, naming the full key in every error and refusing unknown keys."""

    def __init__(self, raw: Any, where: str, path: str) -> None:
        if not isinstance(raw, dict):
            raise ConfigError("must be a table", file=path, option=where)
        self.raw, self.where, self.path = raw, where, path
        self.used: set[str] = set()

    def _err(self, key: str, msg: str) -> ConfigError:
        return ConfigError(msg, file=self.path, option=f"{self.where}.{key}" if self.where else key)

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        self.used.add(key)
        if key not in self.raw:
            if default is ...:
                raise self._err(key, "missing")
            return default
        value = self.raw[key]
        if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
            raise self._err(key, f"expected {getattr(kind, '__name__', kind)}, got a boolean")
        if not isinstance(value, kind):
            raise self._err(key, f"expected {getattr(kind, '__name__', 'a number')}, got {type(value).__name__}")
        return value

    def number(self, key: str, default: Any = ..., *, low: float = 0.0, above: bool = True,
               high: float = float("inf")) -> float:
        """KEY's number, at least LOW (more than LOW if ABOVE) and under HIGH."""
        value = float(self.get(key, (int, float), default))
        if value != value or value in (float("inf"), float("-inf")):  # TOML allows nan and inf
            raise self._err(key, f"must be a finite number, got {value}")
        if value < low or (above and value == low):
            raise self._err(key, f"must be {'>' if above else '>='} {low:g}, got {value:g}")
        if value >= high:
            raise self._err(key, f"must be < {high:g}, got {value:g}")
        return value

    def names(self, key: str, default: Any = ...) -> tuple[str, ...]:
        value = self.get(key, list, default)
        for v in value:
            if not isinstance(v, str) or not _NAME.match(v):
                raise self._err(key, f"invalid name {v!r}")
        return tuple(value)

    def done(self) -> None:
        for key in self.raw:
            if key not in self.used:
                raise self._err(key, "unknown key")


def parse_config(raw: Mapping[str, Any], path: str = "<config>") -> Config:
    top = _Table(dict(raw), "", path)
    types: dict[str, GpuType] = {}
    for name, body in top.get("gpu_types", dict).items():
        if not _NAME.match(name):
            raise ConfigError(f"invalid GPU type name {name!r}", file=path, option="gpu_types")
        t = _Table(body, f"gpu_types.{name}", path)
        # 0.0: unset, which a slice reads from its card (_slice_checked)
        unset = {key: t.number(key) if key in body else 0.0
                 for key in ("relative_speed", "cost", "relative_speed_fp32")}
        types[name] = GpuType(name, t.number("memory_gib"), unset["relative_speed"], unset["cost"],
                              t.names("features", []),
                              t.get("mig_of", str, None), t.number("compute_fraction", 1.0),
                              t.get("shards", int, 0), unset["relative_speed_fp32"])
        t.done()
    if not types:
        raise ConfigError("no GPU types defined", file=path, option="gpu_types")
    types = {name: _slice_checked(types, gt, top.raw["gpu_types"][name], path) for name, gt in types.items()}
    parts: dict[str, Partition] = {}
    for name, body in top.get("partitions", dict).items():
        if not _NAME.match(name):
            raise ConfigError(f"invalid partition name {name!r}", file=path, option="partitions")
        t = _Table(body, f"partitions.{name}", path)
        offered = t.names("gpu_types")
        for g in offered:
            if g not in types:
                raise t._err("gpu_types", f"unknown GPU type {g!r} (not in [gpu_types])")
        per_node = t.get("gpus_per_node", int)
        nodes = t.get("nodes", int, 1)
        if per_node < 1 or nodes < 1:
            raise t._err("gpus_per_node" if per_node < 1 else "nodes", "must be at least 1")
        parts[name] = Partition(name, offered, per_node, nodes, t.get("default", bool, False))
        t.done()
    if sum(p.default for p in parts.values()) > 1:
        raise ConfigError("more than one partition has default = true", file=path, option="partitions")
    pol = _Table(top.get("policy", dict, {}), "policy", path)
    policy = Policy(
        decider=pol.get("decider", str, "rules"),
        objective=pol.get("objective", str, "balanced"),
        min_gain=pol.number("min_gain", 0.10, above=False),
        confidence=pol.number("confidence", 0.9, low=0.5, high=1.0),
        memory_margin=pol.number("memory_margin", 0.10, above=False),
        min_history=int(pol.number("min_history", 3, above=False)),
        scaling_factor=pol.number("scaling_factor", 1.25, low=1.0, above=False),
        mode=pol.get("mode", str, REWRITE),
        oom_retry=pol.get("oom_retry", bool, False),
        move_partitions=pol.get("move_partitions", bool, False),
        lengthen_time_limit=pol.get("lengthen_time_limit", bool, False),
    )
    if policy.mode not in MODES:
        raise pol._err("mode", f"must be one of {', '.join(MODES)}, got {policy.mode!r}")
    modes = _modes(pol.get("modes", dict, {}), policy.mode, path)
    if policy.decider not in DECIDERS:
        raise pol._err("decider", f"must be one of {', '.join(DECIDERS)}, got {policy.decider!r}")
    if policy.objective not in OBJECTIVES:
        raise pol._err("objective", f"must be one of {', '.join(OBJECTIVES)}, got {policy.objective!r}")
    pol.done()
    st = _Table(top.get("site", dict, {}), "site", path)
    site = Site(*(st.get(key, str, None) for key in Site._fields))
    st.done()
    waivers = _waivers(top.get("waivers", list, []), path)
    top.done()
    return Config(path, types, parts, policy, site, modes, waivers)


def _slice_checked(types: Mapping[str, GpuType], gt: GpuType, raw: Mapping[str, Any], path: str) -> GpuType:
    """A type with its MIG keys checked against the card it names; a slice's unset speed and cost
    are the card's times its compute fraction, a whole card's 1.0 (0.0 above stands for unset)."""
    where = f"gpu_types.{gt.name}"

    def err(key: str, msg: str) -> ConfigError:
        return ConfigError(msg, file=path, option=f"{where}.{key}")

    if gt.shards < 0:
        raise err("shards", f"must be >= 0, got {gt.shards}")
    if gt.mig_of is None:
        if "compute_fraction" in raw:
            raise err("compute_fraction", "only for a MIG slice: set mig_of to the card it is cut from")
        return gt._replace(relative_speed=gt.relative_speed or 1.0, cost=gt.cost or 1.0)
    card = types.get(gt.mig_of)
    if card is None:
        raise err("mig_of", f"unknown GPU type {gt.mig_of!r} (not in [gpu_types])")
    if card.mig_of is not None or card.name == gt.name:
        raise err("mig_of", f"must name a whole card, but {gt.mig_of} is itself a slice")
    if "compute_fraction" not in raw:
        raise err("compute_fraction", "missing: the share of the card's compute the slice has (1g of 7: 0.143)")
    if gt.compute_fraction > 1:
        raise err("compute_fraction", f"must be at most 1, got {gt.compute_fraction:g}")
    if gt.memory_gib > card.memory_gib:
        raise err("memory_gib", f"{gt.memory_gib:g} GiB is more than the {card.memory_gib:g} GiB of {card.name}, "
                                "the card it is cut from")
    # the parent's figures may still read 0.0 (unset) when it comes later in the file
    speed = card.relative_speed or 1.0
    cost = card.cost or 1.0
    return gt._replace(relative_speed=gt.relative_speed or speed * gt.compute_fraction,
                       cost=gt.cost or cost * gt.compute_fraction,
                       fp32_speed=gt.fp32_speed or card.fp32_speed * gt.compute_fraction)


def _modes(raw: dict[str, Any], default: str, path: str) -> Modes:
    """``[policy.modes]``: ``users``, ``accounts``, ``partitions``, each a table of name = mode."""
    t = _Table(raw, "policy.modes", path)
    scopes: dict[str, dict[str, str]] = {}
    for scope in ("users", "accounts", "partitions"):
        entries = t.get(scope, dict, {})
        for name, mode in entries.items():
            if not _NAME.match(name):
                raise t._err(scope, f"invalid name {name!r}")
            if mode not in MODES:
                raise t._err(f"{scope}.{name}", f"must be one of {', '.join(MODES)}, got {mode!r}")
        scopes[scope] = dict(entries)
    t.done()
    return Modes(default, scopes["partitions"], scopes["accounts"], scopes["users"])


def _waivers(raw: list[Any], path: str) -> tuple[Waiver, ...]:
    """``[[waivers]]``: user or account (one of them), family, reason, owner, expires (a date)."""
    if not raw:
        return ()
    from datetime import date, datetime  # here, not at the top: gsbatch's start-up pays for it only with waivers

    out = []
    for i, body in enumerate(raw):
        t = _Table(body, f"waivers[{i}]", path)
        user, account = t.get("user", str, None), t.get("account", str, None)
        if (user is None) == (account is None):
            raise t._err("user", "give exactly one of user and account")
        for key, name in (("user", user), ("account", account)):
            if name is not None and not _NAME.match(name):
                raise t._err(key, f"invalid name {name!r}")
        family = t.get("family", str)
        if not re.match(FAMILY, family):
            raise t._err("family", f"must be a family key (12 hex digits, as `slurmgpu parse --json` prints it), "
                                   f"got {family!r}")
        texts = {}
        for key in ("reason", "owner"):
            value = t.get(key, str).strip()
            if not value or len(value) > 200 or any(not c.isprintable() for c in value):
                raise t._err(key, "must be one line of printable text, 1 to 200 characters")
            texts[key] = value
        expires = t.get("expires", object)
        if isinstance(expires, datetime) or not isinstance(expires, (date, str)):
            raise t._err("expires", f"must be a date (2025-06-30), got {type(expires).__name__}")
        if isinstance(expires, str):
            try:
                expires = date.fromisoformat(expires) if re.fullmatch(r"\d{4}-\d{2}-\d{2}", expires) else None
            except ValueError:
                expires = None
            if expires is None:
                raise t._err("expires", "must be a date (2025-06-30)")
        t.done()
        out.append(Waiver(family, texts["reason"], texts["owner"], expires, user, account))
    return tuple(out)
