"""The source of truth for the exported JSON Schemas (one per document kind and spec shape).

Each schema is built here from shared fragments, so a rule that the spec states once (the
extension-key pattern, the SemVer-with-underscore revision, the device id grammar) is
written once. `python -m margo.schemas` writes them to `margo/schemas/*.schema.json`;
a test keeps the committed files equal to this source.

The schemas follow the official OpenAPI/LinkML documents, with the corrections listed in
`docs/spec-interpretation.md` (e.g. rc.3 capabilities accept `apiVersion`/`kind`, the
manifest's bogus `required: [bundle.mediaType ...]` is read as "inside a non-null bundle",
the rc.3 deployment's undefined-but-required `metadata.annotations` is optional).
"""

from __future__ import annotations

from typing import Any

from margo.kinds import Shape

__all__ = [
    "APP_ID",
    "ARCH_OLD",
    "ARCH_RC",
    "ARCH_REQUIRED",
    "BASE_ID",
    "BUILDERS",
    "BUNDLE_MEDIA_TYPE",
    "CATALOG",
    "COMPONENT_NAME",
    "CONFIGURATION",
    "CONSTRAINT_DEFS",
    "DEPLOYMENT_PARAMETERS",
    "DESCRIPTION_PARAMETERS",
    "DEVICE_CONSTRAINTS",
    "DEVICE_ID",
    "DEVICE_ID_WILDCARD",
    "DIALECT",
    "DIGEST_SHA256",
    "ERROR",
    "EXTENSIONS",
    "EXTENSION_KEY",
    "IDENTITY",
    "IDENTITY_REQUIRED",
    "INTERFACE",
    "INTERFACES",
    "INTERFACES_OLD",
    "LABEL_VALUE",
    "LEGACY_PACKAGE",
    "MATCH_EXPRESSION",
    "NON_EMPTY",
    "PARAMETER_TARGET",
    "PARAMETER_VALUE",
    "PERIPHERAL",
    "PERIPHERALS",
    "PERIPHERALS_OLD",
    "RELATIVE_URL",
    "REQUIRED_RESOURCES",
    "ROLES",
    "SCALAR",
    "SCHEMA_RULE",
    "SELECTOR",
    "SEMVER_UNDERSCORE",
    "STATES",
    "STATES_PR1",
    "STRING_MAP",
    "TIMEOUT",
    "UUID",
    "Schema",
    "app_metadata",
    "application_deployment",
    "application_description",
    "array",
    "build",
    "closed",
    "component",
    "deployment_status",
    "device_capabilities",
    "file_name",
    "oci_properties",
    "problem_detail",
    "state_manifest",
    "string",
]

Schema = dict[str, Any]

DIALECT = "https://json-schema.org/draft/2020-12/schema"
BASE_ID = "https://margo-gitops.dev/schemas/"

