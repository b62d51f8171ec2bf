package netnstest

import (
	"bufio"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// TestKilledTestIsSwept: a test process killed with SIGKILL (no cleanup
// runs) leaves its namespace behind; the next claim of a prefix sweeps it.
// The killed process is this test binary run again as a child.
func TestKilledTestIsSwept(t *testing.T) {
	if os.Getenv("NETNSTEST_CHILD") == "1" {
		prefix, _, err := Claim()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := Add(prefix + "-left"); err != nil {
			t.Fatal(err)
		}
		os.Stdout.WriteString("made " + prefix + "-left\n")
		select {} // until killed
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root to make network namespaces")
	}
	child := exec.Command(os.Args[0], "-test.run", "^TestKilledTestIsSwept$")
	child.Env = append(os.Environ(), "NETNSTEST_CHILD=1")
	out, err := child.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	var name string
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		if n, ok := strings.CutPrefix(sc.Text(), "made "); ok {
			name = n
			break
		}
	}
	if name == "" {
		_ = child.Process.Kill()
		_ = child.Wait()
		t.Fatal("the child made no namespace")
	}
	left := "/run/netns/" + name
	t.Cleanup(func() { _ = (&NS{Name: name, Path: left}).Del() })
	if err := child.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = child.Wait()
	if _, err := os.Stat(left); err != nil {
		t.Fatalf("the killed child's namespace %s should still be there before the sweep: %v", name, err)
	}
	Prefix(t) // claims, and sweeps first
	if _, err := os.Stat(left); !os.IsNotExist(err) {
		t.Errorf("namespace %s of a killed test was not swept by the next claim (stat: %v)", name, err)
	}
}
