"""The round-robin load balancers (HTTP per request, TCP per connection) in front of fleet
server replicas: `tools.balancer`, which the benchmarks use too."""

from __future__ import annotations

from tools.balancer import Balancer, TcpBalancer, balancing, tcp_balancing

__all__ = ["Balancer", "TcpBalancer", "balancing", "tcp_balancing"]
