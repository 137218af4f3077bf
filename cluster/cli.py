"""python -m cluster {validate,cost,rehearse}: parse, call the library, print, map to exit codes
(0 ok, warnings allowed; 1 a check failed; 2 bad input)."""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

from cluster.checks import Status, any_failed, provider_type
from cluster.config import DEFAULT_CLUSTER_FILE, ConfigError, load_and_prepare

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cluster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    validate = sub.add_parser("validate", help="preflight checks before `ray up`")
    validate.add_argument("config", nargs="?", default=DEFAULT_CLUSTER_FILE)
    validate.add_argument("--offline", action="store_true", help="skip live AWS checks even with credentials")
    cost = sub.add_parser("cost", help="$/hour per node type and the cost and energy of a run")
    cost.add_argument("config", nargs="?", default=DEFAULT_CLUSTER_FILE)
    cost.add_argument("--hours", type=float, default=1.0, help="run duration (default 1)")
    cost.add_argument("--workers", type=int, default=None,
                      help="GPU worker nodes (default: the preferred type's max_workers)")
    cost.add_argument("--offline", action="store_true", help="use the table's spot prices even with credentials")
    rehearse = sub.add_parser("rehearse", help="rehearse autoscaling locally with fake GPU nodes")
    rehearse.add_argument("config", nargs="?", default=DEFAULT_CLUSTER_FILE)
    rehearse.add_argument("--gpu-workers", type=int, default=2, help="GPU workers the rehearsal job needs")
    rehearse.add_argument("--idle-timeout-s", type=float, default=10.0,
                          help="idle time before a fake node is released")
    return parser


def run_validate(args: argparse.Namespace) -> int:
    from cluster.validate import validate_cluster

    results = validate_cluster(args.config, live=not args.offline)
    for result in results:
        print(result.line())
    counts = Counter(result.status for result in results)
    print(f"{args.config}: {counts[Status.PASS]} passed, {counts[Status.WARN]} warnings, "
          f"{counts[Status.FAIL]} failed, {counts[Status.SKIP]} skipped")
    return EXIT_FAILED if any_failed(results) else EXIT_OK


def run_cost(args: argparse.Namespace) -> int:
    from cluster.aws_facts import has_aws_credentials
    from cluster.cost import estimate_run, node_costs, refresh_spot_prices
    from cluster.prices import load_price_table

    if args.hours < 0 or (args.workers is not None and args.workers < 0):
        raise ConfigError("--hours and --workers must be >= 0")
    _, config = load_and_prepare(args.config)
    if provider_type(config) != "aws":
        print(f"{provider_type(config)} provider: machines you own; no hourly prices to show")
        return EXIT_OK
    table = load_price_table()
    source = f"cluster/prices.json as of {table.as_of}"
    spot = {}
    if not args.offline and has_aws_credentials(os.environ):
        try:
            spot = refresh_spot_prices(config)
            source += f"; spot from AWS spot price history ({config['provider']['region']}, now)"
        except Exception as error:  # no network, access denied: the table still answers
            source += f"; spot refresh failed ({type(error).__name__}), table prices used"
    print(f"prices: {source}")
    costs, unknown = node_costs(config, table, spot)
    print(f"{'node type':16} {'instance':14} {'market':9} {'GPUs':10} {'on-demand $/h':>13} "
          f"{'spot $/h':>9} {'pays $/h':>9} {'max':>4}")
    for cost in costs:
        gpus = f"{cost.gpus}x{cost.gpu_model}" if cost.gpus else "0"
        print(f"{cost.node_type:16} {cost.instance_type:14} {'spot' if cost.spot else 'on-demand':9} {gpus:10} "
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
    from cluster.rehearse import rehearse

    return EXIT_OK if rehearse(args.config, gpu_workers=args.gpu_workers,
                               idle_timeout_s=args.idle_timeout_s) else EXIT_FAILED


COMMANDS = {"validate": run_validate, "cost": run_cost, "rehearse": run_rehearse}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
