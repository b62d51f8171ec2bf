package conformance

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"time"

	"github.com/weft-net/weft/e2e/kubeapi"
)

// recipe changes whenever the way the tools are built changes, so that a new
// recipe never reuses an old cache entry.
const recipe = "conformance-build-2"

// completeFile marks a finished cache entry, written last before the rename.
const completeFile = "COMPLETE"

// Tools are the cached e2e suite and agnhost.
type Tools struct {
	Dir     string // the cache entry
	E2ETest string // e2e.test: go test -c k8s.io/kubernetes/test/e2e
	Agnhost string // agnhost: k8s.io/kubernetes/test/images/agnhost, static
	Ginkgo  string // the ginkgo CLI of the suite's ginkgo, for parallel runs
	// KubeSrc is the k8s.io/kubernetes module's source directory (agnhost's
	// porter certificates come from there).
	KubeSrc string
}

func toolsIn(dir, src string) Tools {
	return Tools{Dir: dir, E2ETest: filepath.Join(dir, "e2e.test"), Agnhost: filepath.Join(dir, "agnhost"), Ginkgo: filepath.Join(dir, "ginkgo"), KubeSrc: src}
}

// build is one binary of the cache entry.
type build struct {
	name, note string
	args       func(out string) []string // the go command's arguments
}

var builds = []build{
	{name: "agnhost", note: "a minute or two", args: func(out string) []string {
		return []string{"build", "-trimpath", "-ldflags", ldflags(), "-o", out, "k8s.io/kubernetes/test/images/agnhost"}
	}},
	{name: "ginkgo", note: "seconds", args: func(out string) []string {
		return []string{"build", "-trimpath", "-ldflags", "-s -w", "-o", out, "github.com/onsi/ginkgo/v2/ginkgo"}
	}},
	{name: "e2e.test", note: "first time, 15 to 40 minutes on two busy cores", args: func(out string) []string {
		return []string{"test", "-c", "-vet=off", "-trimpath", "-ldflags", ldflags(), "-o", out, "k8s.io/kubernetes/test/e2e"}
	}},
}

// ldflags stamps the pinned version, as e2e/kubeapi does for the cluster's
// binaries (e2e.test logs it and compares it with the server's), and strips
// the symbol tables.
func ldflags() string {
	minor := strings.Split(strings.TrimPrefix(kubeapi.KubeVersion, "v"), ".")[1]
	var b strings.Builder
	b.WriteString("-s -w")
	for _, pkg := range []string{"k8s.io/component-base/version", "k8s.io/client-go/pkg/version"} {
		fmt.Fprintf(&b, " -X %s.gitVersion=%s -X %s.gitMajor=1 -X %s.gitMinor=%s -X %s.gitTreeState=clean",
			pkg, kubeapi.KubeVersion, pkg, pkg, minor, pkg)
	}
	return b.String()
}

// toolsSubdir is the tools module in the weft repository.
var toolsSubdir = filepath.Join("e2e", "conformance", "tools")

// cacheKey hashes the tools module, the Go version and the recipe.
func cacheKey(toolsDir, goVersion string) (string, error) {
	h := sha256.New()
	for _, f := range []string{"go.mod", "go.sum", "tools.go"} {
		data, err := os.ReadFile(filepath.Join(toolsDir, f))
		if err != nil {
			return "", fmt.Errorf("conformance: reading the tools module: %w", err)
		}
		fmt.Fprintf(h, "%s %d\n", f, len(data))
		h.Write(data)
	}
	fmt.Fprintf(h, "go %s\nrecipe %s\nldflags %s\n", goVersion, recipe, ldflags())
	return hex.EncodeToString(h.Sum(nil))[:12], nil
}

// cacheRoot is $WEFT_TOOLS_CACHE, else /var/cache/weft-tools for root and
// the user's cache directory for anyone else: the cache of e2e/kubeapi.
func cacheRoot() (string, error) {
	if d := os.Getenv("WEFT_TOOLS_CACHE"); d != "" {
		return filepath.Abs(d)
	}
	if os.Geteuid() == 0 {
		return "/var/cache/weft-tools", nil
	}
	d, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("conformance: no cache directory (set WEFT_TOOLS_CACHE): %w", err)
	}
	return filepath.Join(d, "weft-tools"), nil
}

