package kubenodes

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// kubeletSysctls are the host-wide kernel settings a kubelet sets at start
// (to its defaults, unless protectKernelDefaults makes it refuse instead).
var kubeletSysctls = []string{
	"vm.overcommit_memory",
	"vm.panic_on_oom",
	"kernel.panic",
	"kernel.panic_on_oops",
	"kernel.keys.root_maxkeys",
	"kernel.keys.root_maxbytes",
}

// recordBase holds one record per live or dead run: what it must put back.
var recordBase = "/run/weft-e2e-kubenodes"

// cgroupBase is where the cgroup hierarchies are mounted.
var cgroupBase = "/sys/fs/cgroup"

// hostRecord is what a run changed on the host outside its namespaces, kept
// in a file so that the next run can put it back if this one was killed.
type hostRecord struct {
	Prefix    string            `json:"prefix"`
	Pid       int               `json:"pid"`
	StartTick uint64            `json:"start_tick"` // /proc/<pid>/stat field 22: tells a reused pid apart
	Sysctls   map[string]string `json:"sysctls"`    // as found before the first kubelet
	Cgroups   []string          `json:"cgroups"`    // the node roots made, in every hierarchy
	MountNS   []uint64          `json:"mount_ns"`   // inodes of the nodes' mount namespaces
}

// Host guards the host-wide state a run changes.
type Host struct {
	path string
	rec  hostRecord
	log  *slog.Logger
}

// claimHost cleans up after dead runs, refuses to share the host with a live
// one (kernel settings are host-wide: two runs would restore each other's
// values), records the kubelet's sysctls as they are now and returns the
// guard whose Restore puts everything back.
func claimHost(prefix string, log *slog.Logger) (*Host, error) {
	if err := os.MkdirAll(recordBase, 0o700); err != nil {
		return nil, fmt.Errorf("kubenodes: %w", err)
	}
	if err := sweepHost(log); err != nil {
		return nil, err
	}
	tick, err := startTick(os.Getpid())
	if err != nil {
		return nil, err
	}
	h := &Host{
		path: filepath.Join(recordBase, prefix+".json"),
		rec:  hostRecord{Prefix: prefix, Pid: os.Getpid(), StartTick: tick, Sysctls: map[string]string{}},
		log:  log,
	}
	for _, k := range kubeletSysctls {
		v, err := readSysctl(k)
		if err != nil {
			return nil, err
		}
		h.rec.Sysctls[k] = v
	}
	if err := h.save(); err != nil {
		return nil, err
	}
	log.Info("kubenodes: host settings recorded; restored at the end", "record", h.path, "sysctls", h.rec.Sysctls)
	return h, nil
}

func (h *Host) save() error {
	data, err := json.MarshalIndent(h.rec, "", "  ")
	if err != nil {
		return err
	}
	tmp := h.path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		return fmt.Errorf("kubenodes: writing the host record: %w", err)
	}
	return os.Rename(tmp, h.path)
}

// MakeCgroupRoot makes /<name> in every cgroup hierarchy (recorded first,
// so that a crash in between leaves nothing unrecorded) and returns the
// kubelet's cgroupRoot.
func (h *Host) MakeCgroupRoot(name string) (string, error) {
	hier, err := hierarchies()
	if err != nil {
		return "", err
	}
	var dirs []string
	for _, d := range hier {
		dirs = append(dirs, filepath.Join(d, name))
	}
	h.rec.Cgroups = append(h.rec.Cgroups, dirs...)
	if err := h.save(); err != nil {
		return "", err
	}
	for _, d := range dirs {
		if err := os.Mkdir(d, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
			return "", fmt.Errorf("kubenodes: making cgroup %s: %w", d, err)
		}
		// A cpuset cgroup takes no task until it has cpus and mems.
		if filepath.Base(filepath.Dir(d)) == "cpuset" {
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				v, err := os.ReadFile(filepath.Join(filepath.Dir(d), f))
				if err == nil {
					_ = os.WriteFile(filepath.Join(d, f), v, 0o644)
				}
			}
		}
	}
	return "/" + name, nil
}

// AddMountNS records a node's mount namespace, whose processes Restore kills.
func (h *Host) AddMountNS(ino uint64) error {
	h.rec.MountNS = append(h.rec.MountNS, ino)
	return h.save()
}

// Restore kills what is left in the run's cgroups and mount namespaces,
// removes the cgroups, puts the sysctls back and deletes the record. What it
// could not do stays in the record for the next run.
func (h *Host) Restore() error {
	err := restoreRecord(h.rec, h.log)
	if err == nil {
		_ = os.Remove(h.path)
	}
	return err
}

// restoreRecord undoes a record: processes first (they hold the cgroups),
// then the cgroups, then the settings.
func restoreRecord(rec hostRecord, log *slog.Logger) error {
	var errs []error
	if err := killMountNS(rec.MountNS); err != nil {
		errs = append(errs, err)
	}
	for _, d := range rec.Cgroups {
		if err := removeCgroupTree(d); err != nil {
			errs = append(errs, err)
		}
	}
	keys := make([]string, 0, len(rec.Sysctls))
	for k := range rec.Sysctls {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		want := rec.Sysctls[k]
		now, err := readSysctl(k)
		if err == nil && now == want {
			continue
		}
		if err := writeSysctl(k, want); err != nil {
			errs = append(errs, err)
			continue
		}
		log.Info("kubenodes: sysctl restored", "key", k, "was", now, "now", want)
	}
	return errors.Join(errs...)
}

