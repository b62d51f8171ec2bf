package kubeapi

import (
	"bytes"
	"context"
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
)

// completeFile marks a finished cache entry; it is written last, before the
// entry is renamed into place.
const completeFile = "COMPLETE"

// lockPoll is how often Binaries retries the build lock that another process
// holds.
const lockPoll = 500 * time.Millisecond

// Binaries returns the control-plane binaries from the cache, building them
// first when the cache has no entry for the current tools module and Go
// version. Progress lines go to log (nil: standard error), since a cold build
// takes minutes. Concurrent callers, in this process or others, wait for one
// build.
func Binaries(ctx context.Context, log *slog.Logger) (Bins, error) {
	toolsDir, err := findToolsDir()
	if err != nil {
		return Bins{}, err
	}
	entry, err := CachedTools{
		Module:   toolsDir,
		KeyFiles: kubeKeyFiles,
		Recipe:   buildRecipe,
		Prefix:   "kube",
		What:     "the control plane",
		Tools:    Tools,
	}.Ensure(ctx, log)
	if err != nil {
		return Bins{}, err
	}
	return binsIn(entry), nil
}

// CachedTools is a set of tools built from one Go module into one entry of
// the tools cache, $WEFT_TOOLS_CACHE/<Prefix>-<key>: the key hashes KeyFiles,
// the Go version, Recipe and the link flags, so that a change to any of them
// never reuses an old entry.
type CachedTools struct {
	Module   string   // the tools module's directory
	KeyFiles []string // the module's files the key hashes, relative to Module
	Recipe   string   // changed whenever the way the tools are built changes
	Prefix   string   // the entry's name before its key
	What     string   // what the tools are, for the log: "the control plane"
	Tools    []Tool   // in build order
	Nice     bool     // build at nice 10 (a long build on a shared machine)
}

