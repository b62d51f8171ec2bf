// Command kube-tools builds the Kubernetes tools that weft's tests run into
// the tools cache, unless they are there already, and prints the cache
// entry:
//
//   - kube-tools (or kube-tools control-plane): etcd, kube-apiserver,
//     kubectl and the rest of the control plane, pinned by
//     e2e/kubeapi/tools. `make kube-tools` runs it before the tests, so
//     that no test waits minutes for a cold build.
//   - kube-tools conformance: the Kubernetes e2e suite (e2e.test), ginkgo
//     and agnhost, pinned by e2e/conformance/tools. `make conformance`
//     runs it before the cluster comes up, so that no cluster waits for a
//     cold build.
//   - kube-tools coredns: CoreDNS with a cluster DNS's plugins, pinned by
//     e2e/conformance/dns, the cluster DNS of `make conformance`.
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/weft-net/weft/e2e/conformance"
	"github.com/weft-net/weft/e2e/kubeapi"
)

func main() {
	set := "control-plane"
	switch len(os.Args) {
	case 1:
	case 2:
		set = os.Args[1]
	default:
		fmt.Fprintln(os.Stderr, "usage: kube-tools [control-plane|conformance|coredns]")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	var dir string
	var err error
	switch set {
	case "control-plane":
		var bins kubeapi.Bins
		bins, err = kubeapi.Binaries(ctx, log)
		dir = bins.Dir
	case "conformance":
		var tools conformance.Tools
		tools, err = conformance.Build(ctx, log)
		dir = tools.Dir
		if err == nil {
			_, err = conformance.BuildExtras(ctx, log)
		}
	case "coredns":
		var bin string
		bin, err = conformance.BuildCoreDNS(ctx, log)
		dir = filepath.Dir(bin)
	default:
		fmt.Fprintf(os.Stderr, "kube-tools: unknown set %q: want control-plane, conformance or coredns\n", set)
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "kube-tools %s: %v\n", set, err)
		os.Exit(1)
	}
	fmt.Println(dir)
}
