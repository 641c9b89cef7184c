"""Benchmark: documents validated per second and microseconds per constraint match.

    .venv/bin/python bench/validate.py [--documents N] [--devices N]

Prints (1) full validations per second of a 20-component rc.3 ApplicationDescription
(load + detect + JSON Schema + semantic checks + normalise), (2) microseconds per
deviceConstraints evaluation over 10,000 varied capability documents, and (3) the cost of
validating and normalising one capability document (what `margo match --batch` pays per
line on top of the match).
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from margo.canonical import canonical_yaml
from margo.constraints import compile_constraints
from margo.kinds import Kind
from margo.validation import validate_document, validate_value


def description(components: int = 20) -> dict[str, Any]:
    names = [f"component-{i:02d}" for i in range(components)]
    return {
        "apiVersion": "margo.org/v1-alpha1",
        "kind": "ApplicationDescription",
        "id": "com-example-big-app",
        "metadata": {"name": "Big app", "version": "2.1.0",
                     "catalog": {"organization": [{"name": "Example"}]}},
        "deploymentProfiles": [{
            "type": "helm", "id": "big-helm",
            "components": [{"name": n, "properties": {
                "repository": f"oci://registry.example.com/charts/{n}",
                "revision": f"1.{i}.0", "wait": True, "timeout": "5m0s"}}
                for i, n in enumerate(names)],
            "deviceConstraints": {
                "capacityRequirements": {"cpu": {"cores": 2, "architectures": ["amd64"]},
                                         "memory": "4Gi", "storage": "20Gi"},
                "eligibilityRules": [{"propertySelector": {"matchExpressions": [
                    {"key": "/peripherals", "operator": "ContainsAll", "itemSelector": {
                        "matchExpressions": [{"key": "/type", "operator": "In", "values": ["gpu"]},
                                             {"key": "/manufacturer", "operator": "In",
                                              "values": ["NVIDIA"]}]}}]},
                    "labelSelector": {"matchExpressions": [
                        {"key": "example.com/zone", "operator": "In", "values": ["a", "b"]}]}}],
            },
        }],
        "parameters": {f"p{i}": {"value": i * 10 + 30, "targets": [
            {"pointer": f"settings.group{i}.value", "components": [names[i]]}]}
            for i in range(components)},
        "configuration": {
            "sections": [{"name": "All", "settings": [
                {"parameter": f"p{i}", "name": f"P{i}", "schema": "range"}
                for i in range(components)]}],
            "schema": [{"name": "range", "dataType": "integer", "minValue": 0,
                        "maxValue": 10_000, "allowEmpty": False}],
        },
    }


def capabilities(rng: random.Random, index: int) -> dict[str, Any]:
    gpu = rng.random() < 0.3
    return {
        "properties": {
            "id": f"device-{index:05d}", "vendor": "Example", "modelNumber": "M1",
            "serialNumber": f"S{index}",
            "cpus": [{"cores": rng.choice([1, 2, 4, 8]), "architecture": rng.choice(
                ["amd64", "arm64"])} for _ in range(rng.randint(1, 3))],
            "memory": f"{rng.choice([2, 4, 8, 16])} Gi", "storage": f"{rng.choice([16, 64])}Gi",
            "peripherals": [{"type": "gpu", "manufacturer": "NVIDIA"}] if gpu else [],
            "interfaces": [{"type": "ethernet"}], "otelCollector": True,
            "supportedRuntimes": ["oci"], "supportedDeploymentTypes": ["helm"],
        },
        "labels": {"example.com/zone": rng.choice(["a", "b", "c"])},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=300)
    parser.add_argument("--devices", type=int, default=10_000)
    args = parser.parse_args()

    text = canonical_yaml(description())
    report = validate_document(text)
    assert report.valid, [p.format() for p in report.problems]
    start = time.perf_counter()
    for _ in range(args.documents):
        validate_document(text)
    elapsed = time.perf_counter() - start
    print(f"validate: {args.documents / elapsed:,.0f} documents/s "
          f"(20-component ApplicationDescription, {len(text):,} bytes, "
          f"{elapsed / args.documents * 1000:.2f} ms each)")

    rng = random.Random(7)
    raw = [capabilities(rng, i) for i in range(args.devices)]
    start = time.perf_counter()
    models = [validate_value(c, expect=Kind.DEVICE_CAPABILITIES) for c in raw]
    elapsed = time.perf_counter() - start
    print(f"capabilities: {elapsed / len(raw) * 1e6:,.0f} µs to validate and normalise one "
          f"document ({len(raw):,} documents)")

    profile = description()["deploymentProfiles"][0]
    constraints = compile_constraints(profile["deviceConstraints"])
    start = time.perf_counter()
    eligible = sum(constraints.evaluate(m.properties, m.labels).eligible for m in models)
    elapsed = time.perf_counter() - start
    print(f"match: {elapsed / len(models) * 1e6:.1f} µs per constraint match over "
          f"{len(models):,} capability documents ({eligible:,} eligible)")


if __name__ == "__main__":
    main()
