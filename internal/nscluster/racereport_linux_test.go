package nscluster

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestRaceReport(t *testing.T) {
	dir := t.TempDir()
	clean := filepath.Join(dir, "clean.log")
	racy := filepath.Join(dir, "racy.log")
	os.WriteFile(clean, []byte("time=... level=INFO msg=ready\n"), 0o644)
	os.WriteFile(racy, []byte("level=INFO msg=ready\n==================\nWARNING: DATA RACE\nRead at 0x00c by goroutine 7:\n  router.(*Router).alivePeers()\n==================\nlevel=INFO msg=more\n"), 0o644)
	if got := RaceReport(clean); got != "" {
		t.Fatalf("clean log: %q", got)
	}
	got := RaceReport(racy)
	if !strings.HasPrefix(got, "WARNING: DATA RACE\n") || !strings.Contains(got, "alivePeers") || strings.Contains(got, "msg=more") {
		t.Fatalf("racy log: %q", got)
	}
	if got := RaceReport(filepath.Join(dir, "missing.log")); got != "" {
		t.Fatalf("missing log: %q", got)
	}
}
