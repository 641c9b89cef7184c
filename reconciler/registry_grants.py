"""Registry credentials the fleet grants to one deployment: read from its document, kept
sealed everywhere, opened only in memory by the driver for the step's pulls.

The server's compiler writes them in the ApplicationDeployment's spec (rc.3 and rc.2
documents; an Oct-2024 spec takes no extensions):

    spec:
      x-margo-gitops-extensions:
        registryCredentials:
          - {registry: "host[:port]", username: robot, password: "margo-sealed:v1:..."}

each password sealed to this device's key exactly like a sealed parameter value
(`margo.sealing`; its mac is the server's keyed digest of `registry <host>` and the
password). `parse_grants` reads them into `RegistryGrant`s holding the envelope, never a
plaintext: the adopted documents, `DesiredDeployment`, the journal, status reports and logs
keep only envelopes. A password given in clear is refused with the document (nothing sends
one in clear, and the device would otherwise keep it).

A driver calls `open_grants` at the start of every step that may pull (install, upgrade,
reconfigure, repair, ...: the chart or Compose package may have to come from the registry,
and Compose's images too), before anything touches the engine. One that cannot be opened
fails the step with `SECRET_UNREADABLE`, like a sealed value (`reconciler.sealed_values`),
and the previous release keeps running. `Granted.credentials` then goes to the chart cache,
the OCI client and the Docker CLI for that step's pulls only, next to the device's own
configuration, which wins for a host it names (`registry_credentials.with_granted`); a
grant is never used for another deployment's pulls. `Granted.redacting` takes the
passwords out of every error message.

A grant counts in its components' `values_digest` by registry, user name and the password's
mac (`reconciler.desired`): a new credential is a reconfigure (which rewrites the Helm
driver's image pull Secret in the cluster; Compose and render pull with it again), the same
password sealed again is nothing to do. Envelopes also count in each component's
`sealed_digest` (the runner's retry key), so a step that failed (an unreadable grant, a
refused pull) is tried again at once when the grant changes.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from margo.identifiers import REGISTRY_HOST
from margo.sealing import EXTENSION, SealError, is_sealed
from reconciler.errors import ApplyError, ErrorCode
from reconciler.registry_credentials import Pairs
from reconciler.sealed_values import Opened, Opener

__all__ = ["GRANTS", "NO_GRANTS", "Granted", "RegistryGrant", "open_grants", "parse_grants"]

#: Where a deployment's spec holds its grants: `spec[GRANTS[0]][GRANTS[1]]`.
GRANTS = (EXTENSION, "registryCredentials")

_HOST = re.compile(REGISTRY_HOST)


@dataclass(frozen=True)
class RegistryGrant:
    """One granted credential as the document holds it: the password is an envelope."""

    registry: str
    username: str
    password: str = field(repr=False)  # `margo-sealed:v1:...`, never a plaintext


def parse_grants(extensions: Mapping[str, Any], *, file: str) -> tuple[RegistryGrant, ...]:
    """The grants in a deployment spec's extensions (`margo.models.ApplicationDeployment.
    extensions`). `ValueError`, never quoting a password, for a list the device cannot use:
    not a list of {registry, username, password}, a registry that is not `host[:port]`, one
    registry twice, or a password that is not sealed."""
    ours = extensions.get(GRANTS[0])
    listed = ours.get(GRANTS[1]) if isinstance(ours, Mapping) else None
    if listed is None:
        return ()
    where = f"{file}: spec.{GRANTS[0]}.{GRANTS[1]}"
    if not isinstance(listed, list):
        raise ValueError(f"{where} must be a list of {{registry, username, password}}")
    grants: list[RegistryGrant] = []
    for index, item in enumerate(listed):
        at = f"{where}[{index}]"
        if not isinstance(item, Mapping):
            raise ValueError(f"{at} must be a mapping of registry, username and password")
        registry, username, password = (item.get(k) for k in ("registry", "username",
                                                               "password"))
        if not isinstance(registry, str) or not _HOST.match(registry):
            raise ValueError(f"{at}.registry must be a registry host[:port]")
        if not isinstance(username, str) or not username:
            raise ValueError(f"{at}.username must be a non-empty string")
        if not is_sealed(password):
            raise ValueError(f"{at}.password (registry {registry}) is not sealed to this "
                             "device (margo-sealed:v1:...): a password in clear is refused")
        if any(g.registry == registry for g in grants):
            raise ValueError(f"{at}: registry {registry} is granted twice")
        grants.append(RegistryGrant(registry, username, password))
    return tuple(grants)


@dataclass(frozen=True)
class Granted:
    """A deployment's grants opened for one step: `{host: (user, password)}`, in memory
    only, and what takes the passwords out of messages."""

    credentials: Pairs = field(default_factory=dict, repr=False)
    redactor: Opened = field(default_factory=lambda: Opened({}), repr=False)

    @property
    def hosts(self) -> frozenset[str]:
        return frozenset(self.credentials)

    @contextmanager
    def redacting(self) -> Iterator[None]:
        """Every `ApplyError` raised inside, without the granted passwords."""
        with self.redactor.redacting():
            yield


#: A deployment without grants.
NO_GRANTS = Granted()


def open_grants(grants: Sequence[RegistryGrant], key: Opener | None, *,
                deployment: str) -> Granted:
    """`grants` with their passwords opened by `key`. `ApplyError(SECRET_UNREADABLE)`, not
    retryable (the same envelope never opens later), naming the deployment and the registry,
    never the value, when one cannot be opened or there is no key."""
    if not grants:
        return NO_GRANTS
    opened: dict[str, tuple[str, str]] = {}
    for grant in grants:
        what = f"deployment {deployment!r}: the password granted for registry {grant.registry}"
        if key is None:
            raise ApplyError(ErrorCode.SECRET_UNREADABLE, f"{what} is sealed, and this driver "
                             "has no key to open it", retryable=False)
        try:
            opened[grant.registry] = (grant.username, key.open_sealed(grant.password))
        except SealError as exc:
            raise ApplyError(ErrorCode.SECRET_UNREADABLE, f"{what}: {exc}",
                             retryable=False) from None
        except ValueError as exc:  # the key file itself (EncryptionKeyError)
            raise ApplyError(ErrorCode.SECRET_UNREADABLE, f"{what}: {exc}") from None
    # The password alone, and with its user name as `user:password` (whose base64 is what
    # a Docker config.json holds), however a message might quote them.
    secrets = {text for user, password in opened.values() if password
               for text in (password, f"{user}:{password}")}
    return Granted(opened, Opened({}, tuple(sorted(secrets, key=len, reverse=True))))