// sweepHost restores the records of dead runs and refuses to go on beside a
// live one.
func sweepHost(log *slog.Logger) error {
	files, _ := filepath.Glob(filepath.Join(recordBase, "*.json"))
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		var rec hostRecord
		if err := json.Unmarshal(data, &rec); err != nil {
			log.Warn("kubenodes: unreadable host record; removing it", "file", f, "err", err)
			_ = os.Remove(f)
			continue
		}
		if tick, err := startTick(rec.Pid); err == nil && tick == rec.StartTick {
			return fmt.Errorf("kubenodes: another e2e-kube run (prefix %s, pid %d) is live; the kubelet's kernel settings are host-wide, so one run at a time: wait for it or stop it", rec.Prefix, rec.Pid)
		}
		log.Info("kubenodes: cleaning up after a dead run", "prefix", rec.Prefix, "pid", rec.Pid)
		if err := restoreRecord(rec, log); err != nil {
			return fmt.Errorf("kubenodes: cleaning up dead run %s (record %s): %w", rec.Prefix, f, err)
		}
		_ = os.Remove(f)
	}
	return nil
}

// hierarchies lists the mounted cgroup hierarchies: every directory of
// cgroupBase holding cgroup.procs (v1), or cgroupBase itself (v2).
func hierarchies() ([]string, error) {
	if _, err := os.Stat(filepath.Join(cgroupBase, "cgroup.procs")); err == nil {
		return []string{cgroupBase}, nil
	}
	ents, err := os.ReadDir(cgroupBase)
	if err != nil {
		return nil, fmt.Errorf("kubenodes: reading %s: %w", cgroupBase, err)
	}
	var out []string
	for _, e := range ents {
		d := filepath.Join(cgroupBase, e.Name())
		if _, err := os.Stat(filepath.Join(d, "cgroup.procs")); err == nil {
			out = append(out, d)
		}
	}
	return out, nil
}

// cgroupKillTimeout bounds how long removeCgroupTree kills and waits.
const cgroupKillTimeout = 30 * time.Second

// removeCgroupTree kills every process in dir and below until none is
// left, then removes the cgroups, deepest first. A missing dir is done.
func removeCgroupTree(dir string) error {
	if _, err := os.Stat(dir); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	deadline := time.Now().Add(cgroupKillTimeout)
	for {
		var dirs []string
		_ = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		left := 0
		for _, d := range dirs {
			data, _ := os.ReadFile(filepath.Join(d, "cgroup.procs"))
			for _, f := range strings.Fields(string(data)) {
				if pid, err := strconv.Atoi(f); err == nil && pid > 1 {
					_ = syscall.Kill(pid, syscall.SIGKILL)
					left++
				}
			}
		}
		if left == 0 {
			var errs []error
			for i := len(dirs) - 1; i >= 0; i-- {
				if err := syscall.Rmdir(dirs[i]); err != nil && !errors.Is(err, syscall.ENOENT) {
					errs = append(errs, fmt.Errorf("removing cgroup %s: %w", dirs[i], err))
				}
			}
			if len(errs) == 0 || time.Now().After(deadline) {
				return errors.Join(errs...)
			}
		} else if time.Now().After(deadline) {
			return fmt.Errorf("kubenodes: %d processes still in cgroup %s after %s", left, dir, cgroupKillTimeout)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// killMountNS kills every process in one of the mount namespaces (the
// nodes' containerd shims outlive containerd) and waits until none is left.
func killMountNS(inos []uint64) error {
	if len(inos) == 0 {
		return nil
	}
	want := map[uint64]bool{}
	for _, i := range inos {
		want[i] = true
	}
	deadline := time.Now().Add(cgroupKillTimeout)
	for {
		left := 0
		procs, _ := filepath.Glob("/proc/[0-9]*")
		for _, p := range procs {
			pid, err := strconv.Atoi(filepath.Base(p))
			if err != nil || pid == os.Getpid() {
				continue
			}
			var st syscall.Stat_t
			if err := syscall.Stat(filepath.Join(p, "ns", "mnt"), &st); err != nil || !want[st.Ino] {
				continue
			}
			if zombie(pid) {
				continue
			}
			_ = syscall.Kill(pid, syscall.SIGKILL)
			left++
		}
		if left == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("kubenodes: %d processes still in the nodes' mount namespaces after %s", left, cgroupKillTimeout)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// zombie reports whether pid has exited and waits for its parent.
func zombie(pid int) bool {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	s := string(data)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || len(s) < i+3 || s[i+2] == 'Z' || s[i+2] == 'X'
}

// startTick is field 22 of /proc/<pid>/stat, the process's start time.
func startTick(pid int) (uint64, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	s := string(data)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, fmt.Errorf("kubenodes: unreadable /proc/%d/stat", pid)
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 20 {
		return 0, fmt.Errorf("kubenodes: short /proc/%d/stat", pid)
	}
	return strconv.ParseUint(f[19], 10, 64)
}

func sysctlPath(key string) string {
	return filepath.Join("/proc/sys", strings.ReplaceAll(key, ".", "/"))
}

func readSysctl(key string) (string, error) {
	data, err := os.ReadFile(sysctlPath(key))
	if err != nil {
		return "", fmt.Errorf("kubenodes: reading sysctl %s: %w", key, err)
	}
	return strings.TrimSpace(string(data)), nil
}

func writeSysctl(key, v string) error {
	if err := os.WriteFile(sysctlPath(key), []byte(v+"\n"), 0o644); err != nil {
		return fmt.Errorf("kubenodes: restoring sysctl %s to %s: %w", key, v, err)
	}
	return nil
}
