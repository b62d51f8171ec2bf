package e2e

import (
	"bytes"
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// TestDemo runs `weft demo` as `make demo` does and checks what it shows
// and that it leaves nothing behind.
func TestDemo(t *testing.T) {
	if testing.Short() {
		t.Skip("e2e: skipped in -short mode")
	}
	NewTestRun(t) // skips unless root; sweeps leftovers of dead runs
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out bytes.Buffer
	if err := Demo(ctx, DemoOptions{Nodes: 1, Pods: 3, Out: &out}); err != nil {
		t.Fatalf("demo failed: %v\n%s", err, out.String())
	}
	for _, want := range []string{"6 of 6 pairs reached", "every pod reached every other pod and its gateway",
		"Service: ipam", "Status: ready", "(3 active)", "done: nothing left behind"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("demo output lacks %q:\n%s", want, out.String())
		}
	}
	prefix := strings.Fields(strings.SplitN(out.String(), "(prefix ", 2)[1])[0]
	prefix = strings.TrimSuffix(prefix, "),")
	if list, _ := exec.CommandContext(ctx, "ip", "netns", "list").Output(); strings.Contains(string(list), prefix) {
		t.Errorf("demo left namespaces with prefix %s:\n%s", prefix, list)
	}
	if err := Demo(ctx, DemoOptions{Nodes: 2, Pods: 1, Out: &out}); err == nil || !strings.Contains(err.Error(), "--nodes") {
		t.Errorf("a multi-node demo before the data plane: %v", err)
	}
}
