package router

import (
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	"github.com/weft-net/weft/state"
)

// Uninstall (weft reset --force with no router) removes the CNI config,
// the bridge and the state; run again it finds nothing and succeeds; and
// while a router holds the state it removes nothing.
func TestUninstall(t *testing.T) {
	dir := t.TempDir()
	k := &fakeKernel{}
	cfg := UninstallConfig{CNIConfDir: filepath.Join(dir, "net.d"), Bridge: "weft", StateDir: filepath.Join(dir, "state"), Kernel: k}
	conf := filepath.Join(cfg.CNIConfDir, ConfListName)
	if err := os.MkdirAll(cfg.CNIConfDir, 0o755); err != nil {
		t.Fatal(err)
	}
	other := filepath.Join(cfg.CNIConfDir, "20-other.conflist")
	for _, f := range []string{conf, other} {
		if err := os.WriteFile(f, []byte("{}"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	db, err := state.Open(cfg.StateDir)
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))

	// A router holds the state: refused, nothing removed.
	if err := Uninstall(cfg, log); !errors.Is(err, state.ErrLocked) {
		t.Fatalf("Uninstall while the state is held: %v, want ErrLocked", err)
	}
	if _, err := os.Stat(conf); err != nil {
		t.Fatalf("a refused uninstall removed the CNI config: %v", err)
	}
	if _, _, _, n := k.state(); n != 0 {
		t.Fatal("a refused uninstall tore the bridge down")
	}
	db.Close()

	for run := 1; run <= 2; run++ {
		if err := Uninstall(cfg, log); err != nil {
			t.Fatalf("run %d: %v", run, err)
		}
		if _, err := os.Stat(conf); !os.IsNotExist(err) {
			t.Errorf("run %d: the CNI config is still there: %v", run, err)
		}
		if _, err := os.Stat(filepath.Join(cfg.StateDir, state.FileName)); !os.IsNotExist(err) {
			t.Errorf("run %d: the state is still there: %v", run, err)
		}
		if _, _, _, n := k.state(); n != run {
			t.Errorf("run %d: %d teardowns of the bridge", run, n)
		}
	}
	if _, err := os.Stat(other); err != nil {
		t.Errorf("another network's config was removed: %v", err)
	}
	if err := Uninstall(UninstallConfig{Kernel: k}, log); err == nil {
		t.Error("Uninstall without paths accepted")
	}
}
