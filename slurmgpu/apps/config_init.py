"""`slurmgpu config init`: a starting config written from the live cluster.

What Slurm knows is written as fact: GPU types, per-node counts, which partitions hold which
nodes, the default partition. What Slurm does not know (a card's memory, speed and cost) comes
from the workload model's table of GPU datasheets (``simulation/workload/data.toml``, each with
its source), and every such line says ``review``. A type the table does not know gets
``memory_gib = 0``, which the config check refuses until an admin fills it in: a guessed memory
size would let the decider place jobs where they do not fit.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from slurmgpu.pipeline.hardware import mig_profile
from slurmgpu.simulation.workload.catalog import GpuSpec, load_catalog, relative_cost, relative_speed
from slurmgpu.slurm.backend import NodeInfo


def known_gpu(gres_type: str) -> tuple[GpuSpec | None, str]:
    """The datasheet entry for a gres.conf Type= name, and how sure the match is.

    ``a100_80gb`` is A100-80; a bare ``a100`` could be either size, so the smaller is taken
    (believing a card smaller than it is never places a job where it does not fit) and flagged.
    """
    tokens = re.findall(r"[a-z0-9]+", gres_type.lower())
    first = tokens[0] if tokens else ""
    matches = []
    for spec in load_catalog().gpu_types.values():
        base, _, size = spec.name.partition("-")
        b = re.sub(r"[^a-z0-9]", "", base.lower())
        if first == b or (first.startswith(b) and not first[len(b)].isdigit()):  # v100s is a V100, a100 no A10
            matches.append((spec, size))
    if not matches:
        return None, f"no datasheet for GPU type {gres_type!r}: set memory_gib, relative_speed and cost"
    sized = [spec for spec, size in matches if size and any(re.fullmatch(rf"{size}g?b?", t) for t in tokens[1:])]
    if sized:
        return sized[0], f"from the {sized[0].name} datasheet"
    spec = min((m[0] for m in matches), key=lambda s: s.memory_gib)
    if len(matches) > 1:
        return spec, (f"{gres_type!r} does not say its memory size: the smallest variant ({spec.name}) "
                      "is assumed; check memory_gib")
    return spec, f"from the {spec.name} datasheet"


def size_features(gres_type: str, nodes: Sequence[NodeInfo]) -> list[str]:
    """Node features of the nodes holding ``gres_type`` that name it with more words (``a100-80gb`` for
    ``a100``): a site that says the size there has told us which card it is, and its users may ask
    for it by that name (``--constraint``)."""
    t = gres_type.lower()
    return sorted({f for n in nodes if n.gpus.get(gres_type) for f in getattr(n, "features", ())
                   if f.lower() != t and re.match(rf"{re.escape(t)}[-_.]", f.lower())})


def _typed(gres_type: str, nodes: Sequence[NodeInfo]) -> tuple[GpuSpec | None, str]:
    """The datasheet of a type, sized by its nodes' features when the gres name does not say."""
    spec, why = known_gpu(gres_type)
    sized = {}
    for feature in size_features(gres_type, nodes):
        found, how = known_gpu(feature)
        if found is not None and how.startswith("from the"):
            sized[found.name] = (found, f"{how} (node feature {feature})")
    if spec is None or not sized or why.startswith("from the"):  # unknown, or the gres name says it
        return spec, why
    if len(sized) == 1:
        return next(iter(sized.values()))
    smallest = min((s for s, _ in sized.values()), key=lambda s: s.memory_gib)
    return smallest, (f"nodes holding {gres_type!r} say different sizes ({', '.join(sorted(sized))}): the "
                      f"smallest ({smallest.name}) is assumed; split the type in gres.conf")


def _key(name: str) -> str:
    """A GPU type as a TOML table key: quoted when it has a dot (``"a100_1g.10gb"``)."""
    return f'"{name}"' if "." in name else name


