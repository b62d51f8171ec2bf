package state

import (
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"
)

// open opens the state in dir and closes it when the test ends.
func open(t *testing.T, dir string) *DB {
	t.Helper()
	db, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

func TestOpenCreates(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "var", "lib", "weft")
	db := open(t, dir)
	if want := filepath.Join(dir, FileName); db.Path() != want {
		t.Errorf("Path() = %s, want %s", db.Path(), want)
	}
	fi, err := os.Stat(db.Path())
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm()&0o077 != 0 {
		t.Errorf("%s has mode %v: readable by others", db.Path(), fi.Mode())
	}
	di, err := os.Stat(dir)
	if err != nil {
		t.Fatal(err)
	}
	if di.Mode().Perm()&0o077 != 0 {
		t.Errorf("%s has mode %v: readable by others", dir, di.Mode())
	}
	// The writability probe leaves nothing behind.
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 {
		t.Errorf("state dir holds %v, want only %s", ents, FileName)
	}
}

func TestOpenLocked(t *testing.T) {
	dir := t.TempDir()
	db := open(t, dir)
	start := time.Now()
	second, err := Open(dir)
	if err == nil {
		second.Close()
		t.Fatal("a second Open of the same state dir succeeded")
	}
	if took := time.Since(start); took > 3*time.Second {
		t.Errorf("a second Open took %v to fail", took)
	}
	if !errors.Is(err, ErrLocked) {
		t.Errorf("second Open: %v, want ErrLocked", err)
	}
	if !strings.Contains(err.Error(), db.Path()) {
		t.Errorf("%q does not name the file %s", err, db.Path())
	}
	// Once the first is closed the state opens again.
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
	open(t, dir)
}

func TestOpenBadDir(t *testing.T) {
	file := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		dir     string
		wantMsg []string
	}{
		{"", []string{"--state-dir is empty"}},
		{file, []string{file, "--state-dir"}},
		{filepath.Join(file, "sub"), []string{filepath.Join(file, "sub"), "cannot create --state-dir", "writable"}},
	}
	for _, tt := range tests {
		db, err := Open(tt.dir)
		if err == nil {
			db.Close()
			t.Errorf("Open(%q) succeeded", tt.dir)
			continue
		}
		for _, m := range tt.wantMsg {
			if !strings.Contains(err.Error(), m) {
				t.Errorf("Open(%q): %q does not say %q", tt.dir, err, m)
			}
		}
	}
}

func TestOpenCorruptFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, FileName)
	if err := os.WriteFile(path, []byte(strings.Repeat("not a bolt file ", 1024)), 0o600); err != nil {
		t.Fatal(err)
	}
	db, err := Open(dir)
	if err == nil {
		db.Close()
		t.Fatal("Open of a corrupt file succeeded")
	}
	if !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), "corrupt") {
		t.Errorf("%q does not name the file and say what to do", err)
	}
}

func TestGetPutUpdateView(t *testing.T) {
	db := open(t, t.TempDir())
	if v, err := db.Get("nope", "k"); err != nil || v != nil {
		t.Fatalf("Get from a missing bucket = %q, %v", v, err)
	}
	if err := db.View("nope", func(b *bolt.Bucket) error {
		if b != nil {
			t.Error("View of a missing bucket passed a bucket")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if err := db.Put("b", "k", []byte("v1")); err != nil {
		t.Fatal(err)
	}
	if v, err := db.Get("b", "k"); err != nil || string(v) != "v1" {
		t.Fatalf("Get = %q, %v", v, err)
	}
	if v, err := db.Get("b", "other"); err != nil || v != nil {
		t.Fatalf("Get of a missing key = %q, %v", v, err)
	}
	// A failing Update changes nothing.
	boom := errors.New("boom")
	err := db.Update("b", func(b *bolt.Bucket) error {
		if err := b.Put([]byte("k"), []byte("v2")); err != nil {
			return err
		}
		return boom
	})
	if !errors.Is(err, boom) {
		t.Fatalf("Update returned %v, want the callback's error", err)
	}
	if v, _ := db.Get("b", "k"); string(v) != "v1" {
		t.Fatalf("a failed Update left %q", v)
	}
	// Get returns a copy that outlives the transaction.
	v, _ := db.Get("b", "k")
	if err := db.Put("b", "k", []byte("xx")); err != nil {
		t.Fatal(err)
	}
	if string(v) != "v1" {
		t.Fatalf("value read earlier changed to %q", v)
	}
}

func TestPeerName(t *testing.T) {
	dir := t.TempDir()
	db, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	first, err := db.PeerName("")
	if err != nil {
		t.Fatal(err)
	}
	if again, err := db.PeerName(""); err != nil || again != first {
		t.Fatalf("second PeerName = %q, %v; want %q", again, err, first)
	}
	db.Close()

	db = open(t, dir)
	if got, err := db.PeerName(""); err != nil || got != first {
		t.Fatalf("PeerName after reopen = %q, %v; want %q", got, err, first)
	}
	if got, err := db.PeerName("node-a"); err != nil || got != "node-a" {
		t.Fatalf("explicit PeerName = %q, %v", got, err)
	}
	// The explicit name is saved and wins from now on.
	if got, err := db.PeerName(""); err != nil || got != "node-a" {
		t.Fatalf("PeerName after an explicit one = %q, %v", got, err)
	}
}

var macLike = regexp.MustCompile(`^[0-9a-f]{2}(:[0-9a-f]{2}){5}$`)

func TestRandomPeerName(t *testing.T) {
	seen := map[string]bool{}
	for range 1000 {
		name := RandomPeerName()
		if !macLike.MatchString(name) {
			t.Fatalf("RandomPeerName() = %q, not like 02:00:00:00:00:00", name)
		}
		b0, err := strconv.ParseUint(name[:2], 16, 8)
		if err != nil {
			t.Fatal(err)
		}
		if b0&1 != 0 {
			t.Fatalf("%s has the multicast bit set", name)
		}
		if b0&2 == 0 {
			t.Fatalf("%s does not have the locally-administered bit set", name)
		}
		if seen[name] {
			t.Fatalf("%s came twice in 1000 names", name)
		}
		seen[name] = true
	}
}
