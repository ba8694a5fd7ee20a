"""``octopipe profile``: profile a zoo workload's layers on this machine and write a Profile."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from octopipe.execute.cli.progress import spinner
from octopipe.execute.devices import RUN_DEVICES, rank_device
from octopipe.ir import COMPUTE_DTYPES
from octopipe.plan.v1 import plan_pb2
from octopipe.profile.v1 import profile_pb2
from octopipe.tune import ScheduleRegistry

__all__ = ["load_profile", "register", "run", "save_profile"]


def register(sub: Any, registry: ScheduleRegistry) -> None:
    """Add ``octopipe profile`` to the CLI's subcommands."""
    parser = sub.add_parser("profile", help="time and size each layer's F, B and W graphs; write a Profile")
    parser.set_defaults(handler=run)
    parser.add_argument("--workload", default="jamba-8", help="llama-8, jamba-8, nemotronh-16 or moe-ep-4")
    parser.add_argument("--tiny", action="store_true", help="unit-test sizes instead of the standard ones")
    parser.add_argument("--sequence", type=int, help="tokens per sequence (default: the workload's)")
    parser.add_argument("--microbatch-size", type=int, help="sequences per micro-batch (default: the workload's)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per graph (median reported)")
    parser.add_argument(
        "--precision",
        choices=COMPUTE_DTYPES,
        default="float32",
        help="the dtype layers hold and compute in (bfloat16: float32 master weights and gradients); recorded in "
        "the Profile, and plans tuned from it run in it",
    )
    parser.add_argument(
        "--device",
        choices=RUN_DEVICES,
        default="cpu",
        help="where layers run and are timed: cpu (host clock) or cuda (GPU 0; CUDA events, the CUDA allocator)",
    )
    parser.add_argument(
        "--link",
        action="store_true",
        help="also measure the links between local ranks (cpu: gloo, one pair stands for all; cuda: NCCL, every "
        "pair of --ranks GPUs)",
    )
    parser.add_argument("--ranks", type=int, default=2, help="--link: write the local link for every pair of N ranks")
    parser.add_argument(
        "--compile",
        choices=("eager", "inductor"),
        default="eager",
        help="profile the graphs as captured (eager) or as Inductor compiles them (inductor); default: eager",
    )
    parser.add_argument(
        "--lockstep",
        action="store_true",
        help="profile as the pipeline's ranks run: one pinned process per rank (--ranks), each on its own core, "
        "every timed sample started in all of them together (cpu, eager); the median over them is written",
    )
    parser.add_argument(
        "--recompute",
        nargs="+",
        default=[],
        metavar="POLICY",
        help="also profile every layer under these recomputation policies (layers, budget:F), for plans whose "
        "stages recompute (Stage.recompute); each lands in the layer's `recomputed`",
    )
    parser.add_argument("--out", type=Path, default=Path("out/profile.binpb"), help=".binpb or .json")
    parser.add_argument("--json", action="store_true", help="print the Profile as JSON instead of a table")


def save_profile(profile: profile_pb2.Profile, path: Path) -> None:
    """Write ``profile`` as binary proto (.binpb/.pb) or proto JSON (.json)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".json":
        path.write_text(json_format.MessageToJson(profile, preserving_proto_field_name=True, sort_keys=True) + "\n")
    elif path.suffix in (".binpb", ".pb"):
        path.write_bytes(profile.SerializeToString(deterministic=True))
    else:
        raise ValueError(f"{path}: write a profile as .binpb, .pb or .json")


def load_profile(path: Path) -> profile_pb2.Profile:
    """Read a Profile from .binpb/.pb (binary) or .json; ValueError saying what is wrong."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the profile: {exc.strerror}") from None
    try:
        if path.suffix == ".json":
            return json_format.Parse(data.decode("utf-8"), profile_pb2.Profile())
        if path.suffix in (".binpb", ".pb"):
            return profile_pb2.Profile.FromString(data)
    except Exception as exc:  # DecodeError, ParseError, UnicodeDecodeError
        raise ValueError(f"{path}: not an octopipe.profile.v1.Profile: {exc}") from None
    raise ValueError(f"{path}: a profile is a .binpb, .pb or .json file")