EXTENSION_KEY = r"^x-[a-z][a-z0-9-]*-extensions$"
EXTENSIONS: Schema = {EXTENSION_KEY: {"type": "object"}}
APP_ID = r"^[a-z0-9-]{1,200}$"
DEVICE_ID = r"^[A-Za-z0-9._~-]+(\/[A-Za-z0-9._~-]+)*$"
DEVICE_ID_WILDCARD = r"^[A-Za-z0-9._~-]+(\/[A-Za-z0-9._~-]+)*(\/\*)?$"
UUID = r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"
COMPONENT_NAME = r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$"
SEMVER_UNDERSCORE = (
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:_([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)
TIMEOUT = r"^\d+m\d+s$"
DIGEST_SHA256 = r"^sha256:[0-9a-f]{64}$"
RELATIVE_URL = r"^/[a-zA-Z0-9\-._~:/?#\[\]@!\x24&'()*+,;=]+$"  # \x24 is '$'
BUNDLE_MEDIA_TYPE = "application/vnd.margo.bundle.v1+tar+gzip"

STATES = ["pending", "installing", "installed", "failed", "removing", "removed"]
STATES_PR1 = ["Pending", "Installing", "Installed", "Failed", "Removing", "Removed"]
ARCH_RC = ["amd64", "arm64", "arm"]
ARCH_OLD = ["amd64", "x86_64", "arm64", "arm", "riscv64", "other"]
ARCH_REQUIRED = ["amd64", "x86_64", "arm64", "arm", "riscv64", "other"]
PERIPHERALS = ["gpu", "display", "camera", "microphone", "speaker"]
PERIPHERALS_OLD = [*PERIPHERALS, "other"]
INTERFACES = ["ethernet", "wifi", "cellular", "bluetooth", "usb", "canbus", "rs232"]
INTERFACES_OLD = [*INTERFACES, "other"]
ROLES = ["Standalone Cluster", "Cluster Leader", "Cluster Worker", "Standalone Device",
         "Gateway", "Micro Device"]


def closed(properties: Schema, required: list[str] | None = None, *,
           extensions: bool = False, **extra: Any) -> Schema:
    """An object schema that rejects unknown keys (optionally allowing x-…-extensions)."""
    schema: Schema = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = required
    if extensions:
        schema["patternProperties"] = EXTENSIONS
    schema.update(extra)
    return schema


def string(**extra: Any) -> Schema:
    return {"type": "string", **extra}


def array(items: Schema, **extra: Any) -> Schema:
    return {"type": "array", "items": items, **extra}


NON_EMPTY = string(minLength=1)
SCALAR = {"type": ["string", "number", "boolean"]}

# --- deviceConstraints (rc.3) --------------------------------------------------------------

MATCH_EXPRESSION: Schema = closed(
    {
        "key": string(),
        "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt",
                              "ContainsAll", "ContainsAny"]},
        "values": array({"type": ["string", "number", "boolean"]}),
        "itemSelector": {"$ref": "#/$defs/selector"},
    },
    ["key", "operator"],
)
SELECTOR: Schema = closed({"matchExpressions": array({"$ref": "#/$defs/matchExpression"})},
                          ["matchExpressions"])
DEVICE_CONSTRAINTS: Schema = closed(
    {
        "capacityRequirements": closed({
            "cpu": closed({"cores": {"type": "number", "exclusiveMinimum": 0},
                           "architectures": array({"enum": ARCH_REQUIRED}, minItems=1)},
                          ["cores"]),
            "memory": string(),
            "storage": string(),
        }),
        "eligibilityRules": array(closed({"propertySelector": {"$ref": "#/$defs/selector"},
                                          "labelSelector": {"$ref": "#/$defs/selector"}},
                                         minProperties=1)),
    },
    extensions=True,
)
CONSTRAINT_DEFS: Schema = {
    "deviceConstraints": DEVICE_CONSTRAINTS,
    "selector": SELECTOR,
    "matchExpression": MATCH_EXPRESSION,
}

REQUIRED_RESOURCES: Schema = closed({
    "cpu": closed({"cores": {"type": "number", "exclusiveMinimum": 0},
                   "architectures": array({"enum": ARCH_REQUIRED}, minItems=1)}, ["cores"]),
    "memory": string(),
    "storage": string(),
    "peripherals": array(closed({"type": {"enum": PERIPHERALS_OLD}, "manufacturer": string(),
                                 "model": string()}, ["type"])),
    "interfaces": array(closed({"type": {"enum": INTERFACES_OLD}}, ["type"])),
})

# --- ApplicationDescription -----------------------------------------------------------------

CATALOG: Schema = closed(
    {
        "application": closed({
            "descriptionFile": string(), "icon": string(), "licenseFile": string(),
            "releaseNotes": string(), "site": string(), "tagline": string(),
            "tags": array(string()),
        }),
        "author": array(closed({"name": string(), "email": string(pattern=r".*@[a-z0-9.-]*")})),
        "organization": array(closed({"name": NON_EMPTY, "site": string()}, ["name"]),
                              minItems=1),
    },
    ["organization"],
)


