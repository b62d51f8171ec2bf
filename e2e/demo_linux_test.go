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
	// What `make demo` runs: three nodes, two pods each.
	if err := Demo(ctx, DemoOptions{Nodes: 3, Pods: 2, Out: &out}); err != nil {
		t.Fatalf("demo failed: %v\n%s", err, out.String())
	}
	for _, want := range []string{"30 of 30 pairs reached", "every pod reached every other pod and every node's bridge",
		"Service: ipam", "Status: ready", "Peers: 3", "Encapsulation: auto (vxlan (kernel): 2 peers)", "established  alive  vxlan (kernel)  unencrypted",
		"done: nothing left behind"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("demo output lacks %q:\n%s", want, out.String())
		}
	}
	prefix := strings.Fields(strings.SplitN(out.String(), "(prefix ", 2)[1])[0]
	prefix = strings.TrimSuffix(prefix, "),")
	if list, _ := exec.CommandContext(ctx, "ip", "netns", "list").Output(); strings.Contains(string(list), prefix) {
		t.Errorf("demo left namespaces with prefix %s:\n%s", prefix, list)
	}
	// With --encrypt: two nodes, encrypted both ways.
	out.Reset()
	if err := Demo(ctx, DemoOptions{Nodes: 2, Pods: 1, Encrypt: true, Out: &out}); err != nil {
		t.Fatalf("demo --encrypt failed: %v\n%s", err, out.String())
	}
	if got := strings.Count(out.String(), "Encryption: enabled"); got != 2 {
		t.Errorf("demo --encrypt shows Encryption: enabled %d times, want 2:\n%s", got, out.String())
	}
	if got := strings.Count(out.String(), "udp  encrypted"); got != 2 {
		t.Errorf("demo --encrypt shows %d encrypted connections, want 2:\n%s", got, out.String())
	}
	if err := Demo(ctx, DemoOptions{Nodes: MaxDemoNodes + 1, Pods: 1, Out: &out}); err == nil || !strings.Contains(err.Error(), "--nodes") {
		t.Errorf("a demo of %d nodes: %v, want an error about --nodes", MaxDemoNodes+1, err)
	}
}
