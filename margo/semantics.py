"""Rules a JSON Schema cannot express: cross-references, uniqueness, well-formed rules.

Run only on schema-valid documents (so the structure can be trusted). Each function
returns every problem it finds with a JSON path; `margo.validation` adds file positions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from margo.component_values import compose_variable_name, parse_helm_pointer
from margo.constraints import compile_constraints
from margo.digests import DigestError, parse_digest
from margo.errors import DocumentError, Path, Problem
from margo.kinds import Kind, Shape
from margo.normalize import PROFILE_TYPES
from margo.parameters import check_schema_rule, validate_value
from margo.quantity import parse_quantity
from margo.revisions import revision_problem

__all__ = ["semantic_problems"]

Doc = dict[str, Any]


def _duplicates(items: Iterable[tuple[Path, Any]], what: str) -> list[Problem]:
    seen: dict[Any, Path] = {}
    problems = []
    for path, value in items:
        if value in seen:
            problems.append(Problem(path, f"duplicate {what} {value!r} (first at "
                                          f"{'/'.join(map(str, seen[value]))})",
                                    expected=f"a unique {what}", found=repr(value)))
        else:
            seen[value] = path
    return problems


def _constraint_problems(profile: Doc, path: Path) -> list[Problem]:
    if "deviceConstraints" not in profile and "requiredResources" not in profile:
        return []
    try:
        compile_constraints(profile.get("deviceConstraints"),
                            required_resources=profile.get("requiredResources"), path=path)
    except DocumentError as exc:
        return exc.problems
    return []


def _component_problems(profile: Doc, path: Path, shape: Shape) -> list[Problem]:
    problems = _duplicates((((*path, "components", i, "name"), c["name"])
                            for i, c in enumerate(profile["components"])), "component name")
    kind = PROFILE_TYPES[profile["type"]]
    for index, component in enumerate(profile["components"]):
        props = component["properties"]
        where = (*path, "components", index, "properties")
        if "repository" not in props and kind != "compose":
            problems.append(Problem(where, f"a {profile['type']} component needs repository and "
                                           "revision (packageLocation is the old Compose form)",
                                    expected="repository, revision", found="packageLocation"))
        if "revision" in props:
            reason = revision_problem(str(props["revision"]))
            if reason and not (shape is Shape.OCT_2024 and "+" in str(props["revision"])):
                problems.append(Problem((*where, "revision"), reason,
                                        expected="SemVer 2.0", found=repr(props["revision"])))
    return problems


def _pointer_problem(pointer: str, profile_type: str, path: Path) -> Problem | None:
    try:
        if PROFILE_TYPES.get(profile_type) == "compose":
            compose_variable_name(pointer)
        else:
            parse_helm_pointer(pointer)
    except ValueError as exc:
        return Problem(path, f"invalid {profile_type} parameter pointer: {exc}",
                       found=repr(pointer))
    return None


def _parameter_target_problems(parameters: Doc, profiles: list[Doc], base: Path) -> list[Problem]:
    """Targets must name existing components; pointers must suit the component's type."""
    component_types = {c["name"]: p["type"] for p in profiles for c in p["components"]}
    problems = []
    for name, parameter in parameters.items():
        for t_index, target in enumerate(parameter["targets"]):
            where = (*base, name, "targets", t_index)
            for c_index, component in enumerate(target["components"]):
                if component not in component_types:
                    problems.append(Problem((*where, "components", c_index),
                                            f"parameter {name!r} targets unknown component "
                                            f"{component!r}",
                                            expected="one of " + ", ".join(sorted(component_types)),
                                            found=repr(component)))
                    continue
                problem = _pointer_problem(target["pointer"], component_types[component],
                                           (*where, "pointer"))
                if problem:
                    problems.append(problem)
    return problems