def app_metadata(with_id: bool) -> Schema:
    properties: Schema = {
        "name": NON_EMPTY,
        "description": string(),
        "version": {"type": ["string", "number"]},
        "catalog": CATALOG,
    }
    required = ["name", "version", "catalog"]
    if with_id:
        properties["id"] = string(pattern=APP_ID)
        required.insert(0, "id")
    return closed(properties, required)


def oci_properties(*, typed: bool) -> Schema:
    """Unified OCI component properties; `typed=False` accepts the old string-map spelling."""
    boolean: Schema = {"type": "boolean"} if typed else {
        "anyOf": [{"type": "boolean"}, {"enum": ["true", "false"]}]}
    return closed({
        "repository": string(pattern=r"^oci://.+"),
        "revision": string(pattern=SEMVER_UNDERSCORE) if typed else {"type": ["string", "number"]},
        "wait": boolean,
        "timeout": string(pattern=TIMEOUT),
    }, ["repository", "revision"])


LEGACY_PACKAGE: Schema = closed({
    "packageLocation": string(minLength=1),
    "keyLocation": string(),
}, ["packageLocation"])


def component(properties: Schema, *, extensions: bool) -> Schema:
    return closed({"name": string(pattern=COMPONENT_NAME), "properties": properties},
                  ["name", "properties"], extensions=extensions)


PARAMETER_TARGET: Schema = closed({"pointer": NON_EMPTY,
                                   "components": array(NON_EMPTY, minItems=1)},
                                  ["pointer", "components"])
PARAMETER_VALUE: Schema = {"type": ["string", "number", "boolean", "array", "null"],
                           "items": SCALAR}
DESCRIPTION_PARAMETERS: Schema = {
    "type": "object",
    "additionalProperties": closed({"value": PARAMETER_VALUE,
                                    "targets": array(PARAMETER_TARGET, minItems=1),
                                    # specification issue #145 (docs/spec-interpretation.md)
                                    "sensitive": {"type": "boolean"}},
                                   ["targets"]),
}
SCHEMA_RULE: Schema = closed(
    {
        "name": NON_EMPTY,
        "dataType": string(),
        "allowEmpty": {"type": "boolean"},
        "minLength": {"type": "integer", "minimum": 0},
        "maxLength": {"type": "integer", "minimum": 0},
        "regexMatch": string(),
        "minValue": {"type": "number"},
        "maxValue": {"type": "number"},
        "minPrecision": {"type": "integer", "minimum": 0},
        "maxPrecision": {"type": "integer", "minimum": 0},
        "multiselect": {"type": "boolean"},
        "options": array(SCALAR, minItems=1),
        "sensitive": {"type": "boolean"},  # specification issue #145
    },
    ["name", "dataType"],
)
CONFIGURATION: Schema = closed(
    {
        "sections": array(closed({
            "name": NON_EMPTY,
            "settings": array(closed({
                "parameter": NON_EMPTY, "name": NON_EMPTY, "description": string(),
                "immutable": {"type": "boolean"}, "schema": NON_EMPTY,
            }, ["parameter", "name", "schema"])),
        }, ["name", "settings"])),
        "schema": array(SCHEMA_RULE),
    },
    ["sections", "schema"],
)


