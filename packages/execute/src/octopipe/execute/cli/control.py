"""``octopipe certs | coordinator | node | submit | runs | metrics | nodes | cancel | resume``: the control plane.

Exit codes: 0 done, 2 bad usage or a refused request (the message says what to
change), 3 the run ended failed or cancelled, 4 the coordinator could not be
reached, 5 a ``--wait`` ran out (the run goes on).
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
from pathlib import Path
from typing import Any

from octopipe.coordinator.v1 import coordinator_pb2
from octopipe.execute.cli.connect import certs_option, client_options, err, out, run_id_arg, with_client
from octopipe.execute.cli.errors import EXIT_RUN_FAILED, EXIT_USAGE
from octopipe.execute.cli.profile import load_profile
from octopipe.execute.cli.run_view import as_dict, print_run, print_runs
from octopipe.execute.devices import RUN_DEVICES
from octopipe.ir import load_plan
from octopipe.node.v1 import node_pb2
from octopipe.tune import ScheduleRegistry

__all__ = ["register"]


def _count(minimum: int) -> Any:
    """An argparse type: an integer of at least ``minimum`` (the error names the flag)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, got {text}")
    return value


def _node_names(values: list[str]) -> list[str]:
    """``--nodes a b`` and ``--nodes a,b`` alike."""
    return [name for value in values for name in value.split(",") if name]


