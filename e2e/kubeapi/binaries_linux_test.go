package kubeapi

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/weft-net/weft/internal/syncbuf"
)

// fakeTools writes a module with two tiny main packages, standing in for
// the tools module.
func fakeTools(t *testing.T) (string, []Tool) {
	t.Helper()
	dir := t.TempDir()
	files := map[string]string{
		"go.mod":    "module example.com/faketools\n\ngo 1.26\n",
		"a/main.go": "package main\n\nfunc main() { println(\"a\") }\n",
		"b/main.go": "package main\n\nfunc main() { println(\"b\") }\n",
	}
	for name, body := range files {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir, []Tool{{Name: "a", Pkg: "./a", Note: "tiny"}, {Name: "b", Pkg: "./b", Note: "tiny"}}
}

// TestBuilderOnce: concurrent callers build once; a finished entry is
// reused; what a killed build left (a temporary directory, an entry
// without its COMPLETE mark) is cleaned up and rebuilt.
func TestBuilderOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("builds Go programs")
	}
	goBin, err := goCommand()
	if err != nil {
		t.Skip(err)
	}
	toolsDir, tools := fakeTools(t)
	var logs syncbuf.Buffer
	b := builder{goBin: goBin, toolsDir: toolsDir, tools: tools, log: slog.New(slog.NewTextHandler(&logs, nil))}
	entry := filepath.Join(t.TempDir(), "cache", "kube-0123456789ab")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	var wg sync.WaitGroup
	errs := make(chan error, 3)
	for range 3 {
		wg.Go(func() { errs <- b.ensure(ctx, entry) })
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if n := strings.Count(logs.String(), "building a "); n != 1 {
		t.Errorf("tool a built %d times by 3 concurrent callers, want once:\n%s", n, logs.String())
	}
	if !b.complete(entry) {
		t.Fatal("entry not complete after ensure")
	}
	if err := b.ensure(ctx, entry); err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(logs.String(), "building a "); n != 1 {
		t.Errorf("a complete entry was rebuilt")
	}

	// What a build killed before its rename leaves behind.
	stale := filepath.Join(filepath.Dir(entry), "."+filepath.Base(entry)+"-build-123")
	if err := os.MkdirAll(stale, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(entry, completeFile)); err != nil {
		t.Fatal(err)
	}
	if b.complete(entry) {
		t.Fatal("an entry without COMPLETE counts as complete")
	}
	if err := b.ensure(ctx, entry); err != nil {
		t.Fatal(err)
	}
	if !b.complete(entry) {
		t.Error("entry not rebuilt")
	}
	if _, err := os.Stat(stale); !os.IsNotExist(err) {
		t.Errorf("stale build directory left: %v", err)
	}
}

// TestBuilderError: a tool that does not compile gives an error naming the
// go command and the module, and leaves no entry.
func TestBuilderError(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the go command")
	}
	goBin, err := goCommand()
	if err != nil {
		t.Skip(err)
	}
	toolsDir, _ := fakeTools(t)
	b := builder{goBin: goBin, toolsDir: toolsDir, tools: []Tool{{Name: "x", Pkg: "./missing"}}, log: slog.New(slog.DiscardHandler)}
	entry := filepath.Join(t.TempDir(), "kube-x")
	err = b.ensure(context.Background(), entry)
	if err == nil || !strings.Contains(err.Error(), "go build") || !strings.Contains(err.Error(), toolsDir) {
		t.Fatalf("err = %v, want a go build failure naming %s", err, toolsDir)
	}
	if _, err := os.Stat(entry); !os.IsNotExist(err) {
		t.Errorf("a failed build left %s: %v", entry, err)
	}
	left, _ := filepath.Glob(filepath.Join(filepath.Dir(entry), ".kube-x-build-*"))
	if len(left) > 0 {
		t.Errorf("a failed build left %v", left)
	}
}

// TestLockFileWaits: a second locker waits for the first and gives up
// with the context.
func TestLockFileWaits(t *testing.T) {
	path := filepath.Join(t.TempDir(), "x.lock")
	log := slog.New(slog.DiscardHandler)
	unlock, err := lockFile(context.Background(), path, "x", log)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*lockPoll)
	defer cancel()
	if _, err := lockFile(ctx, path, "x", log); err == nil {
		t.Fatal("a held lock was taken twice")
	}
	unlock()
	unlock2, err := lockFile(context.Background(), path, "x", log)
	if err != nil {
		t.Fatalf("after unlock: %v", err)
	}
	unlock2()
}

// TestCacheKey: the key changes with go.sum and with the Go version.
func TestCacheKey(t *testing.T) {
	dir := t.TempDir()
	for name, body := range map[string]string{"go.mod": "module x\n", "go.sum": "a\n", "etcd/main.go": "package main\n"} {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	k1, err := cacheKey(dir, kubeKeyFiles, "go1.26.8", buildRecipe)
	if err != nil {
		t.Fatal(err)
	}
	if len(k1) != 12 {
		t.Errorf("key %q, want 12 hex digits", k1)
	}
	if k2, _ := cacheKey(dir, kubeKeyFiles, "go1.26.8", buildRecipe); k2 != k1 {
		t.Errorf("same input, keys %s and %s", k1, k2)
	}
	if k2, _ := cacheKey(dir, kubeKeyFiles, "go1.27.0", buildRecipe); k2 == k1 {
		t.Error("another Go version gave the same key")
	}
	if err := os.WriteFile(filepath.Join(dir, "go.sum"), []byte("b\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if k2, _ := cacheKey(dir, kubeKeyFiles, "go1.26.8", buildRecipe); k2 == k1 {
		t.Error("another go.sum gave the same key")
	}
}

// TestToolsModuleFound: the package finds its tools module from its own
// directory.
func TestToolsModuleFound(t *testing.T) {
	dir, err := findToolsDir()
	if err != nil {
		t.Fatal(err)
	}
	if moduleOf(filepath.Join(dir, "go.mod")) != "github.com/weft-net/weft/e2e/kubeapi/tools" {
		t.Errorf("%s holds no tools module", dir)
	}
}
