package nscluster

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
)

// markerBase holds one directory per live or crashed run, named by its prefix,
// with the owner's pid and start time in "owner" and the glob of its
// temporary directories in "dirs".
const markerBase = "/run/weft-e2e"

const (
	ownerFile = "owner"
	dirsFile  = "dirs"
)

// validPrefix is what a run prefix looks like; a marker directory with any
// other name is not ours and is left alone.
var validPrefix = regexp.MustCompile(`^wft[a-z2-7]{5}$`)

// owner identifies a process across pid reuse: a pid and its start time.
type owner struct {
	pid   int
	start uint64
}

func currentOwner() (owner, error) {
	_, _, start, err := procStat(os.Getpid())
	if err != nil {
		return owner{}, fmt.Errorf("e2e: reading own start time: %w", err)
	}
	return owner{pid: os.Getpid(), start: start}, nil
}

// alive reports whether the owner process still runs: the pid exists, is no
// zombie and started at the recorded time.
func (o owner) alive() bool {
	_, state, start, err := procStat(o.pid)
	return err == nil && state != "Z" && start == o.start
}

func writeMarker(dir string, o owner) error {
	tmp := filepath.Join(dir, ownerFile+".tmp")
	if err := os.WriteFile(tmp, fmt.Appendf(nil, "%d %d\n", o.pid, o.start), 0o600); err != nil {
		return fmt.Errorf("e2e: writing run owner: %w", err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, ownerFile)); err != nil {
		return fmt.Errorf("e2e: writing run owner: %w", err)
	}
	return nil
}

func readMarker(dir string) (owner, error) {
	data, err := os.ReadFile(filepath.Join(dir, ownerFile))
	if err != nil {
		return owner{}, err
	}
	f := strings.Fields(string(data))
	if len(f) != 2 {
		return owner{}, fmt.Errorf("malformed run owner %q in %s", data, dir)
	}
	pid, err1 := strconv.Atoi(f[0])
	start, err2 := strconv.ParseUint(f[1], 10, 64)
	if err1 != nil || err2 != nil || pid <= 0 {
		return owner{}, fmt.Errorf("malformed run owner %q in %s", data, dir)
	}
	return owner{pid: pid, start: start}, nil
}

// recordDirs appends directory globs to a run's record.
func recordDirs(dir string, globs ...string) error {
	f, err := os.OpenFile(filepath.Join(dir, dirsFile), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("e2e: recording run directories: %w", err)
	}
	for _, g := range globs {
		if _, err := fmt.Fprintln(f, g); err != nil {
			f.Close()
			return fmt.Errorf("e2e: recording run directories: %w", err)
		}
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("e2e: recording run directories: %w", err)
	}
	return nil
}

// nsWithPrefix counts the named namespaces of a run prefix.
func nsWithPrefix(prefix string) int {
	entries, _ := os.ReadDir(netnsDir)
	n := 0
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), prefix+"-") {
			n++
		}
	}
	return n
}

// Sweep removes what runs whose owner process is gone left behind: their
// namespaces (<prefix>-*, after killing what still runs in them), their
// temporary directories and their record under /run/weft-e2e. Runs of live
// processes and anything not recorded by a run are left alone. NewRun calls
// it; `weft demo` or a CI script may call it too.
func Sweep(ctx context.Context, log *slog.Logger) error {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return sweep(ctx, markerBase, log)
}

func sweep(ctx context.Context, base string, log *slog.Logger) error {
	entries, err := os.ReadDir(base)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("e2e: reading run registry %s: %w", base, err)
	}
	var errs []error
	for _, e := range entries {
		prefix := e.Name()
		if !e.IsDir() || !validPrefix.MatchString(prefix) {
			continue
		}
		dir := filepath.Join(base, prefix)
		o, err := readMarker(dir)
		if err != nil {
			// Being made right now, or not ours to judge.
			log.Debug("run record without a readable owner, left alone", "dir", dir, "err", err)
			continue
		}
		if o.alive() {
			continue
		}
		log.Info("sweeping leftovers of a dead run", "prefix", prefix, "pid", o.pid)
		if err := sweepRun(ctx, dir, prefix, log); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// sweepRun removes the namespaces, directories and record of one dead run.
func sweepRun(ctx context.Context, dir, prefix string, log *slog.Logger) error {
	var errs []error
	entries, err := os.ReadDir(netnsDir)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		errs = append(errs, err)
	}
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), prefix+"-") {
			continue
		}
		n := &Netns{Name: e.Name(), Path: filepath.Join(netnsDir, e.Name())}
		if err := deleteNetns(ctx, n, log.Warn); err != nil {
			errs = append(errs, err)
		} else {
			log.Info("swept namespace", "netns", n.Name)
		}
	}
	data, err := os.ReadFile(filepath.Join(dir, dirsFile))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		errs = append(errs, err)
	}
	for _, glob := range strings.Fields(string(data)) {
		matches, err := filepath.Glob(glob)
		if err != nil {
			errs = append(errs, fmt.Errorf("e2e: bad directory glob %q in %s: %w", glob, dir, err))
			continue
		}
		for _, m := range matches {
			// Only absolute paths whose last element carries the prefix.
			if !filepath.IsAbs(m) || !strings.HasPrefix(filepath.Base(m), prefix+"-") {
				log.Warn("run record names a directory that is not the run's, left alone", "dir", m)
				continue
			}
			if err := os.RemoveAll(m); err != nil {
				errs = append(errs, err)
			} else {
				log.Info("swept directory", "dir", m)
			}
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("e2e: sweeping run %s: %w", prefix, errors.Join(errs...))
	}
	return os.RemoveAll(dir)
}