def register(sub: Any, registry: ScheduleRegistry) -> None:
    """Add the control-plane commands (certs, coordinator, node, submit, runs, cancel, resume)."""
    certs = sub.add_parser("certs", help="make a CA and certificates for a test cluster")
    certs_sub = certs.add_subparsers(dest="certs_command", metavar="CERTS_COMMAND", required=True)
    make = certs_sub.add_parser(
        "make",
        help="write a new CA and the coordinator, admin and node-ID certificates into DIR",
        description=(
            "Write a new CA (ca.pem into DIR, its private key ca.key into --ca-key-dir) and certificates into DIR: coordinator (role coordinator: the only "
            "caller daemons accept), admin (role admin: submit, runs, cancel, resume) and node-ID for each --nodes "
            "ID (role node, named ID: `octopipe node --node-id ID` loads it and may register only as ID)."
        ),
    )
    make.add_argument("folder", metavar="DIR", type=Path, help="the folder to write")
    make.add_argument(
        "--hosts", nargs="+", default=["127.0.0.1", "localhost"], help="addresses the servers are reached at"
    )
    make.add_argument(
        "--nodes", nargs="+", default=[], metavar="ID", help="node ids to write certificates for (a b, or a,b)"
    )
    make.add_argument(
        "--ca-key-dir",
        type=Path,
        help="where the CA's private key goes (default: DIR-ca-key beside DIR); keep it "
        "with the operator, off every node",
    )
    make.add_argument(
        "--force", action="store_true", help="replace a CA DIR already has (its certificates stop working)"
    )
    make.set_defaults(handler=_certs_make)
    add = certs_sub.add_parser(
        "node",
        help="add node-ID certificates to DIR, signed by the CA in DIR (for nodes added later)",
        description="Write node-ID.pem/.key for each ID (role node, named ID), signed by DIR's ca.key.",
    )
    add.add_argument("folder", metavar="DIR", type=Path, help="the folder `certs make` wrote")
    add.add_argument("node_ids", nargs="+", metavar="ID", help="node ids (as given to `octopipe node --node-id`)")
    add.add_argument(
        "--hosts", nargs="+", default=["127.0.0.1", "localhost"], help="addresses the node's daemon is reached at"
    )
    add.add_argument("--ca-key-dir", type=Path, help="the folder holding the CA's key (default: DIR-ca-key)")
    add.set_defaults(handler=_certs_node)
    copy = certs_sub.add_parser(
        "copy",
        help="copy one identity's files (ca.pem, NAME.pem, NAME.key) into OUT, for the machine that uses it",
        description="Write OUT/ca.pem, OUT/NAME.pem and OUT/NAME.key: what one machine needs, and nothing else "
        "(no CA key, no other identity's key).",
    )
    copy.add_argument("folder", metavar="DIR", type=Path, help="the folder `certs make` wrote")
    copy.add_argument("identity", help="coordinator, admin or node-ID")
    copy.add_argument(
        "out", metavar="OUT", type=Path, help="the folder to write, for the machine that uses the identity"
    )
    copy.set_defaults(handler=_certs_copy)
    show = certs_sub.add_parser("show", help="list DIR's certificates: role, name, expiry")
    show.add_argument("folder", metavar="DIR", type=Path, help="the folder `certs make` wrote")
    show.set_defaults(handler=_certs_show)

    coordinator = sub.add_parser("coordinator", help="run the coordinator (gRPC, mutual TLS)")
    coordinator.add_argument("--listen", default="127.0.0.1:50051", help="host:port to serve on (port 0: any)")
    certs_option(coordinator, "coordinator")
    coordinator.add_argument(
        "--state-dir",
        type=Path,
        default=Path("octopipe-coordinator"),
        help="where runs, metrics and checkpoints (without --checkpoint-root) are kept; one coordinator per folder",
    )
    coordinator.add_argument(
        "--checkpoint-root", type=Path, help="shared storage for run checkpoints (default: STATE_DIR/checkpoints)"
    )
    coordinator.add_argument("--heartbeat-timeout", type=float, default=2.0, help="seconds of silence = node lost")
    coordinator.add_argument(
        "--never-fits-after",
        type=_seconds,
        default=600.0,
        help="fail a queued run that needs more slots than the live nodes have after this long (default: 600)",
    )
    coordinator.set_defaults(handler=_coordinator)

    node = sub.add_parser("node", help="run a node daemon: registers with the coordinator and runs ranks")
    node.add_argument("--coordinator", required=True, help="the coordinator's host:port")
    certs_option(node, "", shown="node-<node id>")
    node.add_argument("--node-id", required=True, help="this node's id; its certificate names it (node-ID.pem)")
    node.add_argument("--listen", default="127.0.0.1:0", help="host:port to serve on (port 0: any)")
    node.add_argument("--advertise", default="", help="the host others reach this node at (default: --listen host)")
    node.add_argument("--slots", type=_count(1), default=1, help="rank processes this node runs (default 1)")
    node.add_argument(
        "--work-dir", type=Path, default=Path("octopipe-node"), help="where the ranks' files go (one folder per run)"
    )
    node.add_argument("--allow-model-source", action="append", default=[], help="package.module:function")
    node.add_argument(
        "--fence-after", type=float, default=6.0, help="stop ranks after this long without the coordinator"
    )
    node.add_argument("--rank-timeout", type=float, default=60.0, help="seconds a rank may wait for a message")
    node.add_argument("--no-pin", action="store_true", help="do not pin each rank to its own core")
    node.set_defaults(handler=_node)

    submit = sub.add_parser("submit", help="submit a plan to a coordinator")
    submit.add_argument("plan", type=Path, help="plan file (.binpb, .json, .txt, .csv) naming its model")
    client_options(submit)
    submit.add_argument("--steps", type=_count(1), default=3, help="optimizer steps (default 3)")
    submit.add_argument(
        "--run-id", type=run_id_arg, default="", help="a name for the run (default: the coordinator picks one)"
    )
    submit.add_argument("--seed", type=_count(0), default=0, help="the model's seed on every rank (default 0)")
    submit.add_argument(
        "--checkpoint-every", type=_count(0), default=0, help="steps between checkpoints (default 0: none)"
    )
    submit.add_argument(
        "--wait", type=_seconds, default=0.0, help="wait up to this many seconds for the run to end (default 0)"
    )
    submit.add_argument(
        "--adapt", type=Path, metavar="PROFILE", help="closed loop: re-tune from measured steps, starting from PROFILE"
    )
    submit.add_argument(
        "--device",
        choices=RUN_DEVICES,
        default="cpu",
        help="where the ranks compute: cpu (gloo) or cuda (one GPU per rank, NCCL; placed on nodes' GPUs)",
    )
    submit.add_argument(
        "--profile",
        type=Path,
        help="layer costs (`octopipe profile`): the coordinator predicts the step time, and `runs RUN` shows it "
        "beside the measured one (--adapt's PROFILE does too)",
    )
    submit.add_argument(
        "--adapt-after", type=_count(0), default=0, help="steps to measure before re-tuning (default 0: 3 steps)"
    )
    submit.add_argument(
        "--checkpoint-async", action="store_true", help="write checkpoints in the background (default: off)"
    )
    submit.add_argument(
        "--checkpoint-keep", type=_count(0), default=0, help="keep the newest N checkpoints (default 0: all)"
    )
    submit.add_argument(
        "--recover",
        action="store_true",
        help="heal the run on a lost node, rank or link: same plan when the slots come back, else re-planned "
        "for the slots that remain (needs --profile), from the last checkpoint (default: off, the run fails)",
    )
    submit.add_argument(
        "--wait-for-replacement",
        type=_seconds,
        default=0.0,
        help="--recover: wait this long for a replacement before re-planning (default: 0)",
    )
    submit.add_argument(
        "--max-recoveries", type=_count(0), default=0, help="--recover: give up after N recoveries (default: 0, 3)"
    )
    submit.add_argument(
        "--queue-deadline",
        type=_seconds,
        default=0.0,
        help="fail the run if it cannot be placed for this long (default: 0, the coordinator's --never-fits-after)",
    )
    submit.set_defaults(handler=_submit)

    runs = sub.add_parser("runs", help="list a coordinator's runs (or show one)")
    runs.add_argument("run_id", nargs="?", type=run_id_arg, help="show this run (default: list every run)")
    client_options(runs)
    runs.set_defaults(handler=_runs)

    metrics = sub.add_parser("metrics", help="a run's per-step metrics from every rank (--follow: as they come)")
    metrics.add_argument("run_id", type=run_id_arg, help="the run")
    client_options(metrics)
    metrics.add_argument("--follow", action="store_true", help="keep printing until the run ends")
    metrics.add_argument(
        "--timeout", type=_seconds, default=3600.0, help="--follow: give up after this many seconds (default 3600)"
    )
    metrics.set_defaults(handler=_metrics)

    nodes = sub.add_parser("nodes", help="list the coordinator's nodes: slots, liveness, heartbeat age, run, GPUs")
    client_options(nodes)
    nodes.set_defaults(handler=_nodes)

    cancel = sub.add_parser("cancel", help="stop a run on every node")
    cancel.add_argument("run_id", type=run_id_arg, help="the run to stop")
    client_options(cancel)
    cancel.set_defaults(handler=_cancel)

    resume = sub.add_parser("resume", help="restart a failed or cancelled run from its last checkpoint")
    resume.add_argument("run_id", type=run_id_arg, help="the failed or cancelled run to resume")
    client_options(resume)
    resume.add_argument("--plan", type=Path, help="a re-tuned plan with the same layers (e.g. for fewer nodes)")
    resume.add_argument(
        "--wait", type=_seconds, default=0.0, help="wait up to this many seconds for the run to end (default 0)"
    )
    resume.set_defaults(handler=_resume)


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{text!r} is not host:port (e.g. 127.0.0.1:50051)")
    return host, int(port)


