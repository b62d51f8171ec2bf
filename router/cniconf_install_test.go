package router

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// TestInstallPluginsLoopback: weft's plugins are installed and kept up to
// date; loopback is installed where the node has none, a node's own copy is
// never replaced, and an install without loopback beside it still works.
func TestInstallPluginsLoopback(t *testing.T) {
	src, dst := t.TempDir(), t.TempDir()
	for _, p := range []string{"weft-cni", "portmap", "loopback"} {
		if err := os.WriteFile(filepath.Join(src, p), []byte("new "+p), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	changed, err := InstallPlugins(src, dst)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{filepath.Join(dst, "weft-cni"), filepath.Join(dst, "portmap"), filepath.Join(dst, "loopback")}
	if !slices.Equal(changed, want) {
		t.Fatalf("first install changed %v, want %v", changed, want)
	}
	if changed, err = InstallPlugins(src, dst); err != nil || len(changed) != 0 {
		t.Fatalf("second install changed %v (%v), want nothing", changed, err)
	}

	// A node with its own loopback keeps it, even when it differs.
	own := t.TempDir()
	if err := os.WriteFile(filepath.Join(own, "loopback"), []byte("the node's own"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := InstallPlugins(src, own); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(own, "loopback")); string(b) != "the node's own" {
		t.Fatalf("the node's own loopback was replaced: %q", b)
	}

	// Without loopback beside the binary, weft's plugins still install.
	if err := os.Remove(filepath.Join(src, "loopback")); err != nil {
		t.Fatal(err)
	}
	bare := t.TempDir()
	changed, err = InstallPlugins(src, bare)
	if err != nil || len(changed) != 2 {
		t.Fatalf("install without loopback: %v, %v", changed, err)
	}
	if _, err := os.Stat(filepath.Join(bare, "loopback")); !os.IsNotExist(err) {
		t.Fatalf("loopback appeared from nowhere: %v", err)
	}
}