def _configuration_problems(doc: Doc) -> list[Problem]:
    configuration = doc.get("configuration")
    if not configuration:
        return []
    parameters = doc.get("parameters") or {}
    base: Path = ("configuration",)
    rules = {s["name"]: s for s in configuration["schema"]}
    problems = _duplicates((((*base, "schema", i, "name"), s["name"])
                            for i, s in enumerate(configuration["schema"])), "schema name")
    for index, rule in enumerate(configuration["schema"]):
        problems.extend(check_schema_rule(rule, path=(*base, "schema", index)))
    settings = [(s_index, x_index, setting)
                for s_index, section in enumerate(configuration["sections"])
                for x_index, setting in enumerate(section["settings"])]
    problems += _duplicates((((*base, "sections", s, "settings", x, "parameter"), st["parameter"])
                             for s, x, st in settings), "setting for parameter")
    for s_index, x_index, setting in settings:
        where = (*base, "sections", s_index, "settings", x_index)
        parameter = setting["parameter"]
        if parameter not in parameters:
            problems.append(Problem((*where, "parameter"), f"setting refers to unknown parameter "
                                    f"{parameter!r}", expected="a name under parameters",
                                    found=repr(parameter)))
        rule = rules.get(setting["schema"])
        if rule is None:
            problems.append(Problem((*where, "schema"), f"setting refers to unknown schema "
                                    f"{setting['schema']!r}", expected="a configuration.schema "
                                    "name", found=repr(setting["schema"])))
        elif parameter in parameters and "value" in parameters[parameter] and not check_schema_rule(
                rule):
            problems.extend(validate_value(parameters[parameter]["value"], rule,
                                           path=("parameters", parameter, "value")))
    return problems


def _description(doc: Doc, shape: Shape) -> list[Problem]:
    profiles = doc["deploymentProfiles"]
    problems = _duplicates(((("deploymentProfiles", i, "id"), p["id"])
                            for i, p in enumerate(profiles)), "deployment profile id")
    for index, profile in enumerate(profiles):
        path: Path = ("deploymentProfiles", index)
        problems += _component_problems(profile, path, shape)
        section = "deviceConstraints" if "deviceConstraints" in profile else "requiredResources"
        problems += _constraint_problems(profile, (*path, section))
    problems += _parameter_target_problems(doc.get("parameters") or {}, profiles, ("parameters",))
    problems += _configuration_problems(doc)
    problems += _sensitive_problems(doc)
    return problems


def _sensitive_problems(doc: Doc) -> list[Problem]:
    """Specification issue #145: a sensitive parameter has no default (its `value` must be
    empty); a setting whose schema entry is sensitive makes its parameter sensitive too."""
    parameters = doc.get("parameters") or {}
    configuration = doc.get("configuration") or {}
    sensitive_rules = {rule["name"] for rule in configuration.get("schema", ())
                       if rule.get("sensitive") is True}
    sensitive = {name for name, body in parameters.items() if body.get("sensitive") is True}
    sensitive |= {setting["parameter"] for section in configuration.get("sections", ())
                  for setting in section["settings"] if setting["schema"] in sensitive_rules}
    return [Problem(("parameters", name, "value"), "a sensitive parameter has no default "
                    "value: intents supply it as a secret (docs/secrets.md)",
                    expected="no value, or an empty one", found="a value")
            for name in sorted(sensitive)
            if name in parameters and parameters[name].get("value") not in (None, "", [])]


