package nscluster

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
)

// Options configure a Run. The zero value is usable.
type Options struct {
	// Log receives what the run creates and removes; nil discards it.
	Log *slog.Logger
	// BinDir holds the weft binaries (weft, weft-cni, portmap). Empty means
	// $WEFT_BIN_DIR, else bin/ at the root of the weft module (FindBinDir).
	BinDir string

	// markerBase replaces /run/weft-e2e in tests of the sweep.
	markerBase string
}

// Run owns everything one test, benchmark or demo creates: namespaces,
// processes and a temporary directory, all named with one random prefix.
// Close removes all of it in reverse order of creation.
type Run struct {
	prefix    string
	dir       string
	markerDir string
	log       *slog.Logger

	binDir  string
	binOnce sync.Once
	binErr  error

	closeOnce sync.Once
	closeErr  error

	mu       sync.Mutex // guards the fields below
	cleanups []cleanup
	closed   bool
	logFiles []string
	cluster  *Cluster
}

type cleanup struct {
	what string
	fn   func() error
}

// NewRun sweeps what dead runs left behind (see Sweep), claims a fresh prefix,
// records this process as its owner and makes the run's temporary directory.
// The caller must Close the run on every exit path.
func NewRun(opts Options) (*Run, error) {
	log := opts.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	base := opts.markerBase
	if base == "" {
		base = markerBase
	}
	if err := sweep(context.Background(), base, log); err != nil {
		log.Warn("sweeping leftovers of dead runs", "err", err)
	}
	r := &Run{log: log, binDir: opts.BinDir}
	var err error
	if r.prefix, r.markerDir, err = claimPrefix(base); err != nil {
		return nil, err
	}
	// Record where the directory goes before making it, so that a crash in
	// between leaves nothing unrecorded.
	pattern := r.prefix + "-"
	if err := recordDirs(r.markerDir, filepath.Join(os.TempDir(), pattern+"*")); err != nil {
		_ = os.RemoveAll(r.markerDir)
		return nil, err
	}
	if r.dir, err = os.MkdirTemp("", pattern); err != nil {
		_ = os.RemoveAll(r.markerDir)
		return nil, fmt.Errorf("e2e: making the run directory: %w", err)
	}
	r.Defer("remove "+r.dir, func() error { return os.RemoveAll(r.dir) })
	log.Info("e2e run started", "prefix", r.prefix, "dir", r.dir)
	return r, nil
}

// claimPrefix claims a fresh prefix under the registry base: a prefix no
// namespace has, whose record it makes with this process as the owner.
func claimPrefix(base string) (prefix, markerDir string, err error) {
	me, err := currentOwner()
	if err != nil {
		return "", "", err
	}
	if err := os.MkdirAll(base, 0o755); err != nil {
		return "", "", fmt.Errorf("e2e: making the run registry %s: %w", base, err)
	}
	for try := 0; ; try++ {
		prefix, err = newPrefix()
		if err != nil {
			return "", "", err
		}
		markerDir = filepath.Join(base, prefix)
		if nsWithPrefix(prefix) == 0 {
			if err = os.Mkdir(markerDir, 0o700); err == nil {
				break
			}
			if !errors.Is(err, os.ErrExist) {
				return "", "", fmt.Errorf("e2e: claiming run prefix in %s: %w", base, err)
			}
		}
		if try == 10 {
			return "", "", fmt.Errorf("e2e: no free run prefix after %d tries", try)
		}
	}
	if err := writeMarker(markerDir, me); err != nil {
		_ = os.RemoveAll(markerDir)
		return "", "", err
	}
	return prefix, markerDir, nil
}

// ClaimPrefix is NewRun's claim alone, for tests that make their own
// namespaces (named <prefix>-*) without a Run: it sweeps what dead runs
// left behind, claims a fresh prefix and records this process as its
// owner, so that namespaces a killed test leaves are swept by the next
// run. release removes the record: call it once the namespaces are gone.
func ClaimPrefix() (prefix string, release func() error, err error) {
	// What cannot be swept now is tried again by the next run, as NewRun
	// does; it does not stop this one.
	_ = sweep(context.Background(), markerBase, slog.New(slog.DiscardHandler))
	prefix, dir, err := claimPrefix(markerBase)
	if err != nil {
		return "", nil, err
	}
	return prefix, func() error { return os.RemoveAll(dir) }, nil
}

