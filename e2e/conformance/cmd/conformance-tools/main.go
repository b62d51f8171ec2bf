// Command conformance-tools builds the Kubernetes e2e suite (e2e.test) and
// agnhost, pinned by e2e/conformance/tools, into the tools cache unless they
// are there already, and prints the cache entry. `make conformance` runs it
// before the cluster comes up, so that no cluster waits for a cold build.
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/weft-net/weft/e2e/conformance"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	tools, err := conformance.Build(ctx, log)
	if err != nil {
		fmt.Fprintf(os.Stderr, "conformance-tools: %v\n", err)
		os.Exit(1)
	}
	fmt.Println(tools.Dir)
}
