"""Runs on the laptop: preflight of a cluster config: Ray's schema, this project's rules, then live
AWS or Azure checks when credentials are present. Returns the report; the CLI turns it into lines and an
exit code."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from cluster.aws_checks import live_checks
from cluster.aws_facts import QuotaLookup, gather_facts, has_aws_credentials
from cluster.azure_live import azure_live_results
from cluster.azure_rules import azure_static_checks
from cluster.checks import CheckResult, Laptop, failed, passed, provider_type, skipped
from cluster.config import load_and_prepare
from cluster.prices import load_price_table
from cluster.rules import static_checks


def validate_cluster(path: str | os.PathLike, *, env: Mapping[str, str] = os.environ, live: bool = True,
                     session: Any = None, quota_lookup: QuotaLookup | None = None,
                     azure_credential: Any = None) -> list[CheckResult]:
    """All checks for one cluster file. Raises ConfigError when the file is unusable."""
    _, prepared = load_and_prepare(path)
    results = [passed("ray_schema", "Ray's launcher schema accepts the config")]
    laptop = Laptop(Path(env["HOME"]) if env.get("HOME") else Path.home(), _repo_root(Path(path)))
    gpus = load_price_table().gpus_by_instance()
    if provider_type(prepared) == "azure":
        return [*results, *azure_static_checks(prepared, gpus, laptop),
                *azure_live_results(prepared, gpus, env=env, live=live, credential=azure_credential)]
    results += static_checks(prepared, gpus, laptop)
    results += live_results(prepared, env=env, live=live, session=session, quota_lookup=quota_lookup)
    return results


def live_results(prepared: dict, *, env: Mapping[str, str], live: bool, session: Any,
                 quota_lookup: QuotaLookup | None) -> list[CheckResult]:
    if provider_type(prepared) != "aws":
        return [skipped("aws_live", f"{provider_type(prepared)} provider: no cloud checks")]
    if not live:
        return [skipped("aws_live", "live AWS checks turned off (--offline)")]
    if session is None and not has_aws_credentials(env):
        return [skipped("aws_live", "no AWS credentials (AWS_ACCESS_KEY_ID, a profile or an instance profile): "
                        "live checks skipped; the exit code reflects the static checks only")]
    try:
        facts = gather_facts(prepared, session, quota_lookup)
    except Exception as error:  # no network, access denied, bad endpoint: say so, do not crash
        return [failed("aws_live", f"live checks could not run: {type(error).__name__}: {str(error)[:200]}")]
    return live_checks(prepared, facts)


def _repo_root(config_path: Path) -> Path | None:
    for parent in config_path.resolve().parents:
        if (parent / ".git").exists():
            return parent
    return None