def application_description(shape: str) -> Schema:
    """ApplicationDescription (`margo.yaml`) in the given spec shape."""
    if shape == Shape.OCT_2024:
        profile_types = ["helm.v3", "docker-compose"]
        props: Schema = {"anyOf": [oci_properties(typed=False), LEGACY_PACKAGE]}
        extensions = False
    elif shape == Shape.RC2:
        profile_types = ["helm.v3", "helm", "compose"]
        props = {"anyOf": [oci_properties(typed=True), LEGACY_PACKAGE]}
        extensions = True
    else:
        profile_types = ["helm", "compose", "custom"]
        props = oci_properties(typed=True)
        extensions = True
    profile_properties: Schema = {
        "type": {"enum": profile_types},
        "id": NON_EMPTY,
        "description": string(),
        "components": array(component(props, extensions=extensions), minItems=1),
        "requiredResources": REQUIRED_RESOURCES,
    }
    if shape == Shape.RC3:
        profile_properties["deviceConstraints"] = {"$ref": "#/$defs/deviceConstraints"}
    profile = closed(profile_properties, ["type", "id", "components"], extensions=extensions)
    top: Schema = {
        "apiVersion": NON_EMPTY,
        "kind": {"const": "application" if shape == Shape.OCT_2024 else "ApplicationDescription"},
        "metadata": app_metadata(with_id=shape != Shape.RC3),
        "deploymentProfiles": array(profile, minItems=1),
        "parameters": DESCRIPTION_PARAMETERS,
        "configuration": CONFIGURATION,
    }
    required = ["apiVersion", "kind", "metadata", "deploymentProfiles"]
    if shape == Shape.RC3:
        top["id"] = string(pattern=APP_ID)
        required.insert(0, "id")
    schema = closed(top, required, extensions=extensions)
    if shape == Shape.RC3:
        schema["$defs"] = CONSTRAINT_DEFS
    return schema


# --- ApplicationDeployment ------------------------------------------------------------------

DEPLOYMENT_PARAMETERS: Schema = {
    "type": "object",
    "additionalProperties": closed({"value": PARAMETER_VALUE,
                                    "targets": array(PARAMETER_TARGET, minItems=1)},
                                   ["value", "targets"]),
}
STRING_MAP: Schema = {"type": "object", "additionalProperties": string()}


def application_deployment(shape: str) -> Schema:
    """ApplicationDeployment (desired state YAML) in the given spec shape."""
    annotations: Schema = {"type": "object", "properties": {
        "id": string(pattern=UUID), "applicationId": string(pattern=APP_ID)},
        "additionalProperties": string()}
    metadata_properties: Schema = {
        "name": NON_EMPTY,
        "namespace": NON_EMPTY,
        "labels": STRING_MAP,
        "annotations": annotations,
    }
    metadata_required = ["name", "namespace"]
    if shape == Shape.OCT_2024:
        types = ["helm.v3", "helm", "compose", "docker-compose"]
        props: Schema = {"anyOf": [oci_properties(typed=False), LEGACY_PACKAGE]}
        annotations = {**annotations, "required": ["id", "applicationId"]}
        metadata_properties["annotations"] = annotations
        metadata_required.append("annotations")
    elif shape == Shape.RC2:
        types = ["helm.v3", "helm", "compose"]
        props = {"anyOf": [oci_properties(typed=False), LEGACY_PACKAGE]}
        metadata_properties["deviceId"] = string(pattern=DEVICE_ID_WILDCARD)
    else:
        types = ["helm", "compose", "custom"]
        props = oci_properties(typed=True)
        metadata_properties["deviceId"] = string(pattern=DEVICE_ID_WILDCARD)
        metadata_required.append("deviceId")
    profile_properties: Schema = {
        "type": {"enum": types},
        "components": array(component(props, extensions=shape != Shape.OCT_2024), minItems=1),
    }
    if shape != Shape.OCT_2024:
        profile_properties["deviceConstraints"] = {"$ref": "#/$defs/deviceConstraints"}
    spec_properties: Schema = {
        "deploymentProfile": closed(profile_properties, ["type", "components"],
                                    extensions=shape != Shape.OCT_2024),
        "parameters": DEPLOYMENT_PARAMETERS,
    }
    spec_required = ["deploymentProfile"]
    if shape != Shape.OCT_2024:
        spec_properties["applicationId"] = string(pattern=APP_ID)
    if shape == Shape.RC3:
        spec_required.insert(0, "applicationId")
    top: Schema = {
        "apiVersion": NON_EMPTY,
        "kind": {"const": "ApplicationDeployment"},
        "metadata": closed(metadata_properties, metadata_required),
        "spec": closed(spec_properties, spec_required, extensions=shape != Shape.OCT_2024),
    }
    required = ["metadata", "spec"]
    if shape in (Shape.OCT_2024, Shape.RC2):
        required = ["apiVersion", "kind", *required]
    if shape != Shape.OCT_2024:
        top["id"] = string(pattern=UUID)
        required.insert(0, "id")
    schema = closed(top, required)
    if shape != Shape.OCT_2024:
        schema["$defs"] = CONSTRAINT_DEFS
    return schema


