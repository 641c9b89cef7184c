"""The Helm engine (helm-python-sdk's Go library): the one place the device side imports it.

It is 80 MB of Go runtime, so it loads only where a driver needs it (the render and Helm
drivers, chart pulls, Kubernetes discovery); a Compose-only device never does.

Why the objects it applies keep the field manager `python`: Helm names its server-side-apply
field manager after the program (`filepath.Base(os.Args[0])`), and the SDK's C interface can
set neither that name nor force-conflicts. Overwriting argv[0] before the engine loads does
rename the manager, but the next upgrade of every release applied under the old name then
fails with a server-side-apply conflict on each field whose value changes ("conflict with
python"), so a fleet that updated the device software could no longer change its releases.
Renaming needs a migration of each object's managedFields first (what client-go's
`csaupgrade` does); until then the name stays the interpreter's.
"""

from __future__ import annotations

import helm_python as helm

__all__ = ["helm"]
