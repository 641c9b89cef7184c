// CoreDNS with only the plugins a test cluster's DNS needs: the Kubernetes plugin (names of
// Services and pods from the API server), cache, errors, log, health and ready. The same
// entry point as CoreDNS's own main; only the plugin list is ours (CoreDNS's documented way
// to build with a chosen set of plugins).
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

func init() {
	// In CoreDNS's own order (core/dnsserver/zdirectives.go).
	dnsserver.Directives = []string{"ready", "health", "errors", "log", "cache", "kubernetes"}
}

func main() {
	coremain.Run()
}