def _serve(start: Any, started: str) -> int:
    """Start a server (``start()`` returns it), say where it listens (``started`` with its address), and serve
    until SIGINT or SIGTERM; a missing certificate, an address in use or a held state folder is one line."""
    try:
        server = start()
    except OSError as exc:
        err(f"octopipe: error: {exc}")
        return EXIT_USAGE
    out(started.format(server.address))
    _serve_until_signal(server.stop)
    return 0


def _serve_until_signal(stop: Any) -> None:
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(0.5):
        pass
    stop()


def _certs_make(args: argparse.Namespace) -> int:
    from octopipe.execute.control.certs import ca_key_folder, make_certs  # noqa: PLC0415

    key_dir = args.ca_key_dir or ca_key_folder(args.folder)
    try:
        paths = make_certs(
            args.folder, hosts=args.hosts, nodes=_node_names(args.nodes), ca_key_dir=key_dir, force=args.force
        )
    except FileExistsError as exc:
        err(f"octopipe: error: {exc}")
        return EXIT_USAGE
    out(f"wrote a CA and certificates {sorted(paths)} for {args.hosts} into {args.folder}")
    out(f"the CA's private key is in {key_dir}: keep it with you, off every node")
    if not args.nodes:
        out(f"no node certificates yet: add them with `octopipe certs node {args.folder} ID ...` (or --nodes)")
    out(f"give each machine only its own files: `octopipe certs copy {args.folder} node-ID OUT`")
    return 0