// Build returns e2e.test and agnhost from the tools cache, building them
// first when it has no entry for the tools module and Go version (the e2e
// suite takes many minutes cold). Concurrent callers wait for one build.
func Build(ctx context.Context, log *slog.Logger) (Tools, error) {
	if log == nil {
		log = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	root, err := kubeapi.RepoRoot()
	if err != nil {
		return Tools{}, err
	}
	toolsDir := filepath.Join(root, toolsSubdir)
	goBin, err := goCommand()
	if err != nil {
		return Tools{}, err
	}
	goVersion, err := runGo(ctx, goBin, toolsDir, "env", "GOVERSION")
	if err != nil {
		return Tools{}, err
	}
	src, err := runGo(ctx, goBin, toolsDir, "list", "-m", "-f", "{{.Dir}}", "k8s.io/kubernetes")
	if err != nil {
		return Tools{}, err
	}
	key, err := cacheKey(toolsDir, strings.TrimSpace(goVersion))
	if err != nil {
		return Tools{}, err
	}
	cache, err := cacheRoot()
	if err != nil {
		return Tools{}, err
	}
	entry := filepath.Join(cache, "conformance-"+key)
	t := toolsIn(entry, strings.TrimSpace(src))
	if complete(entry) {
		return t, nil
	}
	if err := os.MkdirAll(cache, 0o755); err != nil {
		return Tools{}, fmt.Errorf("conformance: making the tools cache %s (set WEFT_TOOLS_CACHE to move it): %w", cache, err)
	}
	unlock, err := lockFile(ctx, entry+".lock", log)
	if err != nil {
		return Tools{}, err
	}
	defer unlock()
	if complete(entry) { // another process built it while we waited
		return t, nil
	}
	if err := buildEntry(ctx, goBin, toolsDir, entry, log); err != nil {
		return Tools{}, err
	}
	return t, nil
}

func complete(entry string) bool {
	if _, err := os.Stat(filepath.Join(entry, completeFile)); err != nil {
		return false
	}
	for _, b := range builds {
		st, err := os.Stat(filepath.Join(entry, b.name))
		if err != nil || !st.Mode().IsRegular() || st.Mode()&0o111 == 0 {
			return false
		}
	}
	return true
}

// buildEntry builds every binary into a temporary directory beside entry
// and renames it into place once all are built; the caller holds the lock.
func buildEntry(ctx context.Context, goBin, toolsDir, entry string, log *slog.Logger) error {
	root, base := filepath.Dir(entry), filepath.Base(entry)
	stale, _ := filepath.Glob(filepath.Join(root, "."+base+"-build-*"))
	for _, d := range stale {
		log.Info("conformance: removing an unfinished build", "dir", d)
		_ = os.RemoveAll(d)
	}
	if _, err := os.Stat(entry); err == nil {
		if err := os.RemoveAll(entry); err != nil {
			return fmt.Errorf("conformance: removing the incomplete cache entry %s: %w", entry, err)
		}
	}
	tmp, err := os.MkdirTemp(root, "."+base+"-build-")
	if err != nil {
		return fmt.Errorf("conformance: making a build directory in %s: %w", root, err)
	}
	defer os.RemoveAll(tmp)
	log.Info("conformance: building the e2e suite and agnhost into the tools cache (once per tools go.sum)", "cache", entry, "tools", toolsDir)
	all := time.Now()
	var took []string
	for _, b := range builds {
		start := time.Now()
		log.Info(fmt.Sprintf("building %s (%s)…", b.name, b.note))
		if _, err := runGo(ctx, goBin, toolsDir, b.args(filepath.Join(tmp, b.name))...); err != nil {
			return err
		}
		d := time.Since(start).Round(time.Second)
		took = append(took, fmt.Sprintf("%s %s", b.name, d))
		log.Info(fmt.Sprintf("built %s in %s", b.name, d))
	}
	stamp := fmt.Sprintf("kubernetes %s\nrecipe %s\nbuilt %s in %s (%s)\n", kubeapi.KubeVersion, recipe,
		time.Now().UTC().Format(time.RFC3339), time.Since(all).Round(time.Second), strings.Join(took, ", "))
	if err := os.WriteFile(filepath.Join(tmp, completeFile), []byte(stamp), 0o644); err != nil {
		return fmt.Errorf("conformance: finishing the build: %w", err)
	}
	if err := os.Chmod(tmp, 0o755); err != nil {
		return fmt.Errorf("conformance: finishing the build: %w", err)
	}
	if err := os.Rename(tmp, entry); err != nil {
		return fmt.Errorf("conformance: moving the build into the cache: %w", err)
	}
	log.Info("conformance: e2e suite built", "took", time.Since(all).Round(time.Second), "cache", entry)
	return nil
}

// goCommand finds the go command: on $PATH, else in /usr/local/go.
func goCommand() (string, error) {
	if p, err := exec.LookPath("go"); err == nil {
		return p, nil
	}
	const fallback = "/usr/local/go/bin/go"
	if _, err := os.Stat(fallback); err == nil {
		return fallback, nil
	}
	return "", errors.New("conformance: the go command is needed to build the e2e suite: put it on PATH")
}

// runGo runs the go command in the tools module as committed (-mod=readonly,
// no workspace, no toolchain switch), niced (the build is long and the
// machine shared), dying with the calling process (Pdeathsig fires when the
// forking thread ends, so the thread stays locked).
func runGo(ctx context.Context, goBin, dir string, args ...string) (string, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	argv := append([]string{"-n", "10", goBin}, args...)
	cmd := exec.CommandContext(ctx, "nice", argv...)
	cmd.Dir = dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	cmd.Env = append(os.Environ(),
		"GOWORK=off", "GOTOOLCHAIN=local", "CGO_ENABLED=0",
		"GOFLAGS=-mod=readonly -buildvcs=false",
	)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("conformance: go %s in %s: %w: %s (if go.sum is incomplete, run `go mod tidy` in %s)",
			strings.Join(args, " "), dir, err, bytes.TrimSpace(stderr.Bytes()), dir)
	}
	return stdout.String(), nil
}

// lockFile takes an exclusive flock on path, polling until ctx ends; the
// kernel drops it when the holder dies.
func lockFile(ctx context.Context, path string, log *slog.Logger) (func(), error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("conformance: opening the build lock: %w", err)
	}
	said := false
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return func() { f.Close() }, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) && !errors.Is(err, syscall.EINTR) {
			f.Close()
			return nil, fmt.Errorf("conformance: locking %s: %w", path, err)
		}
		if !said {
			log.Info("conformance: another process is building the e2e suite; waiting for it", "lock", path)
			said = true
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("conformance: waiting for the build lock %s: %w", path, ctx.Err())
		case <-time.After(500 * time.Millisecond):
		}
	}
}