def _deployment(doc: Doc, shape: Shape) -> list[Problem]:
    spec = doc["spec"]
    profile = spec["deploymentProfile"]
    path: Path = ("spec", "deploymentProfile")
    problems = _component_problems(profile, path, shape)
    if "deviceConstraints" in profile:
        problems += _constraint_problems(profile, (*path, "deviceConstraints"))
    problems += _parameter_target_problems(spec.get("parameters") or {}, [profile],
                                           ("spec", "parameters"))
    metadata = doc["metadata"]
    annotations = metadata.get("annotations") or {}
    if "applicationId" in spec and "applicationId" in annotations and (
            spec["applicationId"] != annotations["applicationId"]):
        problems.append(Problem(("metadata", "annotations", "applicationId"),
                                "disagrees with spec.applicationId",
                                expected=repr(spec["applicationId"]),
                                found=repr(annotations["applicationId"])))
    if "id" in doc and "id" in annotations and doc["id"] != annotations["id"]:
        problems.append(Problem(("metadata", "annotations", "id"), "disagrees with the top-level "
                                "id", expected=repr(doc["id"]), found=repr(annotations["id"])))
    return problems


def _capabilities(doc: Doc, shape: Shape) -> list[Problem]:
    properties = doc["properties"]
    source = properties.get("resources", {}) if shape is Shape.OCT_2024 else properties
    base: Path = ("properties", "resources") if shape is Shape.OCT_2024 else ("properties",)
    problems = []
    for key in ("memory", "storage"):
        if key in source:
            try:
                parse_quantity(source[key])
            except ValueError as exc:
                problems.append(Problem((*base, key), f"not a quantity: {exc}",
                                        expected="a quantity such as 59Gi or '59 Gi'",
                                        found=repr(source[key])))
    for key in doc.get("labels") or {}:
        if not key:
            problems.append(Problem(("labels",), "label keys must not be empty", found="''"))
    return problems


def _status(doc: Doc, shape: Shape) -> list[Problem]:
    return _duplicates(((("components", i, "name"), c["name"])
                        for i, c in enumerate(doc["components"])), "component name")


def _manifest(doc: Doc, shape: Shape) -> list[Problem]:
    problems: list[Problem] = []
    deployments = doc["deployments"]
    bundle = doc["bundle"]
    if bundle is None and deployments:
        problems.append(Problem(("bundle",), "bundle must describe the deployments' archive "
                                "when there are deployments", expected="an object", found="null"))
    if bundle is not None and not deployments:
        problems.append(Problem(("bundle",), "bundle must be null when there are no deployments "
                                "(an empty archive must not be served)", expected="null",
                                found="an object"))
    problems += _duplicates(((("deployments", i, "deploymentId"), d["deploymentId"])
                             for i, d in enumerate(deployments)), "deploymentId")
    refs: list[tuple[Path, Any, str]] = (
        [(("bundle",), bundle, "/bundles/{digest}")] if bundle else [])
    refs += [(("deployments", i), d, f"/deployments/{d['deploymentId']}/{{digest}}")
             for i, d in enumerate(deployments)]
    for path, ref, suffix in refs:
        try:
            parse_digest(ref["digest"])
        except DigestError as exc:
            problems.append(Problem((*path, "digest"), str(exc), found=repr(ref["digest"])))
            continue
        expected_suffix = suffix.format(digest=ref["digest"])
        url = ref["url"]
        if not (url == "/api/v1" + expected_suffix or (
                url.startswith("/api/v1/clients/") and url.endswith(expected_suffix)
                and url.count("/") == 4 + expected_suffix.count("/"))):
            problems.append(Problem((*path, "url"), "url must be the content address of the "
                                    "digest", expected="/api/v1" + expected_suffix,
                                    found=repr(url)))
    return problems


_CHECKS: dict[Kind, Callable[[Doc, Shape], list[Problem]]] = {
    Kind.APPLICATION_DESCRIPTION: _description,
    Kind.APPLICATION_DEPLOYMENT: _deployment,
    Kind.DEVICE_CAPABILITIES: _capabilities,
    Kind.DEPLOYMENT_STATUS: _status,
    Kind.STATE_MANIFEST: _manifest,
}


def semantic_problems(kind: Kind, shape: Shape, doc: Doc) -> list[Problem]:
    """Every semantic problem of a schema-valid document."""
    check = _CHECKS.get(kind)
    return check(doc, shape) if check else []
