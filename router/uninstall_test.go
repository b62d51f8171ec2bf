package router

import (
	"errors"
	"io"
	"log/slog"
	"net"
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

// Uninstall removes the state dir once it is empty and a socket file left
// by a killed router with its directory; a state dir holding other files,
// and a file at the socket's path that is no socket, stay.
func TestUninstallDirsAndStaleSocket(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	dir := t.TempDir()
	cfg := UninstallConfig{CNIConfDir: filepath.Join(dir, "net.d"), Bridge: "weft", StateDir: filepath.Join(dir, "state"),
		Socket: filepath.Join(dir, "run", "weft.sock"), Kernel: &fakeKernel{}}
	db, err := state.Open(cfg.StateDir)
	if err != nil {
		t.Fatal(err)
	}
	db.Close()
	if err := os.MkdirAll(filepath.Dir(cfg.Socket), 0o755); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("unix", cfg.Socket)
	if err != nil {
		t.Fatal(err)
	}
	ln.(*net.UnixListener).SetUnlinkOnClose(false) // as a killed router leaves it
	ln.Close()
	if err := Uninstall(cfg, log); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{cfg.StateDir, cfg.Socket, filepath.Dir(cfg.Socket)} {
		if _, err := os.Lstat(p); !os.IsNotExist(err) {
			t.Errorf("%s is still there: %v", p, err)
		}
	}

	// Someone else's files stay, and so do their directories.
	keep := filepath.Join(cfg.StateDir, "notes.txt")
	for _, f := range []string{keep, cfg.Socket} {
		if err := os.MkdirAll(filepath.Dir(f), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(f, []byte("not weft's"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := Uninstall(cfg, log); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{keep, cfg.Socket} {
		if _, err := os.Stat(f); err != nil {
			t.Errorf("%s was removed: %v", f, err)
		}
	}
}
