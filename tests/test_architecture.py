"""The shape of the code holds as it grows: imports run down the layers (the import-linter contract in
pyproject.toml), every package says what it holds and may import, and every metric is declared once, documented, and
the only kind the alert rules and the dashboard use."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

from trainguard.core.model import Metric
from trainguard.reference import declared_metrics, metrics_markdown
from trainguard.registry import DEFAULT_REGISTRY

from .conftest import REPO

PACKAGES = sorted(p.parent for p in (REPO / "trainguard").glob("*/__init__.py"))


def test_imports_run_down_the_layers() -> None:
    """Zero imports that run back up, zero package cycles: `lint-imports` checks the contracts in pyproject.toml."""
    lint = Path(sys.executable).parent / "lint-imports"
    proc = subprocess.run([str(lint), "--config", str(REPO / "pyproject.toml"), "--no-cache"], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout and "2 kept" in proc.stdout


def test_the_layers_contract_names_every_package() -> None:
    text = (REPO / "pyproject.toml").read_text()
    layers = text[text.index("layers = ["):text.index("]", text.index("layers = ["))]
    for package in PACKAGES:
        assert f'"trainguard.{package.name}' in layers or f"| trainguard.{package.name}" in layers, \
            f"trainguard.{package.name} is in no layer of the import contract"


def test_every_package_says_what_it_holds_and_may_import() -> None:
    for package in PACKAGES:
        doc = importlib.import_module(f"trainguard.{package.name}").__doc__ or ""
        assert len(doc.split()) > 10 and "May import:" in doc, f"trainguard/{package.name}/__init__.py docstring"


def test_every_module_level_metric_of_a_check_is_declared_by_the_check() -> None:
    for kind in DEFAULT_REGISTRY.checks:
        cls = DEFAULT_REGISTRY.check_class(kind)
        module = sys.modules[cls.__module__]
        defined = {v for v in vars(module).values() if isinstance(v, Metric)}
        assert defined <= set(cls.metrics), f"check {kind}: metrics defined but not in {cls.__name__}.metrics"


def test_metric_names_are_unique_and_the_reference_is_current() -> None:
    names = [m.name for metrics in declared_metrics().values() for m in metrics]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert (REPO / "docs" / "metrics.md").read_text() == metrics_markdown(), \
        "docs/metrics.md is stale: trainguard metrics-reference > docs/metrics.md"


def _used_names(text: str) -> set[str]:
    """The agent's metric names in a query; a recording rule's (`trainguard_job:collective_wait_ratio:median`) are the
    rules' own."""
    return set(re.findall(r"\btrainguard_[a-z0-9_]+\b(?![:a-z0-9_])", text)) - {"trainguard_"}


def test_alert_rules_and_dashboard_use_only_declared_metrics() -> None:
    declared = {m.name for metrics in declared_metrics().values() for m in metrics}
    rules = yaml.safe_load((REPO / "deploy" / "prometheus" / "trainguard-rules.yml").read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    dash = json.loads((REPO / "deploy" / "grafana" / "trainguard.json").read_text())
    exprs += [t["expr"] for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    used = set().union(*(_used_names(e) for e in exprs))
    assert used, "no metric found in the rules and the dashboard"
    assert used - declared == set(), f"used but not exported: {sorted(used - declared)}"


def test_a_sample_carries_exactly_its_declared_labels() -> None:
    free = Metric("trainguard_test_free_bytes", "A test metric.", ("path",))
    assert free(3, {"path": "/"}).labels == {"path": "/"}
    for wrong in ({}, {"path": "/", "device": "sda"}, {"mount": "/"}):
        try:
            free(1, wrong)
        except ValueError as exc:
            assert "trainguard_test_free_bytes" in str(exc)
        else:
            raise AssertionError(f"labels {wrong} accepted")
    for bad in (("other_free_bytes", False), ("trainguard_runs", True), ("trainguard_runs_total", False)):
        try:
            Metric(bad[0], "x", counter=bad[1])
        except ValueError:
            continue
        raise AssertionError(f"metric name {bad} accepted")
