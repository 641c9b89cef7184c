"""Dead links and dead hosts: a TCP proxy whose link can be cut or silenced
(`tools.netproxy`, which the benchmarks use too) and a port whose connection attempts are
never answered (`tools.processes.unanswered_port`)."""

from __future__ import annotations

from tools.netproxy import CuttableProxy, cuttable_proxy
from tools.processes import unanswered_port

__all__ = ["CuttableProxy", "cuttable_proxy", "unanswered_port"]