// newPrefix returns "wft" and five random lower-case base32 characters.
func newPrefix() (string, error) {
	const alphabet = "abcdefghijklmnopqrstuvwxyz234567"
	var b [5]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("e2e: random run prefix: %w", err)
	}
	var sb strings.Builder
	sb.WriteString("wft")
	for _, c := range b {
		sb.WriteByte(alphabet[c%32])
	}
	return sb.String(), nil
}

// Prefix is the run's unique name prefix, e.g. "wftab3cd".
func (r *Run) Prefix() string { return r.prefix }

// Dir is the run's temporary directory; each node has a subdirectory.
func (r *Run) Dir() string { return r.dir }

// Log is the run's logger.
func (r *Run) Log() *slog.Logger { return r.log }

// BinDir is the directory of weft binaries this run uses (see Options.BinDir).
func (r *Run) BinDir() (string, error) {
	r.binOnce.Do(func() {
		if r.binDir == "" {
			r.binDir, r.binErr = FindBinDir()
		}
	})
	return r.binDir, r.binErr
}

// Binary returns the path of a weft binary (weft, weft-cni, portmap), or an
// error that says how to build it.
func (r *Run) Binary(name string) (string, error) {
	dir, err := r.BinDir()
	if err != nil {
		return "", err
	}
	return binaryIn(dir, name)
}

// Defer registers fn to run on Close, before everything registered earlier.
// After Close it runs fn at once, so that nothing made during a Close leaks.
func (r *Run) Defer(what string, fn func() error) {
	r.mu.Lock()
	if !r.closed {
		r.cleanups = append(r.cleanups, cleanup{what, fn})
		r.mu.Unlock()
		return
	}
	r.mu.Unlock()
	if err := fn(); err != nil {
		r.log.Warn("cleanup after close failed", "what", what, "err", err)
	}
}

// addLogFile registers a log file that NewTestRun shows when a test fails.
func (r *Run) addLogFile(path string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.logFiles = append(r.logFiles, path)
}

// LogFiles lists the log files of the run's daemons and CNI calls.
func (r *Run) LogFiles() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.logFiles...)
}

// Close stops every process and deletes every namespace and directory of
// the run, in reverse order of creation, and then the run's record. It is
// safe to call more than once and from several goroutines; later calls wait
// for the first and return its result. When a step fails the record is kept,
// so that a later run sweeps what is left once this process has exited.
func (r *Run) Close() error {
	r.closeOnce.Do(func() {
		r.mu.Lock()
		r.closed = true
		steps := r.cleanups
		r.cleanups = nil
		r.mu.Unlock()

		var errs []error
		for i := len(steps) - 1; i >= 0; i-- {
			s := steps[i]
			if err := s.fn(); err != nil {
				r.log.Warn("cleanup failed", "what", s.what, "err", err)
				errs = append(errs, fmt.Errorf("%s: %w", s.what, err))
				continue
			}
			r.log.Debug("cleaned up", "what", s.what)
		}
		if len(errs) == 0 {
			if err := os.RemoveAll(r.markerDir); err != nil {
				errs = append(errs, fmt.Errorf("removing run record: %w", err))
			}
		}
		r.closeErr = errors.Join(errs...)
		if r.closeErr != nil {
			r.closeErr = fmt.Errorf("e2e: closing run %s: %w", r.prefix, r.closeErr)
		}
		r.log.Info("e2e run closed", "prefix", r.prefix, "err", r.closeErr)
	})
	return r.closeErr
}

// NewNetns makes the namespace <prefix>-<name> with its loopback up; Close
// deletes it, killing whatever still runs in it.
func (r *Run) NewNetns(ctx context.Context, name string) (*Netns, error) {
	if name == "" || strings.ContainsAny(name, "/ \t\n") {
		return nil, fmt.Errorf("e2e: namespace name %q must be non-empty without '/' or spaces", name)
	}
	r.mu.Lock()
	closed := r.closed
	r.mu.Unlock()
	if closed {
		return nil, fmt.Errorf("e2e: run %s is closed", r.prefix)
	}
	n, err := createNetns(ctx, r.prefix+"-"+name)
	if err != nil {
		return nil, fmt.Errorf("e2e: %w", err)
	}
	r.log.Debug("netns created", "netns", n.Name)
	r.Defer("delete netns "+n.Name, func() error {
		return deleteNetns(context.Background(), n, r.log.Warn)
	})
	return n, nil
}
