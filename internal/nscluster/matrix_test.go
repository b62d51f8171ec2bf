package nscluster

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestMatrix(t *testing.T) {
	m := NewMatrix([]string{"n0/a", "n0/bb", "n1/c"})
	if m.AllOK() {
		t.Fatal("a fresh matrix must not be all OK")
	}
	for i := range m.OK {
		for j := range m.OK[i] {
			m.OK[i][j] = true
		}
	}
	if !m.AllOK() || len(m.Failures()) != 0 {
		t.Fatalf("all set, but failures %v", m.Failures())
	}
	m.OK[1][2] = false
	if got, want := m.Failures(), []string{"n0/bb -> n1/c"}; len(got) != 1 || got[0] != want[0] {
		t.Fatalf("Failures() = %v, want %v", got, want)
	}
	s := m.String()
	t.Logf("\n%s", s)
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) != 5 {
		t.Fatalf("want header, 3 rows and a summary, got %d lines:\n%s", len(lines), s)
	}
	if !strings.HasPrefix(lines[2], "n0/bb") || !strings.Contains(lines[2], "✗") || strings.Count(lines[2], "✓") != 1 {
		t.Errorf("row of n0/bb is wrong: %q", lines[2])
	}
	if lines[4] != "5 of 6 pairs reached" {
		t.Errorf("summary = %q", lines[4])
	}
	m.OK[1][2] = true
	m.Problems = []string{"n0/a, n1/c share the address 10.32.0.2"}
	if m.AllOK() || len(m.Failures()) != 1 || !strings.Contains(m.String(), "problem: n0/a, n1/c share") {
		t.Errorf("a problem must fail the matrix and show: %v\n%s", m.Failures(), m)
	}
}

func TestLastLines(t *testing.T) {
	for _, tc := range []struct {
		in   string
		n    int
		want string
	}{
		{"a\nb\nc\n", 2, "b\nc"},
		{"a\nb\nc", 5, "a\nb\nc"},
		{"", 3, ""},
	} {
		if got := lastLines(tc.in, tc.n); got != tc.want {
			t.Errorf("lastLines(%q, %d) = %q, want %q", tc.in, tc.n, got, tc.want)
		}
	}
}

func TestFindBinDir(t *testing.T) {
	t.Setenv("WEFT_BIN_DIR", "")
	dir, err := FindBinDir()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasSuffix(dir, "/bin") || !isWeftModule(strings.TrimSuffix(dir, "bin")+"go.mod") {
		t.Errorf("FindBinDir() = %s, want bin/ beside the weft go.mod", dir)
	}
	t.Setenv("WEFT_BIN_DIR", "/opt/weft/bin")
	if dir, _ := FindBinDir(); dir != "/opt/weft/bin" {
		t.Errorf("with WEFT_BIN_DIR set, FindBinDir() = %s", dir)
	}
	if _, err := binaryIn(t.TempDir(), "weft"); err == nil || !strings.Contains(err.Error(), "make build") {
		t.Errorf("a missing binary must say to run make build, got %v", err)
	}
}

// An installed weft finds its binaries beside itself, wherever it runs.
func TestBinDirOfAnInstalledWeft(t *testing.T) {
	inst := t.TempDir()
	if err := os.WriteFile(filepath.Join(inst, "weft"), []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	elsewhere := t.TempDir()
	if dir, err := binDirFrom(filepath.Join(inst, "weft"), elsewhere); err != nil || dir != inst {
		t.Errorf("binDirFrom(an installed weft, outside the repository) = %s, %v; want %s", dir, err, inst)
	}
	_, err := binDirFrom(filepath.Join(elsewhere, "prog"), elsewhere)
	if err == nil || !strings.Contains(err.Error(), "WEFT_BIN_DIR") {
		t.Errorf("no weft beside the program and outside the repository: %v, want an error naming WEFT_BIN_DIR", err)
	}
}
