// Command coredns is CoreDNS (github.com/coredns/coredns, pinned in this
// module's go.mod) with only the plugins a cluster's DNS uses, built for
// the cluster DNS of `make conformance` and `make kube-run`: the upstream
// binary would pull in every cloud provider's SDK for plugins no test
// cluster runs. Its image is put together by e2e/conformance (CoreDNSImage)
// and deployed by e2e/kubenodes (DNSManifest), as a cluster's kube-dns is;
// it is also agnhost's /coredns.
package main

import (
	"github.com/coredns/coredns/coremain"

	// The plugins of the Corefile kubeadm and most distributions ship,
	// less forward and loop: the test clusters have no upstream resolver.
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	// hosts: the DNS specs run this binary as agnhost's /coredns (upstream's
	// agnhost image carries CoreDNS) with a Corefile of hosts and log.
	_ "github.com/coredns/coredns/plugin/hosts"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/metrics"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"
)

func main() { coremain.Run() }