def run(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415 - torch loads only for commands that need it

    from octopipe.examples import ModelConfig, workload  # noqa: PLC0415
    from octopipe.execute.runtime.linkprobe import measure_links  # noqa: PLC0415
    from octopipe.execute.runtime.precision import dtype_named  # noqa: PLC0415
    from octopipe.transform import (  # noqa: PLC0415
        Device,
        ProfilerConfig,
        StageCompiler,
        profile_layers,
        stage_backend,
    )

    if args.out.suffix not in (".binpb", ".pb", ".json"):
        raise ValueError(f"--out {args.out}: use a .binpb, .pb or .json file")
    base = workload(args.workload)
    chosen = replace(base, config=ModelConfig.tiny()) if args.tiny else base
    if args.sequence:
        chosen = replace(chosen, sequence=args.sequence)
    if args.link and args.ranks < 2:
        raise ValueError(f"--ranks {args.ranks}: a link needs at least 2 ranks")
    if args.lockstep and (Device.parse(rank_device(args.device, 0)).is_cuda or args.compile != "eager"):
        raise ValueError("--lockstep profiles eager graphs on this machine's CPU cores: drop --device/--compile")
    recompute = _recompute_configs(args.recompute)
    if args.lockstep and recompute:
        raise ValueError("--lockstep does not profile recomputation policies yet: drop --recompute or --lockstep")
    size = args.microbatch_size or chosen.microbatch_size
    if args.lockstep:
        profile = _profile_in_lockstep(args, chosen, size)
        _write(profile, args)
        return 0
    device = Device.parse(rank_device(args.device, 0))
    device.activate()  # no CUDA here: one line, before anything is built
    torch.set_num_threads(1)
    model = device.put(chosen.model(seed=0).to(dtype_named(args.precision)))
    tokens, targets = map(device.put, chosen.batch(seed=0))
    with spinner(f"measuring the links between {args.ranks} local ranks ...", enabled=args.link and not args.json):
        links = measure_links(args.ranks, device=args.device) if args.link else []
    reference = plan_pb2.ModelReference(name=chosen.name, source="octopipe.examples:workload")
    reference.config["sequence"] = str(chosen.sequence)
    reference.config["tiny"] = str(args.tiny).lower()
    with spinner(f"profiling F, I, W of {args.workload}'s layers ...", enabled=not args.json):
        profile = profile_layers(
            model,
            tokens[:size],
            targets[:size],
            config=ProfilerConfig(repeats=args.repeats, device=device, recompute=recompute),
            links=links,
            model_reference=reference,
            compiler=StageCompiler(backend=stage_backend(args.compile)),
        )
    if args.compile != "eager":
        profile.labels["compile"] = args.compile
    if args.precision != "float32":  # absent means float32: a float32 profile stays as it always was
        profile.precision.compute_dtype = args.precision
    _write(profile, args)
    return 0


def _recompute_configs(policies: list[str]) -> tuple[Any, ...]:
    """``--recompute``'s policies as capture configurations, checked (``none`` is always profiled)."""
    from octopipe.capture import CaptureConfig  # noqa: PLC0415
    from octopipe.ir import Recompute  # noqa: PLC0415

    out = []
    for text in policies:
        parsed = Recompute.parse(text)
        if parsed.policy == "none":
            raise ValueError("--recompute none: saving is always profiled; list only layers or budget:F")
        out.append(CaptureConfig(recompute=parsed.policy, activation_budget=parsed.activation_budget))
    if len({c.recompute_label for c in out}) != len(out):
        raise ValueError(f"--recompute {' '.join(policies)}: a policy is listed twice")
    return tuple(out)


def _profile_in_lockstep(args: argparse.Namespace, chosen: Any, size: int) -> profile_pb2.Profile:
    """``--lockstep``: the workload's layers profiled in one pinned process per rank (``runtime.lockstep``)."""
    from octopipe.execute.runtime.linkprobe import measure_links  # noqa: PLC0415
    from octopipe.execute.runtime.lockstep import profile_in_lockstep  # noqa: PLC0415
    from octopipe.execute.runtime.models import workload_reference  # noqa: PLC0415

    if chosen.global_batch % size:
        raise ValueError(f"--microbatch-size {size} does not divide the global batch of {chosen.global_batch}")
    reference = workload_reference(chosen.name, tiny=args.tiny, sequence=chosen.sequence)
    precision = "" if args.precision == "float32" else args.precision
    with spinner(f"measuring the links between {args.ranks} local ranks ...", enabled=args.link and not args.json):
        links = measure_links(args.ranks) if args.link else []
    with spinner(f"profiling {args.workload}'s layers in {args.ranks} pinned processes ...", enabled=not args.json):
        profile = profile_in_lockstep(
            reference,
            num_microbatches=chosen.global_batch // size,
            num_ranks=args.ranks,
            repeats=args.repeats,
            precision=precision,
        )
    profile.links.extend(links)
    return profile


def _write(profile: profile_pb2.Profile, args: argparse.Namespace) -> None:
    """Save ``profile`` to ``--out`` and print it (a table, or JSON with ``--json``)."""
    from octopipe.transform import format_profile  # noqa: PLC0415

    save_profile(profile, args.out)
    if args.json:
        sys.stdout.write(
            json.dumps(json_format.MessageToDict(profile, preserving_proto_field_name=True), indent=2) + "\n"
        )
    else:
        sys.stdout.write(format_profile(profile))
        sys.stdout.write(f"written: {args.out}\n")