// Ensure returns the cache entry that holds every tool, building them first
// when it is not complete. Progress lines go to log (nil: standard error).
// Concurrent callers, in this process or others, wait for one build.
func (c CachedTools) Ensure(ctx context.Context, log *slog.Logger) (string, error) {
	if log == nil {
		log = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	goBin, err := goCommand()
	if err != nil {
		return "", err
	}
	goVersion, err := runGo(ctx, goBin, false, c.Module, "env", "GOVERSION")
	if err != nil {
		return "", err
	}
	key, err := cacheKey(c.Module, c.KeyFiles, strings.TrimSpace(goVersion), c.Recipe)
	if err != nil {
		return "", err
	}
	root, err := cacheRoot()
	if err != nil {
		return "", err
	}
	entry := filepath.Join(root, c.Prefix+"-"+key)
	b := builder{goBin: goBin, toolsDir: c.Module, tools: c.Tools, log: log, what: c.What, recipe: c.Recipe, nice: c.Nice}
	if err := b.ensure(ctx, entry); err != nil {
		return "", err
	}
	return entry, nil
}

// Go runs the go command in dir as the tool builds do (the module as
// committed, no workspace, no toolchain switch) and returns its standard
// output.
func Go(ctx context.Context, dir string, args ...string) (string, error) {
	goBin, err := goCommand()
	if err != nil {
		return "", err
	}
	return runGo(ctx, goBin, false, dir, args...)
}

// builder builds a set of tools from one Go module into cache entries.
type builder struct {
	goBin    string
	toolsDir string
	tools    []Tool
	log      *slog.Logger
	what     string // for the log
	recipe   string // for the COMPLETE stamp
	nice     bool
}

// ensure makes entry hold every tool, built once: it returns at once when
// entry is complete, else takes entry's lock (waiting for another process's
// build) and builds unless that process finished it meanwhile.
func (b builder) ensure(ctx context.Context, entry string) error {
	if b.complete(entry) {
		return nil
	}
	root := filepath.Dir(entry)
	if err := os.MkdirAll(root, 0o755); err != nil {
		return fmt.Errorf("kubeapi: making the tools cache %s (set WEFT_TOOLS_CACHE to move it): %w", root, err)
	}
	unlock, err := lockFile(ctx, entry+".lock", b.what, b.log)
	if err != nil {
		return err
	}
	defer unlock()
	if b.complete(entry) { // another process built it while we waited
		return nil
	}
	return b.build(ctx, entry)
}

// complete reports whether a cache entry is finished and holds every tool.
func (b builder) complete(entry string) bool {
	if _, err := os.Stat(filepath.Join(entry, completeFile)); err != nil {
		return false
	}
	for _, t := range b.tools {
		st, err := os.Stat(filepath.Join(entry, t.Name))
		if err != nil || !st.Mode().IsRegular() || st.Mode()&0o111 == 0 {
			return false
		}
	}
	return true
}

// build compiles every tool into a temporary directory beside entry and
// renames it into place once all are built; the caller holds the lock.
// Temporary directories of killed builds are removed first.
func (b builder) build(ctx context.Context, entry string) error {
	root, base := filepath.Dir(entry), filepath.Base(entry)
	if stale, _ := filepath.Glob(filepath.Join(root, "."+base+"-build-*")); len(stale) > 0 {
		for _, d := range stale {
			b.log.Info("kubeapi: removing an unfinished build", "dir", d)
			_ = os.RemoveAll(d)
		}
	}
	if _, err := os.Stat(entry); err == nil { // incomplete: never finished its rename
		if err := os.RemoveAll(entry); err != nil {
			return fmt.Errorf("kubeapi: removing the incomplete cache entry %s: %w", entry, err)
		}
	}
	tmp, err := os.MkdirTemp(root, "."+base+"-build-")
	if err != nil {
		return fmt.Errorf("kubeapi: making a build directory in %s: %w", root, err)
	}
	defer os.RemoveAll(tmp) // gone after the rename; removes a failed build
	b.log.Info(fmt.Sprintf("kubeapi: building %s into the tools cache (once per tools go.sum)", b.what), "cache", entry, "tools", b.toolsDir)
	all := time.Now()
	var took []string
	for _, t := range b.tools {
		start := time.Now()
		b.log.Info(fmt.Sprintf("building %s (%s)…", t.Name, t.Note))
		if _, err := runGo(ctx, b.goBin, b.nice, b.toolsDir, t.args(filepath.Join(tmp, t.Name))...); err != nil {
			return err
		}
		d := time.Since(start).Round(time.Second)
		took = append(took, fmt.Sprintf("%s %s", t.Name, d))
		b.log.Info(fmt.Sprintf("built %s in %s", t.Name, d))
	}
	stamp := fmt.Sprintf("kubernetes %s\nrecipe %s\nbuilt %s in %s (%s)\n", KubeVersion, b.recipe,
		time.Now().UTC().Format(time.RFC3339), time.Since(all).Round(time.Second), strings.Join(took, ", "))
	if err := os.WriteFile(filepath.Join(tmp, completeFile), []byte(stamp), 0o644); err != nil {
		return fmt.Errorf("kubeapi: finishing the build: %w", err)
	}
	if err := os.Chmod(tmp, 0o755); err != nil {
		return fmt.Errorf("kubeapi: finishing the build: %w", err)
	}
	if err := os.Rename(tmp, entry); err != nil {
		return fmt.Errorf("kubeapi: moving the build into the cache: %w", err)
	}
	b.log.Info(fmt.Sprintf("kubeapi: %s built", b.what), "took", time.Since(all).Round(time.Second), "cache", entry)
	return nil
}

// goCommand finds the go command: on $PATH, else in /usr/local/go.
func goCommand() (string, error) {
	if p, err := exec.LookPath("go"); err == nil {
		return p, nil
	}
	if p := filepath.Join(os.Getenv("GOROOT"), "bin", "go"); os.Getenv("GOROOT") != "" {
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	const fallback = "/usr/local/go/bin/go"
	if _, err := os.Stat(fallback); err == nil {
		return fallback, nil
	}
	return "", errors.New("kubeapi: the go command is needed to build the control plane: put it on PATH")
}

// runGo runs the go command in the tools module, which must build as it is
// committed (-mod=readonly, no workspace, no toolchain switch), and returns
// its standard output; nice runs it at nice 10. The command dies with the calling process (a test
// binary killed by its timeout leaves no build running): Pdeathsig fires
// when the forking thread ends, so the thread stays locked until the end.
func runGo(ctx context.Context, goBin string, nice bool, dir string, args ...string) (string, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cmd := exec.CommandContext(ctx, goBin, args...)
	if nice {
		cmd = exec.CommandContext(ctx, "nice", append([]string{"-n", "10", goBin}, args...)...)
	}
	cmd.Dir = dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	cmd.Env = append(os.Environ(),
		"GOWORK=off", "GOTOOLCHAIN=local", "CGO_ENABLED=0",
		"GOFLAGS=-mod=readonly -buildvcs=false",
	)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("kubeapi: go %s in %s: %w: %s (if go.sum is incomplete, run `go mod tidy` in %s)",
			strings.Join(args, " "), dir, err, bytes.TrimSpace(stderr.Bytes()), dir)
	}
	return stdout.String(), nil
}

// lockFile takes an exclusive flock on path, polling until ctx ends while
// another process holds it, and returns the function that releases it.
// The kernel drops the lock when its holder dies, so a killed build never
// blocks the next one.
func lockFile(ctx context.Context, path, what string, log *slog.Logger) (func(), error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("kubeapi: opening the build lock: %w", err)
	}
	said := false
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return func() { f.Close() }, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) && !errors.Is(err, syscall.EINTR) {
			f.Close()
			return nil, fmt.Errorf("kubeapi: locking %s: %w", path, err)
		}
		if !said {
			log.Info(fmt.Sprintf("kubeapi: another process is building %s; waiting for it", what), "lock", path)
			said = true
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("kubeapi: waiting for the build lock %s: %w", path, ctx.Err())
		case <-time.After(lockPoll):
		}
	}
}
