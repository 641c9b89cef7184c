"""Sealing a rendering's secret values to its device (docs/secrets.md).

`compiler.render` decrypts an intent's secrets with the fleet key (`compiler.secrets`) and
checks them like any value; the document template then leaves each secret parameter's
value open, and this module fills it with an envelope sealed to the device's own key
(`margo.sealing`). The plaintext exists only in this process's memory.

Determinism: age encryption is randomised, so sealing again on every compile would give
every device new bytes (and a new deployment) for nothing. `seal_for` keeps the envelope of
the device's current document when it was sealed to the same device key and its mac (a
keyed digest of device, parameter and plaintext) is the one the plaintext gives now; it
seals anew only when the plaintext, the device key or the fleet key changed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from compiler.secrets import FleetKey
from margo.errors import Problem
from margo.sealing import (
    EXTENSION,
    SealError,
    device_recipient,
    is_sealed,
    parse_sealed,
    recipient_fingerprint,
    seal,
)

__all__ = ["GRANTS", "SLOT_PREFIX", "SealItem", "compare_previous", "grant_item",
           "no_key_problem", "parameter_item", "previous_envelopes", "redacted", "seal_for"]

#: `YamlTemplate` slots of sealed values are named `sealed/<what>`.
SLOT_PREFIX = "sealed/"
#: Where a deployment document's spec holds the registry credentials granted to its device.
GRANTS = (EXTENSION, "registryCredentials")


@dataclass(frozen=True, slots=True)
class SealItem:
    """One value to seal: its template slot, what its mac is about (a parameter's name, or
    `registry <host>`), and its plaintext."""

    slot: str
    label: str
    plaintext: str


def parameter_item(name: str, plaintext: str) -> SealItem:
    return SealItem(f"{SLOT_PREFIX}parameter/{name}", name, plaintext)


def grant_item(registry: str, password: str) -> SealItem:
    return SealItem(f"{SLOT_PREFIX}registry/{registry}", f"registry {registry}", password)


def no_key_problem(device_id: str, items: list[SealItem]) -> Problem:
    """Why a device that reported no encryption key gets no deployment with secrets."""
    return Problem(("spec",), f"device {device_id} reported no encryption key, so it cannot "
                   f"receive {', '.join(i.label for i in items)}: a margo-gitops device "
                   "client reports one (x-margo-gitops-extensions.encryptionKey); nothing "
                   "is sent in clear")


def previous_envelopes(document: Mapping[str, Any] | None) -> dict[str, str]:
    """Label -> envelope of every sealed value a device's current document holds."""
    if not isinstance(document, Mapping):
        return {}
    spec = document.get("spec") or {}
    out = {name: body["value"] for name, body in (spec.get("parameters") or {}).items()
           if isinstance(body, Mapping) and is_sealed(body.get("value"))}
    grants = (spec.get(GRANTS[0]) or {}).get(GRANTS[1]) or ()
    out.update({f"registry {g['registry']}": g["password"] for g in grants
                if isinstance(g, Mapping) and is_sealed(g.get("password"))})
    return out


def seal_for(key: FleetKey, device_id: str, extensions: Mapping[str, Any],
             items: list[SealItem], previous: Mapping[str, str]) -> dict[str, str]:
    """Slot -> envelope for each item: the previous envelope when still right (see the
    module docstring), a new sealing otherwise. The caller has checked that the device
    reported a key (`device_recipient`)."""
    recipient = device_recipient(extensions)
    if recipient is None:
        raise SealError(f"device {device_id} reported no encryption key")
    fingerprint = recipient_fingerprint(recipient)
    out: dict[str, str] = {}
    for item in items:
        mac = key.mac(device_id, item.label, item.plaintext)
        before = previous.get(item.label)
        if before is not None and _still_right(before, fingerprint, mac):
            out[item.slot] = before
        else:
            out[item.slot] = seal(item.plaintext, recipient, mac=mac)
    return out


def _still_right(envelope: str, fingerprint: str, mac: str) -> bool:
    try:
        parts = parse_sealed(envelope)
    except SealError:
        return False
    return parts.fingerprint == fingerprint and parts.mac == mac


#: What an immutable setting's previous sealed value compares as when its plaintext changed.
_CHANGED = "<a different secret value>"


def compare_previous(key: FleetKey, device_id: str, values: Mapping[str, Any],
                     names: list[str], previous: dict[str, Any] | None) -> dict[str, Any] | None:
    """`previous` (a device's current values) with each sealed value replaced by what it
    compares as: the value now when their macs agree (the same plaintext), a placeholder
    otherwise, so `immutable` settings are checked on secrets without opening any."""
    if previous is None:
        return None
    out = dict(previous)
    for name in names:
        before = out.get(name)
        if not is_sealed(before):
            continue
        try:
            same = parse_sealed(before).mac == key.mac(device_id, name, values[name])
        except SealError:
            same = False
        out[name] = values[name] if same else _CHANGED
    return out


def redacted(problems: list[Problem], secrets: Collection[str], device_id: str) -> list[Problem]:
    """`problems` with those about a secret parameter rewritten without the value: rule
    and immutability messages quote what they found, and these are stored and shown."""
    out = []
    for problem in problems:
        path = problem.path
        if len(path) > 2 and path[:2] == ("spec", "parameters") and path[2] in secrets:
            problem = dataclasses.replace(
                problem, found=None, message=f"on device {device_id}: the secret value of "
                f"{path[2]} breaks its configuration rules or an immutable setting (the "
                "value is not shown)" + (f"; expected {problem.expected}"
                                         if problem.expected else ""))
        out.append(problem)
    return out
