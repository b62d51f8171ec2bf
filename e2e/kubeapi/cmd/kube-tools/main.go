// Command kube-tools builds the control plane that weft's Kubernetes tests
// run (etcd, kube-apiserver and kubectl, pinned by e2e/kubeapi/tools) into
// the tools cache, unless it is there already, and prints the cache entry.
// `make kube-tools` runs it before the tests, so that no test waits minutes
// for a cold build.
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/weft-net/weft/e2e/kubeapi"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	bins, err := kubeapi.Binaries(ctx, log)
	if err != nil {
		fmt.Fprintf(os.Stderr, "kube-tools: %v\n", err)
		os.Exit(1)
	}
	fmt.Println(bins.Dir)
}
