"""Test kits: the real parts the suites start and drive, imported as `kits.<name>`.

| kit | what it gives |
|---|---|
| `processkit` | starting real servers as processes, waiting until they answer, stopping them |
| `stubserver` | a small HTTP(S) server on loopback with a handler of the test's own |
| `serverkit`, `fleetserver` | `margo serve` with a fleet source, clients and devices |
| `devicekit` | render-driver devices of a `fleetserver` server, `margo device once` |
| `matrixkit`, `matrixengines` | the device matrix (docs/matrix.md): cells, parts, devices |
| `githttpkit` | the Git smart-HTTP app under uvicorn, and Git's wire protocol by hand |
| `pkikit` | certificates and SPIFFE identities for mutual TLS tests |
| `registrykit` | Debian's docker-registry on loopback, optionally requiring credentials |
| `chartkit` | real Helm charts, published to the registry, and deployments that use them |
| `kubekit` | the real Kubernetes control plane (tools/kube) as one test's cluster |
| `kubeemu`, `clusterkit` | the kmock emulator serving recorded clusters of other distributions |
| `dockerkit` | the real Docker engine (tools/docker) and the test images |
| `netkit` | a TCP proxy whose link can be cut |
| `rawhttp` | HTTP/1.1 over plain sockets: half-sent or held bodies, other loopback addresses |
| `fleetkit` | fleet sources and snapshots for the compiler's tests |
| `conformancekit` | the official conformance kit's data and a stub WFM |

`tests/` and the repository root are on the import path through pytest's `pythonpath`
setting (pyproject.toml), so kits and tools/ are imported normally.
"""