def _certs_node(args: argparse.Namespace) -> int:
    from octopipe.execute.control.certs import add_node_certs  # noqa: PLC0415

    try:
        paths = add_node_certs(args.folder, _node_names(args.node_ids), hosts=args.hosts, ca_key_dir=args.ca_key_dir)
    except FileNotFoundError as exc:
        err(f"octopipe: error: {exc}")
        return EXIT_USAGE
    out(f"wrote certificates {sorted(paths)} for {args.hosts} into {args.folder}, signed by its CA")
    return 0


def _certs_copy(args: argparse.Namespace) -> int:
    from octopipe.execute.control.certs import copy_identity  # noqa: PLC0415

    try:
        written = copy_identity(args.folder, args.identity, args.out)
    except FileNotFoundError as exc:
        err(f"octopipe: error: {exc}")
        return EXIT_USAGE
    out(f"wrote {', '.join(p.name for p in written)} into {args.out}")
    return 0


def _certs_show(args: argparse.Namespace) -> int:
    import datetime  # noqa: PLC0415

    from octopipe.execute.control.certs import describe_certs  # noqa: PLC0415

    now = datetime.datetime.now(datetime.UTC)
    found = describe_certs(args.folder)
    if not found:
        err(f"octopipe: error: {args.folder} holds no certificates: make them with `octopipe certs make {args.folder}`")
        return EXIT_USAGE
    out(f"{'IDENTITY':<20} {'ROLE':<12} {'NAME':<16} EXPIRES")
    for identity, role, name, expires in found:
        left = expires - now
        note = "EXPIRED" if left.total_seconds() <= 0 else f"in {left.days} days"
        out(f"{identity:<20} {role or '-':<12} {name or '-':<16} {expires:%Y-%m-%d %H:%M} UTC ({note})")
    return 0


def _coordinator(args: argparse.Namespace) -> int:
    from octopipe.execute.control import Coordinator, CoordinatorConfig  # noqa: PLC0415

    host, port = _host_port(args.listen)
    config = CoordinatorConfig(
        certs=args.certs,
        identity=args.identity,
        listen_host=host,
        listen_port=port,
        state_dir=args.state_dir,
        checkpoint_root=args.checkpoint_root,
        heartbeat_timeout_s=args.heartbeat_timeout,
        never_fits_after_s=args.never_fits_after,
    )
    return _serve(lambda: Coordinator(config).start(), "coordinator listening on {}")


def _node(args: argparse.Namespace) -> int:
    from octopipe.execute.control import NodeConfig, NodeDaemon  # noqa: PLC0415

    host, port = _host_port(args.listen)
    config = NodeConfig(
        node_id=args.node_id,
        coordinator=args.coordinator,
        certs=args.certs,
        identity=args.identity,
        listen_host=host,
        listen_port=port,
        advertise_host=args.advertise,
        slots=args.slots,
        work_dir=args.work_dir,
        allowed_model_sources=tuple(args.allow_model_source),
        fence_after_s=args.fence_after,
        rank_timeout_s=args.rank_timeout,
        pin_cores=not args.no_pin,
    )
    return _serve(lambda: NodeDaemon(config).start(), f"node {args.node_id} serving on {{}}")


def _finish(client: Any, run_id: str, wait_s: float, as_json: bool) -> int:
    run = client.wait(run_id, timeout_s=wait_s) if wait_s > 0 else client.run(run_id)
    print_run(run, as_json)
    failed = run.state in (node_pb2.RUN_STATE_FAILED, node_pb2.RUN_STATE_CANCELLED)
    return EXIT_RUN_FAILED if failed else 0


