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
from typing import Any

from compiler.secrets import FleetKey
from margo.errors import Problem
from margo.sealing import (
    SealError,
    device_recipient,
    is_sealed,
    parse_sealed,
    recipient_fingerprint,
    seal,
)

__all__ = ["SLOT_PREFIX", "compare_previous", "no_key_problem", "redacted", "seal_for",
           "slot_name"]

#: `YamlTemplate` slots of sealed values are named `sealed/<parameter>`.
SLOT_PREFIX = "sealed/"


def slot_name(parameter: str) -> str:
    return SLOT_PREFIX + parameter


def no_key_problem(device_id: str, names: list[str]) -> Problem:
    """Why a device that reported no encryption key gets no deployment with secrets."""
    return Problem(("spec", "parameters", names[0]),
                   f"device {device_id} reported no encryption key, so it cannot receive "
                   f"the sensitive parameter(s) {', '.join(names)}: a margo-gitops device "
                   "client reports one (x-margo-gitops-extensions.encryptionKey); nothing "
                   "is sent in clear")


def seal_for(key: FleetKey, device_id: str, extensions: Mapping[str, Any],
             values: Mapping[str, Any], names: list[str],
             previous: Mapping[str, Any] | None) -> dict[str, str]:
    """Slot name -> envelope for each secret parameter in `names`: the previous envelope
    when still right (see the module docstring), a new sealing otherwise. The caller has
    checked that the device reported a key (`device_recipient`)."""
    recipient = device_recipient(extensions)
    if recipient is None:
        raise SealError(f"device {device_id} reported no encryption key")
    fingerprint = recipient_fingerprint(recipient)
    out: dict[str, str] = {}
    for name in names:
        mac = key.mac(device_id, name, values[name])
        before = (previous or {}).get(name)
        if is_sealed(before):
            try:
                parts = parse_sealed(before)
            except SealError:
                parts = None
            if parts is not None and parts.fingerprint == fingerprint and parts.mac == mac:
                out[slot_name(name)] = before
                continue
        out[slot_name(name)] = seal(values[name], recipient, mac=mac)
    return out


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