# --- DeviceCapabilitiesManifest -------------------------------------------------------------

PERIPHERAL: Schema = closed({"type": {"enum": PERIPHERALS}, "manufacturer": string(),
                             "model": string()}, ["type"])
INTERFACE: Schema = closed({"type": {"enum": INTERFACES}}, ["type"])
LABEL_VALUE: Schema = {"anyOf": [  # the branches exclude each other: anyOf stops earlier
    string(), {"type": "number"}, {"type": "boolean"},
    array(string()), array({"type": "number"}),
]}
IDENTITY: Schema = {"id": string(pattern=DEVICE_ID), "vendor": string(),
                    "modelNumber": string(), "serialNumber": string()}
IDENTITY_REQUIRED = ["id", "vendor", "modelNumber", "serialNumber"]


def device_capabilities(shape: str) -> Schema:
    """DeviceCapabilitiesManifest in the given spec shape."""
    if shape == Shape.OCT_2024:
        resources = closed({
            "cpu": closed({"cores": {"type": "number", "exclusiveMinimum": 0},
                           "architectures": array({"enum": ARCH_OLD}, minItems=1)}, ["cores"]),
            "memory": string(),
            "storage": string(),
            "peripherals": array(closed({"type": {"enum": PERIPHERALS_OLD},
                                         "manufacturer": string(), "model": string()},
                                        ["type"])),
            "interfaces": array(closed({"type": {"enum": INTERFACES_OLD}}, ["type"])),
        })
        properties = closed({**IDENTITY, "roles": array({"enum": ROLES}, minItems=1),
                             "resources": resources}, [*IDENTITY_REQUIRED, "roles"])
        return closed({"apiVersion": NON_EMPTY, "kind": {"const": "DeviceCapabilitiesManifest"},
                       "properties": properties},
                      ["apiVersion", "kind", "properties"], extensions=True)
    runtimes = ["oci"] if shape == Shape.RC2 else ["oci", "custom"]
    deployment_types = ["helm", "compose"] if shape == Shape.RC2 else ["helm", "compose", "custom"]
    properties = closed({
        **IDENTITY,
        "cpus": array(closed({"cores": {"type": "number", "exclusiveMinimum": 0},
                              "architecture": {"enum": ARCH_RC}}, ["cores"])),
        "memory": string(),
        "storage": string(),
        "peripherals": array(PERIPHERAL),
        "interfaces": array(INTERFACE),
        "otelCollector": {"type": "boolean"},
        "supportedRuntimes": array({"enum": runtimes}, minItems=1),
        "supportedDeploymentTypes": array({"enum": deployment_types}, minItems=1),
    }, IDENTITY_REQUIRED)
    top: Schema = {"apiVersion": NON_EMPTY, "kind": {"const": "DeviceCapabilitiesManifest"},
                   "properties": properties}
    required = ["properties"]
    if shape == Shape.RC2:
        required = ["apiVersion", "kind", "properties"]
    else:
        top["labels"] = {"type": "object", "additionalProperties": LABEL_VALUE}
    return closed(top, required, extensions=True)


# --- DeploymentStatusManifest ---------------------------------------------------------------

ERROR: Schema = closed({"code": {"type": ["string", "integer"]}, "source": string(),
                        "message": string()})


