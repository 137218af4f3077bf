"""python -m cluster {validate,cost,rehearse,spot-watcher,chaos}: parse, call the library, print,
map to exit codes (0 ok, warnings allowed; 1 a check or an action failed; 2 bad input)."""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import signal
import sys
from collections import Counter

from cluster import ray_nodes
from cluster.aws_facts import has_aws_credentials
from cluster.azure_events import CLOUDS, DEFAULT_AZURE_METADATA_URL, ScheduledEventsClient, detect_cloud
from cluster.chaos import ACTIONS, TRAIN_WORKER_CLASS, ChaosExecutor, ChaosPolicy, NothingToDo
from cluster.checks import Status, any_failed, provider_type
from cluster.config import DEFAULT_CLUSTER_FILE, ConfigError, load_and_prepare
from cluster.cost import estimate_run, node_costs, refresh_spot_prices
from cluster.imds import DEFAULT_IMDS_URL, MAX_TOKEN_TTL_S, ImdsClient, ImdsError, ImdsUnavailable
from cluster.prices import load_price_table
from cluster.rehearse import rehearse
from cluster.spot_watcher import REBALANCE_POLICIES, SpotPolicy, SpotWatcher
from cluster.validate import validate_cluster

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def finite_float(text: str) -> float:
    """An argparse type: a number, not inf or nan (which every comparison would let through)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cluster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    validate = sub.add_parser("validate", help="preflight checks before `ray up`")
    validate.add_argument("config", nargs="?", default=DEFAULT_CLUSTER_FILE)
    validate.add_argument("--offline", action="store_true", help="skip live AWS/Azure checks even with credentials")
    cost = sub.add_parser("cost", help="$/hour per node type and the cost and energy of a run")
    cost.add_argument("config", nargs="?", default=DEFAULT_CLUSTER_FILE)
    cost.add_argument("--hours", type=finite_float, default=1.0, help="run duration (default 1)")
    cost.add_argument("--workers", type=int, default=None,
                      help="GPU worker nodes (default: the preferred type's max_workers)")
    cost.add_argument("--offline", action="store_true", help="use the table's spot prices even with credentials")
    rehearse = sub.add_parser("rehearse", help="rehearse autoscaling locally with fake GPU nodes")
    rehearse.add_argument("config", nargs="?", default=DEFAULT_CLUSTER_FILE)
    rehearse.add_argument("--gpu-workers", type=int, default=2, help="GPU workers the rehearsal job needs")
    rehearse.add_argument("--idle-timeout-s", type=finite_float, default=10.0,
                          help="idle time before a fake node is released")
    add_spot_watcher_parser(sub)
    add_chaos_parser(sub)
    return parser


def add_spot_watcher_parser(sub) -> None:
    watcher = sub.add_parser("spot-watcher", help="on a worker node: drain it when EC2 announces a spot interruption "
                             "or Azure a Spot eviction")
    watcher.add_argument("--cloud", choices=CLOUDS, default="aws",
                         help="aws (IMDSv2 spot notices, default), azure (Scheduled Events Preempt), or auto: "
                              "whichever metadata service answers")
    watcher.add_argument("--azure-metadata-url", default=DEFAULT_AZURE_METADATA_URL,
                         help=f"Azure instance metadata service (default {DEFAULT_AZURE_METADATA_URL})")
    watcher.add_argument("--imds-url", default=DEFAULT_IMDS_URL,
                         help=f"instance metadata service (default {DEFAULT_IMDS_URL})")
    watcher.add_argument("--interval-s", type=finite_float, default=5.0,
                         help="seconds between polls (default 5, as AWS advises)")
    watcher.add_argument("--address", default=None,
                         help="Ray GCS host:port (default: $RAY_ADDRESS, else the cluster `ray start` joined here)")
    watcher.add_argument("--node-id", default=None,
                         help="hex id of the node to drain (default: the one raylet of this cluster on this host)")
    watcher.add_argument("--on-rebalance", choices=REBALANCE_POLICIES, default="log",
                         help="on an EC2 rebalance recommendation: ignore it, log it (default), or drain early")
    watcher.add_argument("--rebalance-deadline-s", type=finite_float, default=600.0,
                         help="drain deadline after a rebalance recommendation with --on-rebalance drain (default 600)")
    watcher.add_argument("--token-ttl-s", type=int, default=MAX_TOKEN_TTL_S,
                         help=f"IMDSv2 session token lifetime, 1..{MAX_TOKEN_TTL_S} (default {MAX_TOKEN_TTL_S})")
    watcher.add_argument("--max-backoff-s", type=finite_float, default=60.0,
                         help="longest wait between polls while IMDS is unreachable (default 60)")
    watcher.add_argument("--once", action="store_true",
                         help="poll once, drain on a notice, and exit (1 if IMDS is unreachable)")


def add_chaos_parser(sub) -> None:
    chaos = sub.add_parser("chaos", help="rehearse a failure on a live cluster running a Ray Train job")
    chaos.add_argument("action", choices=ACTIONS,
                       help="kill-worker: SIGKILL one Ray Train worker process; drain-node: drain a node running "
                            "one as if preempted; kill-node: SIGKILL that node's raylet and all its processes")
    chaos.add_argument("--address", default=None, help="Ray cluster address (default: auto, as `ray.init` finds it)")
    chaos.add_argument("--seed", type=int, default=None, help="seed for the random choice of target")
    chaos.add_argument("--node-id", default=None, help="only consider this node (hex id)")
    chaos.add_argument("--allow-head", action="store_true", help="the head node may be a target")
    chaos.add_argument("--deadline-s", type=finite_float, default=30.0,
                       help="drain-node: deadline in seconds (default 30)")
    chaos.add_argument("--dry-run", action="store_true", help="print the target and what would be done; touch nothing")


def run_validate(args: argparse.Namespace) -> int:
    results = validate_cluster(args.config, live=not args.offline)
    for result in results:
        print(result.line())
    counts = Counter(result.status for result in results)
    print(f"{args.config}: {counts[Status.PASS]} passed, {counts[Status.WARN]} warnings, "
          f"{counts[Status.FAIL]} failed, {counts[Status.SKIP]} skipped")
    return EXIT_FAILED if any_failed(results) else EXIT_OK


def run_cost(args: argparse.Namespace) -> int:
    if args.hours < 0 or (args.workers is not None and args.workers < 0):
        raise ConfigError("--hours and --workers must be >= 0")
    _, config = load_and_prepare(args.config)
    if provider_type(config) not in ("aws", "azure"):
        print(f"{provider_type(config)} provider: machines you own; no hourly prices to show")
        return EXIT_OK
    table = load_price_table()
    source = f"cluster/prices.json as of {table.as_of}"
    spot = {}
    if provider_type(config) == "aws" and not args.offline and has_aws_credentials(os.environ):
        try:
            spot = refresh_spot_prices(config)
            source += f"; spot from AWS spot price history ({config['provider']['region']}, now)"
        except Exception as error:  # no network, access denied: the table still answers
            source += f"; spot refresh failed ({type(error).__name__}), table prices used"
    print(f"prices: {source}")
    costs, unknown = node_costs(config, table, spot)
    width = max([14, *(len(cost.instance_type) for cost in costs)])  # Azure's sizes are long names
    print(f"{'node type':16} {'instance':{width}} {'market':9} {'GPUs':10} {'on-demand $/h':>13} "
          f"{'spot $/h':>9} {'pays $/h':>9} {'max':>4}")
    for cost in costs:
        gpus = f"{cost.gpus}x{cost.gpu_model}" if cost.gpus else "0"
        print(f"{cost.node_type:16} {cost.instance_type:{width}} {'spot' if cost.spot else 'on-demand':9} {gpus:10} "
              f"{cost.on_demand_usd_per_hour:13.3f} {cost.spot_usd_per_hour:9.3f} {cost.usd_per_hour:9.3f} "
              f"{cost.max_workers:4d}")
    for name in unknown:
        print(f"{name}: not in the price table, left out of the estimate")
    head = config["head_node_type"]
    if all(cost.node_type != head for cost in costs):
        print("the head's instance type is not in the price table: no run estimate")
        return EXIT_OK
    run = estimate_run(costs, head, args.hours, args.workers)
    placed = ", ".join(f"{n} x {name}" for name, n in run.workers.items()) or "no GPU workers"
    print(f"\nrun of {run.hours:g} h with {sum(run.workers.values())} GPU worker node(s): {placed}")
    if run.unplaced_workers:
        print(f"  {run.unplaced_workers} more worker(s) than the GPU types' max_workers allow: not counted")
    print(f"  head     ${run.head_usd:.2f}")
    print(f"  workers  ${run.workers_usd:.2f}")
    saving = 100 * (1 - run.total_usd / run.on_demand_usd) if run.on_demand_usd else 0.0
    print(f"  total    ${run.total_usd:.2f}   (all on-demand: ${run.on_demand_usd:.2f}; saves {saving:.0f}%)")
    print(f"  energy   {run.gpu_kwh:.2f} kWh (GPUs at rated board power for {run.hours:g} h; "
          "CPUs, memory and cooling not counted)")
    return EXIT_OK


def run_rehearse(args: argparse.Namespace) -> int:
    return EXIT_OK if rehearse(args.config, gpu_workers=args.gpu_workers,
                               idle_timeout_s=args.idle_timeout_s) else EXIT_FAILED


def run_spot_watcher(args: argparse.Namespace) -> int:
    if args.interval_s <= 0 or args.max_backoff_s <= 0:
        raise ConfigError("--interval-s and --max-backoff-s must be > 0")
    for flag, url in (("--imds-url", args.imds_url), ("--azure-metadata-url", args.azure_metadata_url)):
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"{flag} must be an http:// or https:// URL, got {url!r}")
    cloud = args.cloud
    if cloud == "auto":
        try:
            cloud = detect_cloud(args.imds_url, args.azure_metadata_url)
        except ImdsUnavailable as error:
            print(f"error: --cloud auto: {error}", file=sys.stderr)
            return EXIT_FAILED
    try:
        imds = (ScheduledEventsClient(args.azure_metadata_url) if cloud == "azure"
                else ImdsClient(args.imds_url, token_ttl_s=args.token_ttl_s))
        policy = SpotPolicy(on_rebalance=args.on_rebalance, rebalance_deadline_s=args.rebalance_deadline_s)
    except ValueError as error:
        raise ConfigError(str(error)) from error
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    log = logging.getLogger("cluster.spot_watcher")
    try:
        gcs = ray_nodes.gcs_client(args.address)
        nodes = ray_nodes.list_nodes(gcs)
    except ray_nodes.RayUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_FAILED
    node_id = ray_nodes.check_node(nodes, args.node_id).node_id if args.node_id else ray_nodes.local_node_id(nodes)

    def drain(decision) -> None:
        ray_nodes.drain_node(gcs, node_id, decision.reason_message, decision.deadline_timestamp_ms)

    def released() -> bool:  # the drained raylet has exited: nothing of Ray's is left to lose
        return not any(node.node_id == node_id and node.alive for node in ray_nodes.list_nodes(gcs))

    acknowledge = imds.acknowledge if cloud == "azure" else None
    watcher = SpotWatcher(imds, policy, drain, interval_s=args.interval_s, max_backoff_s=args.max_backoff_s,
                          acknowledge=acknowledge, released=released)
    log.info("watching node %s: %s every %g s, rebalance recommendations: %s", node_id,
             f"Azure Scheduled Events at {args.azure_metadata_url}" if cloud == "azure" else f"IMDS {args.imds_url}",
             args.interval_s, args.on_rebalance)
    if args.once:
        try:
            drains = watcher.poll_once()
        except ImdsUnavailable as error:
            print(f"error: IMDS unreachable ({error}): not on {'Azure' if cloud == 'azure' else 'EC2'}, "
                  "or instance metadata is disabled", file=sys.stderr)
            return EXIT_FAILED
        except (ImdsError, ray_nodes.RayUnavailable) as error:
            print(f"error: {error}", file=sys.stderr)
            return EXIT_FAILED
        if not drains:
            log.info("no interruption notice requires a drain")
        return EXIT_OK
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(EXIT_OK))
    try:
        watcher.run()
    except (KeyboardInterrupt, SystemExit):
        log.info("stopped")
    return EXIT_OK


def run_chaos(args: argparse.Namespace) -> int:
    if args.deadline_s < 0:
        raise ConfigError(f"--deadline-s must be >= 0, got {args.deadline_s}")
    import ray  # (lazy: ray)

    try:
        ray.init(address=args.address or "auto", logging_level="ERROR", log_to_driver=False)
    except ConnectionError as error:  # no cluster found, or none answering at --address
        print(f"error: cannot connect to a Ray cluster ({args.address or 'auto'}): {error}", file=sys.stderr)
        return EXIT_FAILED
    try:
        address = ray.get_runtime_context().gcs_address
        gcs = ray_nodes.gcs_client(address)
        nodes = ray_nodes.list_nodes(gcs)
        if args.node_id:
            ray_nodes.check_node(nodes, args.node_id)
        policy = ChaosPolicy(allow_head=args.allow_head, node_id=args.node_id)
        try:
            decision = policy.decide(args.action, ray_nodes.alive_actors(TRAIN_WORKER_CLASS), nodes,
                                     random.Random(args.seed))
        except NothingToDo as error:
            print(f"error: {error}", file=sys.stderr)
            return EXIT_BAD_INPUT
        if args.dry_run:
            print(f"dry run on the cluster at {address}: would {decision.describe()}")
            return EXIT_OK
        print(f"chaos on the cluster at {address}: {decision.describe()}")
        try:
            print(ChaosExecutor(gcs).execute(decision, deadline_s=args.deadline_s))
        except Exception as error:
            print(f"error: {args.action} failed: {type(error).__name__}: {error}", file=sys.stderr)
            return EXIT_FAILED
        return EXIT_OK
    except ray_nodes.RayUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        ray.shutdown()


COMMANDS = {"validate": run_validate, "cost": run_cost, "rehearse": run_rehearse,
            "spot-watcher": run_spot_watcher, "chaos": run_chaos}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