def _card_lines(gres_type: str, nodes: Sequence[NodeInfo]) -> list[str]:
    """memory_gib, relative_speed and cost of a type (a MIG slice: its profile and its card's share)."""
    profile = mig_profile(gres_type)
    if profile is not None:
        card, _ = _typed(profile.card, nodes)
        speed, cost = (relative_speed(card), relative_cost(card)) if card else (1.0, 1.0)
        share = f"{profile.compute_fraction:.3f} of {profile.card}"
        return [f'mig_of = "{profile.card}"  # review: a MIG instance, by its name',
                f"compute_fraction = {profile.compute_fraction:.3f}  # review: {gres_type}'s compute slices",
                f"memory_gib = {profile.memory_gib:g}  # review: the profile's size",
                f"relative_speed = {speed * profile.compute_fraction:.3f}  # review: {share}'s speed",
                f"cost = {cost * profile.compute_fraction:.3f}  # review: {share}'s cost"]
    spec, why = _typed(gres_type, nodes)
    if spec is None:
        return [f"memory_gib = 0  # review: {why}", "relative_speed = 1.0  # review", "cost = 1.0  # review"]
    return [f"memory_gib = {spec.memory_gib:g}  # review: {why}",
            f"relative_speed = {relative_speed(spec):.3f}  # review",
            f"relative_speed_fp32 = {relative_speed(spec, 'fp32'):.3f}  # review",
            f"cost = {relative_cost(spec):.3f}  # review"]


def _shard_lines(gres_type: str, nodes: Sequence[NodeInfo]) -> list[str]:
    """``shards``: Slurm's gres shard count per card of the type (the most on any node)."""
    per_card = [n.shards[gres_type] // n.gpus[gres_type] for n in nodes
                if getattr(n, "shards", {}).get(gres_type) and n.gpus.get(gres_type)]
    return [f"shards = {max(per_card)}  # gres shard per card, from the nodes' Gres"] if per_card else []


def config_text(nodes: Sequence[NodeInfo], default_partition: str | None, cluster: str | None = None) -> str:
    """The TOML of a starting config describing NODES (as the Slurm backend reports them)."""
    types = sorted({t for n in nodes for t in n.gpus if t})
    untyped = sorted(n.name for n in nodes if n.gpus.get(""))
    parts: dict[str, list[NodeInfo]] = {}
    for n in nodes:
        for p in n.partitions:
            parts.setdefault(p, []).append(n)
    out = ["# Written by `slurmgpu config init` from the live cluster. Lines marked 'review' are not",
           "# Slurm's: check them against your hardware, then run `slurmgpu config check`.",
           "# relative_speed: vs an A100-80 by tensor peak and memory bandwidth (datasheets);",
           "# relative_speed_fp32: the same for a job in 32-bit floats (TF32 where the card has it, else FP32);",
           "# cost: half speed, half memory vs an A100-80. Put your own figures where you have them.", "",
           "[site]", f'cluster = "{cluster}"' if cluster else '# cluster = "..."  # ClusterName in slurm.conf', "",
           "[policy]", 'decider = "rules"', ""]
    if untyped:
        out += [f"# Nodes {', '.join(untyped)} offer GPUs without a type: give them Type= in gres.conf so",
                "# slurmgpu can tell them apart.", ""]
    cards = {m.card for t in types if (m := mig_profile(t)) is not None}
    for t in sorted(cards - set(types), key=str.lower):  # slices whose whole card no node offers
        out += [f"# {t}: the card the MIG slices below are cut from (no node offers it whole)",
                f"[gpu_types.{_key(t)}]", *_card_lines(t, nodes), ""]
    for t in types:
        out += [f"[gpu_types.{_key(t)}]", *_card_lines(t, nodes)]
        out += ["features = [" + ", ".join(f'"{f}"' for f in (t, *size_features(t, nodes))) + "]"]
        out += _shard_lines(t, nodes) + [""]
    for name in sorted(parts):
        members = parts[name]
        offered = sorted({t for n in members for t in n.gpus if t})
        if not offered:
            out += [f"# partition {name}: no typed GPUs on its {len(members)} node(s)", ""]
            continue
        per_node = max(n.gpus.get(t, 0) for n in members for t in offered)
        out += [f"[partitions.{name}]", "gpu_types = [" + ", ".join(f'"{t}"' for t in offered) + "]",
                f"gpus_per_node = {per_node}", f"nodes = {sum(1 for n in members if any(n.gpus.values()))}"]
        if name == default_partition:
            out.append("default = true")
        out.append("")
    return "\n".join(out)
