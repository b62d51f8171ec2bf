package kubeapi

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/weft-net/weft/e2e"
)

// testbed is the start of an e2e/kubeapi test of routers: it skips where
// the test cannot run (not root, -short), and gives a Testbed of nodes
// nodes with a context bounded for the whole test.
func testbed(t *testing.T, nodes int) (context.Context, *Testbed) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("kubeapi: needs root to make network namespaces")
	}
	if testing.Short() {
		t.Skip("kubeapi: skipped in -short mode")
	}
	run := e2e.NewTestRun(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	t.Cleanup(cancel)
	return ctx, NewTestbed(t, ctx, run, nodes)
}