def deployment_status(shape: str) -> Schema:
    """DeploymentStatusManifest in the given spec shape."""
    states = STATES_PR1 if shape == Shape.OCT_2024 else STATES
    state = closed({"state": {"enum": states}, "error": ERROR}, ["state"])
    top: Schema = {
        "apiVersion": NON_EMPTY,
        "kind": {"const": "DeploymentStatusManifest"},
        "deploymentId": NON_EMPTY,
        "deviceId": string(pattern=DEVICE_ID),
        "status": state,
        "components": array(closed({"name": NON_EMPTY, "state": {"enum": states},
                                    "error": ERROR}, ["name", "state"])),
    }
    required = ["deploymentId", "status", "components"]
    if shape == Shape.RC2:
        required = ["apiVersion", "kind", *required]
    if shape == Shape.RC3:
        top["adoptedManifestVersion"] = {"type": "integer", "minimum": 1,
                                         "maximum": 18446744073709551615}
        required.insert(1, "adoptedManifestVersion")
    return closed(top, required, extensions=True)


# --- UnsignedAppStateManifest and ProblemDetail ---------------------------------------------

def state_manifest() -> Schema:
    """UnsignedAppStateManifest (the REST desired-state manifest), rc.2 and rc.3 alike."""
    size = {"type": "integer", "minimum": 0, "maximum": 18446744073709551615}
    bundle = closed({"mediaType": {"const": BUNDLE_MEDIA_TYPE},
                     "digest": string(pattern=r"^[a-z0-9_-]+:[0-9a-f]+$"),
                     "url": string(pattern=RELATIVE_URL), "sizeBytes": size},
                    ["mediaType", "digest", "url"])
    return closed({
        "manifestVersion": {"type": "integer", "minimum": 1, "maximum": 18446744073709551615},
        "bundle": {"anyOf": [{"type": "null"}, bundle]},
        "deployments": array(closed({"deploymentId": NON_EMPTY,
                                     "digest": string(pattern=r"^[a-z0-9_-]+:[0-9a-f]+$"),
                                     "url": string(pattern=RELATIVE_URL), "sizeBytes": size},
                                    ["deploymentId", "digest", "url"])),
    }, ["manifestVersion", "bundle", "deployments"])


def problem_detail() -> Schema:
    """RFC 9457 problem details with the Margo extension members."""
    return {
        "type": "object",
        "required": ["type", "title", "status"],
        "properties": {
            "type": string(format="uri-reference"),
            "title": string(),
            "status": {"type": "integer", "minimum": 100, "maximum": 599},
            "detail": string(),
            "instance": string(format="uri-reference"),
            "retryable": {"type": "boolean"},
            "retryAfterSeconds": {"type": "integer", "minimum": 0},
            "backoffStrategy": {"enum": ["none", "fixed", "exponential"]},
            "errors": array({"type": "object", "properties": {"field": string(),
                                                              "message": string()}}),
        },
        "additionalProperties": True,
    }


#: (kind, shape) -> schema builder. Shapes are listed oldest first.
BUILDERS: dict[tuple[str, str], Any] = {
    **{("ApplicationDescription", s): (lambda s=s: application_description(s))
       for s in (Shape.OCT_2024.value, Shape.RC2.value, Shape.RC3.value)},
    **{("ApplicationDeployment", s): (lambda s=s: application_deployment(s))
       for s in (Shape.OCT_2024.value, Shape.RC2.value, Shape.RC3.value)},
    **{("DeviceCapabilitiesManifest", s): (lambda s=s: device_capabilities(s))
       for s in (Shape.OCT_2024.value, Shape.RC2.value, Shape.RC3.value)},
    **{("DeploymentStatusManifest", s): (lambda s=s: deployment_status(s))
       for s in (Shape.OCT_2024.value, Shape.RC2.value, Shape.RC3.value)},
    ("UnsignedAppStateManifest", Shape.RC3.value): state_manifest,
    ("ProblemDetail", Shape.RC3.value): problem_detail,
}


def file_name(kind: str, shape: str) -> str:
    return f"{kind}.{shape}.schema.json"


def build(kind: str, shape: str) -> Schema:
    """The complete schema document, with `$schema`, `$id` and a title."""
    body = BUILDERS[(kind, shape)]()
    return {"$schema": DIALECT, "$id": BASE_ID + file_name(kind, shape),
            "title": f"Margo {kind} ({shape} shape)", **body}