def _submit(args: argparse.Namespace) -> int:

    plan = load_plan(args.plan)
    if args.adapt is not None and args.profile is not None:
        raise ValueError("--profile and --adapt PROFILE: give the profile once (--adapt's predicts too)")
    adapt_profile = load_profile(args.adapt) if args.adapt is not None else None
    profile = load_profile(args.profile) if args.profile is not None else None

    def action(client: Any) -> int:
        run_id = client.submit(
            plan,
            steps=args.steps,
            run_id=args.run_id,
            checkpoint_every=args.checkpoint_every,
            seed=args.seed,
            adapt_profile=adapt_profile,
            adapt_after_steps=args.adapt_after,
            profile=profile,
            device=args.device,
            checkpoint_async=args.checkpoint_async,
            checkpoint_keep=args.checkpoint_keep,
            recovery=coordinator_pb2.RecoveryPolicy(
                automatic=args.recover,
                wait_for_replacement_s=args.wait_for_replacement,
                max_recoveries=args.max_recoveries,
            ),
            queue_deadline_s=args.queue_deadline,
        )
        return _finish(client, run_id, args.wait, args.json)

    return with_client(args, action)


def _runs(args: argparse.Namespace) -> int:
    def action(client: Any) -> int:
        if args.run_id:
            print_run(client.run(args.run_id), args.json)
        else:
            print_runs(client.runs(), args.json)
        return 0

    return with_client(args, action)


def _metrics(args: argparse.Namespace) -> int:
    def show(item: Any) -> None:
        if args.json:
            out(json.dumps({
                "step": item.step, "rank": item.rank, "loss": item.loss, "step_duration_us": item.step_duration_us,
                "peak_memory_bytes": item.peak_memory_bytes, "plan_switches": item.plan_switches,
            }))  # fmt: skip
        else:
            out(
                f"{item.step:>6} {item.rank:>5} {item.loss:>14.8g} {item.step_duration_us / 1e3:>10.2f} "
                f"{item.peak_memory_bytes / 2**20:>10.1f}"
            )

    def action(client: Any) -> int:
        if not args.json:
            out(f"{'STEP':>6} {'RANK':>5} {'LOSS':>14} {'STEP (ms)':>10} {'PEAK (MiB)':>10}")
        items = client.follow_metrics(args.run_id, timeout_s=args.timeout) if args.follow else None
        for item in items if items is not None else client.metrics(args.run_id, follow=False):
            show(item)
        return 0

    return with_client(args, action)


def _nodes(args: argparse.Namespace) -> int:
    def action(client: Any) -> int:
        nodes = client.nodes()
        if args.json:
            out(json.dumps([as_dict(n) for n in nodes]))
            return 0
        if not nodes:
            out("no nodes registered")
            return 0
        out(f"{'NODE':<16} {'ADDRESS':<22} {'SLOTS':>5} {'STATE':<6} {'HEARTBEAT':>9}  {'RUN':<16} GPUS")
        for n in nodes:
            state = "alive" if n.alive else "lost"
            out(
                f"{n.node_id:<16} {n.address:<22} {n.slots:>5} {state:<6} {n.heartbeat_age_seconds:>8.1f}s  "
                f"{n.run_id or '-':<16} {_gpus(n.gpus)}"
            )
        return 0

    return with_client(args, action)


def _gpus(gpus: Any) -> str:
    """``2 x NVIDIA H200 (139.8 GiB)``, one group per model; ``-`` for none."""
    if not gpus:
        return "-"
    groups: dict[tuple[str, int], int] = {}
    for gpu in gpus:
        groups[(gpu.name, gpu.memory_bytes)] = groups.get((gpu.name, gpu.memory_bytes), 0) + 1
    return ", ".join(f"{count} x {name} ({memory / 2**30:.1f} GiB)" for (name, memory), count in groups.items())


def _cancel(args: argparse.Namespace) -> int:
    def action(client: Any) -> int:
        print_run(client.cancel(args.run_id), args.json)
        return 0

    return with_client(args, action)


def _resume(args: argparse.Namespace) -> int:

    plan = load_plan(args.plan) if args.plan else None

    def action(client: Any) -> int:
        client.resume(args.run_id, plan)
        return _finish(client, args.run_id, args.wait, args.json)

    return with_client(args, action)
